"""Translation checked by the engines' own config classes: DeepSpeedConfig, TransformerConfig."""

from __future__ import annotations

import inspect
import warnings

import pytest

from dsforge.problems import errors
from dsforge.recipe import Topology, load_recipe, resolve, topology_for, validate
from dsforge.translate.deepspeed_config import deepspeed_config
from dsforge.translate.groups import rank_groups
from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                        parallel_state_kwargs, transformer_config_kwargs)
from dsforge.translate.optimizer import ops_built_at_run_time
from tests.conftest import RECIPES, make_recipe


class _DataParallel:
    """The one mpu method DeepSpeedConfig asks: how many data-parallel ranks share a batch."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.fixture(scope="module")
def deepspeed_comm(tmp_path_factory):
    """A one-rank gloo world so DeepSpeedConfig consults the mpu for the data-parallel size."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed
    from dsforge.runtime.assemble.cpu_backend import skip_deepspeed_shm_allreduce

    skip_deepspeed_shm_allreduce()  # a CPU-only op this test has no use for
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    dist.destroy_process_group()


def _resolved(path, *overrides):
    recipe = load_recipe(path, overrides)
    topology, problems = topology_for(recipe)
    assert not problems
    return recipe, topology


def _check_with_deepspeed(resolved, device="cuda"):
    from deepspeed.runtime.config import DeepSpeedConfig

    r, lay = resolved.recipe, resolved.layout
    config = deepspeed_config(model=r.model, train=r.train, zero=r.zero, layout=lay, device=device)
    # DeepSpeed's data-parallel group is dp x cp (engine.MegatronMPU): each sequence counts
    # once a context-parallel rank.
    ds = DeepSpeedConfig(config, mpu=_DataParallel(lay.dp_cp))
    assert ds.train_batch_size == lay.global_batch * lay.cp
    assert ds.gradient_accumulation_steps == lay.grad_accum
    assert ds.zero_optimization_stage == r.zero.stage
    assert ds.bfloat16_config.enabled == (r.train.precision == "bf16")
    assert ds.float16_config.enabled == (r.train.precision == "fp16")
    assert ds.gradient_clipping == r.train.grad_clip
    if r.zero.stage == 3:  # the memory model's step-time fp32 gradient is one sub-group
        from dsforge.estimate.memory import SUB_GROUP_SIZE
        assert ds.zero_config.sub_group_size == SUB_GROUP_SIZE
    return ds


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_deepspeed_accepts_every_recipe_at_every_valid_stage(deepspeed_comm, path, stage):
    recipe, topology = _resolved(path, f"zero.stage={stage}")
    problems = errors(validate(recipe, topology))
    expected = set()
    if recipe.parallel.ep > 1 and stage == 3:
        expected.add("E6")  # expert parallelism with ZeRO-3
    assert {p.rule for p in problems} == expected
    if problems:
        return
    _check_with_deepspeed(resolve(recipe, topology))


@pytest.mark.parametrize("overrides, device", [
    (("zero.stage=2", "zero.offload_optimizer=cpu"), "cpu"),
    (("zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu"), "cpu"),
    (("zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_ratio=0.3"), "cpu"),
])
def test_deepspeed_accepts_offload(deepspeed_comm, overrides, device):
    resolved = resolve(make_recipe(*overrides), Topology(world_size=8))
    ds = _check_with_deepspeed(resolved)
    assert ds.zero_config.offload_optimizer.device == device
    if "zero.offload_params=cpu" in overrides:
        assert ds.zero_config.offload_param.device == "cpu"
    if "zero.offload_ratio=0.3" in overrides:
        assert ds.zero_config.offload_optimizer.ratio == pytest.approx(0.3)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_deepspeed_accepts_precisions_and_schedules(deepspeed_comm, precision, decay):
    resolved = resolve(make_recipe(f"train.precision={precision}", f"train.lr_decay={decay}",
                                   "train.warmup_steps=0"), Topology(world_size=8))
    _check_with_deepspeed(resolved)


def test_deepspeed_rejects_a_misspelled_zero_key(deepspeed_comm):
    """The check has teeth: DeepSpeed's pydantic model forbids unknown zero keys."""
    from deepspeed.runtime.config import DeepSpeedConfig

    resolved = resolve(make_recipe(), Topology(world_size=8))
    config = deepspeed_config(model=resolved.recipe.model, train=resolved.recipe.train, zero=resolved.recipe.zero,
                              layout=resolved.layout, device="cuda")
    config["zero_optimization"]["stgae"] = 1
    with pytest.raises(Exception, match="stgae"):
        DeepSpeedConfig(config, mpu=_DataParallel(resolved.layout.dp))


def test_scheduler_without_warmup_starts_at_the_peak():
    train = make_recipe("train.warmup_steps=0").train
    resolved = resolve(make_recipe("train.warmup_steps=0"), Topology(world_size=8))
    section = deepspeed_config(model=resolved.recipe.model, train=train, zero=resolved.recipe.zero,
                               layout=resolved.layout, device="cuda")["scheduler"]
    assert section["type"] == "WarmupCosineLR" and section["params"]["warmup_min_ratio"] == 1.0


def _rates(*overrides: str, steps: int | None = None) -> list[float]:
    """The rate of each step, as DeepSpeed's engine runs the translated scheduler: built (from
    DeepSpeed's own class of the section's type, or dsforge's where DeepSpeed has none),
    started by dsforge, stepped after each step; `steps` past train.steps if given."""
    import torch
    from deepspeed.runtime import lr_schedules

    from dsforge.runtime.assemble.engine import start_schedule
    from dsforge.runtime.assemble.schedule import make_scheduler
    from dsforge.translate.deepspeed_config import scheduler_section

    train = make_recipe(*overrides).train
    resolved = resolve(make_recipe(*overrides), Topology(world_size=8))
    config = deepspeed_config(model=resolved.recipe.model, train=train, zero=resolved.recipe.zero,
                              layout=resolved.layout, device="cuda")
    section = scheduler_section(train)
    own = make_scheduler(section)
    assert (own is None) == (config.get("scheduler") == section)  # DeepSpeed builds it, or dsforge
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.lr)
    scheduler = own(optimizer) if own else \
        getattr(lr_schedules, section["type"])(optimizer, **section["params"])
    start_schedule(scheduler)
    rates = []
    for _ in range(steps or train.steps):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return rates


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_step_k_of_the_warmup_runs_k_over_warmup_of_the_peak(decay):
    """One step at rate 0, then linear to the peak at step warmup_steps, as Megatron-LM's
    scheduler (DeepSpeed's alone gave steps 0 and 1 both 0, and step 0 0 without a warmup)."""
    rates = _rates("train.steps=10", "train.warmup_steps=4", "train.lr=1.0", f"train.lr_decay={decay}",
                   "train.min_lr_ratio=0.1")
    assert rates[:4] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert rates[4] == pytest.approx(1.0, abs=0.1) and rates[4] > rates[3]
    assert _rates("train.steps=10", "train.warmup_steps=0", "train.lr=1.0",
                  f"train.lr_decay={decay}")[0] == pytest.approx(1.0)


@pytest.mark.parametrize("warmup", [0, 4])
@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_every_decay_falls_to_min_lr_ratio_with_and_without_warmup(decay, warmup):
    """After the warmup (or from step 2 without one: DeepSpeed's cosine holds the peak two
    steps) the rate falls every step to min_lr_ratio x lr at the schedule's end, and stays
    there past it (lr_decay_steps shorter than the run). DeepSpeed's WarmupDecayLR, which
    linear used, never decayed without a warmup and decayed to 0 with one."""
    rates = _rates("train.steps=20", f"train.warmup_steps={warmup}", "train.lr=1.0",
                   f"train.lr_decay={decay}", "train.min_lr_ratio=0.2", "train.lr_decay_steps=12")
    decaying = rates[max(warmup, 2):12]
    assert all(later < earlier for earlier, later in zip(decaying, decaying[1:])), rates
    assert rates[12:] == pytest.approx([0.2] * 8), rates
    assert max(rates) == pytest.approx(1.0, abs=0.1)


def test_linear_decay_is_a_straight_line_from_the_peak_to_the_floor():
    """Megatron-LM's linear decay: the peak at step warmup_steps, min_lr_ratio x lr at step
    lr_decay_steps, equal steps down between them."""
    rates = _rates("train.steps=10", "train.warmup_steps=2", "train.lr=1.0", "train.lr_decay=linear",
                   "train.min_lr_ratio=0.1")
    assert rates == pytest.approx([0.0, 0.5, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125])
    no_warmup = _rates("train.steps=10", "train.warmup_steps=0", "train.lr=1.0",
                       "train.lr_decay=linear", "train.min_lr_ratio=0.0")
    assert no_warmup == pytest.approx([1.0 - k / 10 for k in range(10)])


def test_constant_stays_at_the_peak():
    assert _rates("train.steps=6", "train.warmup_steps=0", "train.lr=1.0",
                  "train.lr_decay=constant") == pytest.approx([1.0] * 6)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_megatron_accepts_every_recipe(path):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    recipe, topology = _resolved(path)
    resolved = resolve(recipe, topology)
    r, lay = resolved.recipe, resolved.layout
    kwargs = transformer_config_kwargs(model=r.model, train=r.train, layout=lay, device="cuda")
    config = build_transformer_config(kwargs)
    assert config.num_layers == r.model.num_layers
    assert config.num_query_groups == r.model.query_groups
    assert config.sequence_parallel == lay.sequence_parallel
    assert (config.num_moe_experts or 0) == (r.model.moe.num_experts if r.model.moe else 0)
    inspect.signature(parallel_state.initialize_model_parallel).bind(**parallel_state_kwargs(lay))
    inspect.signature(GPTModel.__init__).bind(None, config, None, **gpt_model_kwargs(model=r.model, layout=lay))


@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_adamw_implementation_is_decided_in_translation(deepspeed_comm, device, offload):
    """adam_impl auto: torch's fused AdamW on GPUs and its for-loop AdamW on CPUs (no DeepSpeed
    op to build); DeepSpeed's CPU Adam with optimizer offload."""
    stage = "zero.stage=2" if offload == "cpu" else "zero.stage=1"
    resolved = resolve(make_recipe(stage, f"zero.offload_optimizer={offload}"),
                       Topology(world_size=8))
    ds = _check_with_deepspeed(resolved, device=device)
    assert ds.optimizer_name == "adamw"
    params = ds.optimizer_params
    assert params.get("torch_adam", False) == (offload == "none")
    assert params.get("fused", False) == (device == "cuda" and offload == "none")
    r = resolved.recipe
    built = ops_built_at_run_time(train=r.train, zero=r.zero, device=device)
    assert built == (("cpu_adam",) if offload == "cpu" else ())


@pytest.mark.parametrize("impl, params, built", [
    ("fused", {"torch_adam": True, "foreach": False, "fused": True}, ()),
    ("foreach", {"torch_adam": True, "foreach": True}, ()),
    ("for-loop", {"torch_adam": True, "foreach": False}, ()),
    ("deepspeed", {}, ("fused_adam",)),
])
def test_adam_impl_named_in_the_recipe(deepspeed_comm, impl, params, built):
    """Each train.adam_impl reaches DeepSpeed's config as the keys DeepSpeed's
    _configure_basic_optimizer reads (torch_adam, foreach; the rest go to torch.optim.AdamW)."""
    resolved = resolve(make_recipe(f"train.adam_impl={impl}"), Topology(world_size=8))
    ds = _check_with_deepspeed(resolved, device="cuda")
    got = {key: ds.optimizer_params[key] for key in ("torch_adam", "foreach", "fused")
           if key in ds.optimizer_params}
    assert got == params
    r = resolved.recipe
    assert ops_built_at_run_time(train=r.train, zero=r.zero, device="cuda") == built


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_megatron_cpu_settings_are_decided_in_translation(device):
    """CPU ranks initialise on the CPU and use unbatched p2p (gloo's tag pairing, see megatron.py)."""
    resolved = resolve(make_recipe("parallel.pp=2", "parallel.vpp=2"), Topology(world_size=8))
    r = resolved.recipe
    config = build_transformer_config(transformer_config_kwargs(
        model=r.model, train=r.train, layout=resolved.layout, device=device))
    assert config.use_cpu_initialization == (device == "cpu")
    assert config.batch_p2p_comm == (device == "cuda")


def test_translation_refuses_an_unknown_device():
    resolved = resolve(make_recipe(), Topology(world_size=8))
    r = resolved.recipe
    with pytest.raises(ValueError, match="'gpu'"):
        deepspeed_config(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                         device="gpu")
    with pytest.raises(ValueError, match="'gpu'"):
        transformer_config_kwargs(model=r.model, train=r.train, layout=resolved.layout, device="gpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_plan_shows_the_configs_a_run_on_the_device_uses(device):
    import torch

    from dsforge.plan import build_plan, render_plan

    resolved = resolve(make_recipe(), Topology(world_size=8))
    r = resolved.recipe
    plan = build_plan(resolved, device=device)
    assert plan["device"] == device
    assert plan["deepspeed"] == deepspeed_config(model=r.model, train=r.train, zero=r.zero,
                                                 layout=resolved.layout, device=device)
    assert plan["megatron"]["transformer_config"] == transformer_config_kwargs(
        model=r.model, train=r.train, layout=resolved.layout, device=device)
    assert f"DeepSpeed config (for {device} ranks)" in render_plan(plan)
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert build_plan(resolved)["device"] == here  # auto: what `dsforge run` would pick here
    # A GPU recipe planned where auto finds no GPU says how to plan its GPU ranks; asked for
    # a device, the plan does not.
    hint = "(no GPU here: --device cuda plans the recipe's NVIDIA H100 SXM ranks)"
    on_h100 = resolve(make_recipe("cluster.gpu=h100", "cluster.gpus_per_node=8"), Topology(world_size=8))
    assert (hint in render_plan(build_plan(on_h100))) == (here == "cpu")
    assert hint not in render_plan(build_plan(on_h100, device=device))


def test_checkpointing_translates_to_megatron_recompute():
    for mode, granularity in (("none", None), ("selective", "selective"), ("full", "full")):
        resolved = resolve(make_recipe(f"train.activation_checkpointing={mode}"), Topology(world_size=8))
        r = resolved.recipe
        config = build_transformer_config(transformer_config_kwargs(
            model=r.model, train=r.train, layout=resolved.layout, device="cuda"))
        assert config.recompute_granularity == granularity


def _covers_world_once(groups, world):
    flat = sorted(rank for group in groups for rank in group)
    return flat == list(range(world))


def test_rank_groups_of_the_70b_example():
    recipe, topology = _resolved(RECIPES[0].parent / "70b_pp4.yaml")
    groups = rank_groups(resolve(recipe, topology).layout)
    assert groups["tp"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["pp"][0] == [0, 8, 16, 24] and groups["dp"][0] == [0, 4]
    for name in ("tp", "pp", "dp"):
        assert _covers_world_once(groups[name], 32)


def test_expert_groups_are_carved_out_of_data_parallel():
    recipe, topology = _resolved(RECIPES[0].parent / "moe_32gpu_tp4_ep2.yaml")
    layout = resolve(recipe, topology).layout
    groups = rank_groups(layout)
    assert (layout.dp, layout.ep, layout.edp) == (8, 2, 4)
    assert groups["ep"][0] == [0, 4] and len(groups["edp"][0]) == 4
    assert all(len(g) == 4 for g in groups["etp"])
    for name in ("ep", "etp", "edp"):
        assert _covers_world_once(groups[name], 32)


@pytest.mark.parametrize("stage, precision, wrappers", [
    (0, "bf16", ["FP16_UnfusedOptimizer"]), (0, "fp32", []),
    (1, "bf16", ["DeepSpeedZeroOptimizer"]), (2, "bf16", ["DeepSpeedZeroOptimizer"]),
    (3, "bf16", ["DeepSpeedZeroOptimizer_Stage3"]), (3, "fp32", ["DeepSpeedZeroOptimizer_Stage3"]),
])
def test_deepspeed_steps_torch_fused_adamw_at_every_stage(deepspeed_comm, monkeypatch, stage,
                                                          precision, wrappers):
    """What GPU ranks get by default (adam_impl auto): torch.optim.AdamW with fused=True, wrapped
    by DeepSpeed as the memory model counts (estimate/memory.py: ZeRO-0 in 16 bits is
    FP16_UnfusedOptimizer, one fp32 copy of each gradient; FusedAdam would get FP16_Optimizer).
    torch runs the fused kernel on CPU tensors too, so DeepSpeed's engine is built here for real."""
    import deepspeed
    import torch

    from dsforge.runtime.loop.manifest import implementations, optimizer_chain

    resolved = resolve(make_recipe(f"zero.stage={stage}", f"train.precision={precision}",
                                   "parallel.dp=1", "train.global_batch=1"), Topology(world_size=1))
    r = resolved.recipe
    config = deepspeed_config(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                              device="cuda")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    monkeypatch.setenv("LOCAL_RANK", "0")  # what a launcher sets; the engine asks for it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config,
                                                       model_parameters=model.parameters())
    used = implementations(optimizer, kernels="torch", kernels_why="", sdpa_backend="auto")
    assert used["optimizer"] == wrappers + ["AdamW"]  # what manifest.json records
    assert used["optimizer_fused"] is True and not used["optimizer_foreach"]
    assert isinstance(optimizer_chain(optimizer)[-1], torch.optim.AdamW)
