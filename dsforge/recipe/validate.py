"""Rules that span recipe sections or need the world size.

`validate(recipe, topology)` runs every rule and returns every violation (errors and
warnings) instead of stopping at the first. Rule ids match docs/validation.md, which says
where each rule comes from (DeepSpeed, Megatron-Core, KempnerForge, torchtitan). Rules local
to one section are checked when the section is built (dsforge/schema/); the rules that read the
files the data section names live in data_rules/.

Every problem names recipe fields the user can change. Quantities dsforge derives (dp, the
microbatches per step, the expert tensor-parallel size when parallel.etp is left out) appear
in the message with where they come from, never as a field, and a fix suggests values of the
fields themselves, each checked by running the rules again with that one value changed: it
clears the problem, breaks no rule that holds now, and leaves no problem naming that field
(fixes.py finds and writes them).
"""

from __future__ import annotations

import functools
from typing import Iterator

from dsforge.problems import Problem
from dsforge.recipe.data_rules import DATA_RULES
from dsforge.recipe.extras import missing_extras
from dsforge.recipe.fp8 import fp8_recipe_problems
from dsforge.recipe.fixes import (Context, Rule, batch_fields, batch_fix, divisors_that_work,
                                  microbatch_rule, multiples_that_work, use)
from dsforge.recipe.init_from import init_from_problems
from dsforge.recipe.layout import Topology, batch_sizes, data_parallel_size
from dsforge.schema import TORCH_ADAM_IMPLS, Recipe


def validate(recipe: Recipe, topology: Topology | None) -> list[Problem]:
    """Every violated rule for this recipe in this world (topology None: world-free rules)."""
    problems = _run(recipe, topology, failing=None)
    if not problems:
        return problems
    # Again, now that the fixes can check their suggestions against what fails already.
    return _run(recipe, topology, failing=frozenset(p.rule for p in problems))


def _run(recipe: Recipe, topology: Topology | None, failing: frozenset[str] | None) -> list[Problem]:
    dp = data_parallel_size(recipe, topology.world_size) if topology else None
    ctx = Context(topology=topology, dp=dp, batch=batch_sizes(recipe, dp) if dp else None,
                  failing=failing, check=functools.partial(_run, topology=topology, failing=None))
    return [problem for rule in RULES for problem in rule(recipe, ctx)]


def _world_field(ctx: Context) -> str:
    """Where the world size came from (--world-size, the hostfile, the cluster section)."""
    return ctx.topology.source or "world size"


def _etp_field(recipe: Recipe) -> str:
    """The field that sets the expert tensor-parallel size (parallel.tp when etp is left out)."""
    return "parallel.etp" if recipe.parallel.etp is not None else "parallel.tp"


def _dp_origin(recipe: Recipe, ctx: Context) -> str:
    """How dp came about, e.g. "dp 4 = world size 8 / (tp 2 x pp 1)"."""
    p = recipe.parallel
    if p.dp != -1:
        return f"dp {ctx.dp} = parallel.dp"
    return (f"dp {ctx.dp} = {_world_field(ctx)} {ctx.topology.world_size} / "
            f"(tp {p.tp} x pp {p.pp})")


def parallel_arithmetic(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """P1/P2: world = dp x tp x pp x cp (EP is carved out of dp and does not multiply)."""
    if ctx.topology is None or ctx.dp is not None:
        return
    p, world = recipe.parallel, ctx.topology.world_size
    model_parallel = p.tp * p.pp * p.cp
    fields = {_world_field(ctx): world, "parallel.tp": p.tp, "parallel.pp": p.pp}
    if p.dp == -1:
        yield Problem(rule="P2", fields=fields,
                      message=f"{world} ranks do not divide into groups of tp x pp x cp = "
                              f"{model_parallel} model-parallel ranks",
                      fix=use(_model_parallel_options(recipe, ctx, "P2"),
                              "change parallel.tp or parallel.pp")
                          + f", or a world size that is a multiple of {model_parallel}")
    elif world % model_parallel == 0:
        yield Problem(rule="P1", fields={**fields, "parallel.dp": p.dp},
                      message=f"dp x tp x pp x cp = {p.dp * model_parallel}, not the world size",
                      fix=f"set parallel.dp: {world // model_parallel}, or -1 (the rest of the world)")
    else:
        yield Problem(rule="P1", fields={**fields, "parallel.dp": p.dp},
                      message=f"dp x tp x pp x cp = {p.dp * model_parallel}, not the world size, "
                              f"and no dp fits: {world} is not a multiple of tp x pp = {model_parallel}",
                      fix=use(_model_parallel_options(recipe, ctx, "P1"),
                              "change parallel.tp, parallel.pp or parallel.dp"))


def _model_parallel_options(recipe: Recipe, ctx: Context, rule: str) -> dict[str, str]:
    world = ctx.topology.world_size
    return {path: divisors_that_work(recipe, ctx, rule, path, world)
            for path in ("parallel.tp", "parallel.pp")}


def tensor_parallel_in_node(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """P4: a TP group spanning nodes puts per-layer all-reduces on the inter-node network."""
    top, tp = ctx.topology, recipe.parallel.tp
    if top is None or top.node_slots is None or tp == 1 or ctx.dp is None:
        return
    # A TP group (ranks g*tp .. g*tp+tp-1) spans nodes when a node boundary falls inside it.
    spanning = top.groups_spanning_nodes(tp)
    if spanning:
        tps = divisors_that_work(recipe, ctx, "P4", "parallel.tp", tp)
        yield Problem(rule="P4", severity="warning",
                      fields={"parallel.tp": tp, "GPUs per node": min(top.node_slots)},
                      message=f"{spanning} tensor-parallel group(s) span nodes; every layer "
                              "then all-reduces over the inter-node network",
                      fix=use({"parallel.tp": tps}, "keep tp <= GPUs per node")
                          + " (pp or dp can span nodes)")


def batch_arithmetic(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """B1/B2: global_batch = micro_batch x grad_accum x dp, exactly."""
    if ctx.dp is None or ctx.batch is not None:
        return
    t, dp = recipe.train, ctx.dp
    fields, origin = batch_fields(t), _dp_origin(recipe, ctx)
    if t.micro_batch is not None and t.global_batch % (t.micro_batch * dp) == 0:
        yield Problem(rule="B1", fields=fields,
                      message=f"micro_batch x grad_accum x dp = {t.micro_batch} x {t.grad_accum} "
                              f"x {dp} is not global_batch ({origin})",
                      fix=batch_fix(recipe, ctx) + "; or leave one of them out, it is derived")
        return
    # global_batch is divided by whichever of micro_batch and grad_accum the recipe gives.
    name = "grad_accum" if t.micro_batch is None else "micro_batch"
    value = getattr(t, name)
    yield Problem(rule="B2", fields=fields,
                  message=f"global_batch is not a positive multiple of {name} x dp = {value} x {dp} "
                          f"({origin})",
                  fix=batch_fix(recipe, ctx))


def pipeline_layers(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """L1/L2: every (virtual) pipeline stage gets the same whole number of layers."""
    p, layers = recipe.parallel, recipe.model.num_layers
    if layers % (p.pp * p.vpp) == 0:
        return
    rule = "L1" if p.vpp == 1 else "L2"
    options = {path: divisors_that_work(recipe, ctx, rule, path, layers)
               for path in (["parallel.vpp"] if p.vpp > 1 else []) + ["parallel.pp"]}
    stages = p.pp * p.vpp
    options["model.num_layers"] = multiples_that_work(recipe, ctx, rule, "model.num_layers",
                                                      stages, layers)
    fields = {"model.num_layers": layers, "parallel.pp": p.pp}
    if p.vpp == 1:
        yield Problem(rule="L1", fields=fields, message=f"num_layers is not divisible by pp={p.pp}",
                      fix=use(options, "change parallel.pp or model.num_layers"))
        return
    yield Problem(rule="L2", fields={**fields, "parallel.vpp": p.vpp},
                  message=f"num_layers is not divisible by pp*vpp={stages}",
                  fix=use(options, "change parallel.vpp, parallel.pp or model.num_layers"))


def pipeline_microbatches(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """L6: fewer microbatches than stages hangs (torchtitan #775); L4: interleaved grouping."""
    p, t = recipe.parallel, recipe.train
    rule = microbatch_rule(p.pp, p.vpp, ctx.batch.grad_accum) if ctx.batch else None
    if rule is None:
        return
    m, fields = ctx.batch.grad_accum, {**batch_fields(t), "parallel.pp": p.pp}
    if t.grad_accum is not None:
        runs = f"train.grad_accum = {m} microbatches per step"
    else:
        runs = (f"global_batch / (micro_batch x dp) = {m} microbatches per step, "
                f"{_dp_origin(recipe, ctx)}")
    if rule == "L6":
        yield Problem(rule="L6", fields=fields,
                      message=f"fewer microbatches than pipeline stages: {runs}",
                      fix=batch_fix(recipe, ctx))
        return
    yield Problem(rule="L4", fields={**fields, "parallel.vpp": p.vpp},
                  message="the interleaved schedule needs the microbatches per step to be a "
                          f"multiple of pp: {runs}",
                  fix=batch_fix(recipe, ctx))


def pipeline_embeddings(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """L5: tied embeddings across pipeline stages need an embedding-group gradient sync."""
    if recipe.model.tie_embeddings and recipe.parallel.pp > 1:
        yield Problem(rule="L5", fields={"model.tie_embeddings": True, "parallel.pp": recipe.parallel.pp},
                      message="tied input/output embeddings live on the first and last pipeline "
                              "stages; dsforge does not synchronise their gradients across stages",
                      fix="set model.tie_embeddings: false, or parallel.pp: 1")


def tensor_parallel_shapes(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """T1: heads, query groups and MLP widths split evenly across the tensor-parallel group."""
    m, tp = recipe.model, recipe.parallel.tp
    if m.num_attention_heads % tp:
        yield Problem(rule="T1", fields={"model.num_attention_heads": m.num_attention_heads,
                                         "parallel.tp": tp},
                      message="attention heads must divide evenly across tp",
                      fix=use({"parallel.tp": _tp_choices(recipe, ctx)}, "change parallel.tp"))
    groups = m.num_kv_heads  # unset: one per head, which the rule above covers
    if groups is not None and groups % tp and tp % groups:
        yield Problem(rule="T1", fields={"model.num_kv_heads": groups, "parallel.tp": tp},
                      message="the number of KV heads (query groups) must be a multiple or a "
                              "divisor of tp",
                      fix=use({"parallel.tp": _tp_choices(recipe, ctx)}, "change parallel.tp"))
    if m.ffn_hidden_size % tp:
        widths = multiples_that_work(recipe, ctx, "T1", "model.ffn_hidden_size", tp,
                                     m.ffn_hidden_size)
        yield Problem(rule="T1", fields={"model.ffn_hidden_size": m.ffn_hidden_size, "parallel.tp": tp},
                      message="the MLP width must divide evenly across tp",
                      fix=use({"model.ffn_hidden_size": widths,
                               "parallel.tp": _tp_choices(recipe, ctx)}, f"use a multiple of {tp}"))
    etp = recipe.parallel.expert_tp
    if m.moe is not None and m.moe.ffn_hidden_size % etp:
        yield from _expert_width(recipe, ctx, etp)


def _tp_choices(recipe: Recipe, ctx: Context) -> str:
    of = ctx.topology.world_size if ctx.topology else recipe.model.num_attention_heads
    return divisors_that_work(recipe, ctx, "T1", "parallel.tp", of)


def _expert_width(recipe: Recipe, ctx: Context, etp: int) -> Iterator[Problem]:
    width, field = recipe.model.moe.ffn_hidden_size, _etp_field(recipe)
    widths = multiples_that_work(recipe, ctx, "T1", "model.moe.ffn_hidden_size", etp, width)
    etps = divisors_that_work(recipe, ctx, "T1", "parallel.etp", width)
    unset = "" if recipe.parallel.etp is not None else " (parallel.etp is unset, so expert tp = tp)"
    yield Problem(rule="T1", fields={"model.moe.ffn_hidden_size": width, field: etp},
                  message=f"the expert MLP width must divide evenly across expert tp{unset}",
                  fix=use({"model.moe.ffn_hidden_size": widths, "parallel.etp": etps},
                          f"use a multiple of {etp}"))


def context_parallel(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """T7: context parallelism (Ulysses, runtime/assemble/layers.py) cuts each sequence into
    2 cp chunks, two per rank (runtime/context_shards.py), and trades the sequence
    shard for heads / cp of every head: the sequence, the heads and the KV heads each rank
    holds after tp must divide by cp."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    if p.cp == 1:
        return
    if t.seq_len % (2 * p.cp):
        yield Problem(rule="T7", fields={"train.seq_len": t.seq_len, "parallel.cp": p.cp},
                      message=f"the sequence must cut into 2 x cp = {2 * p.cp} equal chunks",
                      fix=f"use a train.seq_len that is a multiple of {2 * p.cp}, or a smaller "
                          "parallel.cp")
    for field, heads in (("model.num_attention_heads", m.num_attention_heads),
                         ("model.num_kv_heads", m.query_groups)):
        per_tp = heads // p.tp  # heads % tp is T1's
        if heads % p.tp == 0 and per_tp % p.cp:
            choices = ", ".join(str(d) for d in range(1, per_tp + 1) if per_tp % d == 0)
            yield Problem(rule="T7", fields={field: heads, "parallel.tp": p.tp, "parallel.cp": p.cp},
                          message="each rank trades its sequence shard for heads / (tp x cp) of "
                                  f"every head: {heads} heads do not divide by tp x cp = "
                                  f"{p.tp * p.cp}",
                          fix=f"use a parallel.cp that divides the {per_tp} each tensor-parallel "
                              f"rank holds ({choices}), or more {field.split('.')[1]}")


def sequence_length(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """T6: training sequences must fit the model's position range. T9: under sequence
    parallelism each tensor-parallel rank holds 1/tp of a rank's sequence (its cp shard):
    Megatron scatters the embeddings' output along the sequence and asserts that it divides
    (mappings.py `_split_along_first_dim`); nothing pads it, so the job would fail at step 1."""
    t, m, p = recipe.train, recipe.model, recipe.parallel
    if t.seq_len > m.max_seq_len:
        yield Problem(rule="T6", fields={"train.seq_len": t.seq_len, "model.max_seq_len": m.max_seq_len},
                      message="seq_len exceeds the model's max_seq_len",
                      fix=f"use train.seq_len <= {m.max_seq_len}, or raise model.max_seq_len")
    if p.sequence_parallel and p.tp > 1 and t.seq_len % p.cp == 0 and t.seq_len // p.cp % p.tp:
        step = p.tp * p.cp * (2 if p.cp > 1 else 1)  # with T7's 2 x cp chunks
        below = t.seq_len // step * step
        yield Problem(rule="T9", fields={"train.seq_len": t.seq_len, "parallel.tp": p.tp,
                                         "parallel.cp": p.cp, "parallel.sequence_parallel": True},
                      message=f"sequence parallelism splits each rank's sequence (seq_len / cp) "
                              f"into tp = {p.tp} equal parts",
                      fix=f"use a train.seq_len that is a multiple of {step} (e.g. "
                          f"{below or step}), or parallel.sequence_parallel: false")


def expert_parallel(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """E1/E3/E4/E6/E7/E8/E10 and the expert grid: etp x ep x edp x pp must tile the world."""
    m, p = recipe.model, recipe.parallel
    if m.moe is None:
        if p.ep > 1:
            yield Problem(rule="E1", fields={"parallel.ep": p.ep, "model.moe": None},
                          message="expert parallelism needs an MoE model",
                          fix="set parallel.ep: 1, or add a model.moe section")
        return
    if m.moe.num_experts % p.ep:
        yield Problem(rule="E1", fields={"model.moe.num_experts": m.moe.num_experts, "parallel.ep": p.ep},
                      message="experts must divide evenly across expert-parallel ranks",
                      fix=use({"parallel.ep": _ep_choices(recipe, ctx)}, "change parallel.ep"))
    if p.tp > 1 and not p.sequence_parallel:
        yield Problem(rule="E3", fields={"parallel.tp": p.tp, "parallel.sequence_parallel": False},
                      message="MoE with tensor parallelism requires sequence parallelism "
                              "(Megatron-Core 0.16 raises otherwise)",
                      fix="set parallel.sequence_parallel: true")
    if p.ep == 1 and p.expert_tp not in (1, p.tp):
        yield _expert_tp_without_ep(recipe)
    if m.bias and p.expert_tp > 1:
        yield Problem(rule="E4", fields={"model.bias": True, _etp_field(recipe): p.expert_tp},
                      message="bias in MoE expert layers needs expert tensor parallel size 1",
                      fix="set model.bias: false, or parallel.etp: 1")
    if m.bias and p.ep == 1:
        # Checked by building and running the model: tests/unit/test_accepted_builds.py.
        yield Problem(rule="E8", fields={"model.bias": True, "parallel.ep": 1},
                      message="Megatron-Core 0.16 adds the expert bias in place onto the output "
                              "of its expert all-reduce, which without expert parallelism is the "
                              "input returned as is; autograd refuses it at the first step",
                      fix=use({"parallel.ep": divisors_that_work(recipe, ctx, "E8", "parallel.ep",
                                                                 m.moe.num_experts)},
                              "use parallel.ep >= 2") + ", or set model.bias: false")
    if p.ep > 1 and recipe.zero.stage == 3:
        yield Problem(rule="E6", fields={"parallel.ep": p.ep, "zero.stage": 3},
                      message="DeepSpeed's ZeRO-3 partitions every parameter over the data-parallel "
                              "group; expert weights differ across expert-parallel ranks and "
                              "DeepSpeed refuses its MoE handling with ZeRO stage 3",
                      fix="use zero.stage 1 or 2 with ep > 1, or parallel.ep: 1 with ZeRO-3")
    if p.ep > 1 and recipe.zero.stage == 0 and recipe.train.checkpoint_every:
        yield Problem(rule="E7", fields={"parallel.ep": p.ep, "zero.stage": 0,
                                         "train.checkpoint_every": recipe.train.checkpoint_every},
                      message="without ZeRO, DeepSpeed saves optimizer state from data-parallel rank "
                              "0 only, but with expert parallelism the data-parallel ranks hold "
                              "different experts, so their optimizer state would be lost",
                      fix="use zero.stage 1 or 2 (each rank saves its own optimizer partition), "
                          "or train.checkpoint_every: 0")
    if ctx.topology is not None and ctx.dp is not None:
        yield from _expert_grid(recipe, ctx)


def _expert_tp_without_ep(recipe: Recipe) -> Problem:
    """E10: at ep 1 the experts are split like the dense layers (etp = tp) or whole (etp 1)."""
    p = recipe.parallel
    return Problem(rule="E10", fields={"parallel.etp": p.expert_tp, "parallel.tp": p.tp,
                                       "parallel.ep": p.ep},
                   message="without expert parallelism the experts' weights are split over "
                           "tp like a dense layer's (etp = tp) or whole on every tp rank "
                           f"(etp 1); split over {p.expert_tp} ranks they would start and train "
                           "as another model than on one rank",
                   fix=f"set parallel.etp: {' or '.join(map(str, sorted({1, p.tp})))}, "
                       "or use parallel.ep >= 2")


def _ep_choices(recipe: Recipe, ctx: Context) -> str:
    return divisors_that_work(recipe, ctx, "E1", "parallel.ep", recipe.model.moe.num_experts)


def _expert_grid(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    p, world = recipe.parallel, ctx.topology.world_size
    grid = p.expert_tp * p.ep * p.pp
    if world % grid:
        yield Problem(rule="E1", fields={_world_field(ctx): world, _etp_field(recipe): p.expert_tp,
                                         "parallel.ep": p.ep, "parallel.pp": p.pp},
                      message=f"the expert grid etp x ep x pp = {grid} does not divide the world",
                      fix=use({"parallel.ep": _ep_choices(recipe, ctx),
                               "parallel.etp": divisors_that_work(recipe, ctx, "E1",
                                                                  "parallel.etp", world)},
                              "change parallel.ep or parallel.etp"))


def fp16_without_zero(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """Z7: DeepSpeed 0.19.8's engine.backward multiplies the loss by fp16's loss scale only for
    its ZeRO optimizers; its ZeRO-0 fp16 wrappers (FP16_Optimizer, FP16_UnfusedOptimizer) still
    divide the gradients by that scale in step(), so every update would run on gradients the
    loss scale (65536 at the start, growing) too small (tests/unit/test_pins.py pins both)."""
    if recipe.train.precision == "fp16" and recipe.zero.stage == 0:
        yield Problem(rule="Z7", fields={"train.precision": "fp16", "zero.stage": 0},
                      message="DeepSpeed 0.19.8 does not scale the loss for its fp16 optimizer "
                              "without ZeRO, yet divides the gradients by the loss scale: every "
                              "update would be the loss scale (65536 and up) too small",
                      fix="use zero.stage: 1 (or more) with fp16, or train.precision: bf16")


def zero_with_pipeline(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """Z2: with pp > 1 every ZeRO stage is accepted, but not ZeRO-2 with optimizer offload
    under the interleaved schedule, nor fp16 (each: DeepSpeed would be wrong, or raise, under
    Megatron-Core's schedule; docs/runtime.md)."""
    stage, pp = recipe.zero.stage, recipe.parallel.pp
    if pp == 1:
        return
    if recipe.train.precision == "fp16":
        yield Problem(rule="Z2", fields={"parallel.pp": pp, "train.precision": "fp16"},
                      message="fp16's dynamic loss scale is not applied to the losses "
                              "Megatron-Core's schedule backpropagates, while DeepSpeed's update "
                              "divides by it (measured with ZeRO-1: gradient norm 65536x too "
                              "small); ZeRO-2 raises on the unscaled backward",
                      fix="use train.precision: bf16 (or fp32) with pp > 1")
    if stage == 2 and recipe.parallel.vpp > 1 and recipe.zero.offload_optimizer == "cpu":
        yield Problem(rule="Z2", fields={"zero.stage": stage, "parallel.vpp": recipe.parallel.vpp,
                                         "zero.offload_optimizer": "cpu"},
                      message="ZeRO-2's CPU gradient accumulator (optimizer offload) copies on the "
                              "step's first backward and adds otherwise, with one counter for all "
                              "virtual stages: under the interleaved schedule a chunk's first "
                              "backward adds onto the previous step's gradients (DeepSpeed 0.19; "
                              "measured: the second step's gradient norm 58% too large)",
                      fix="use parallel.vpp: 1 (1F1B) with the offload, zero.offload_optimizer: "
                          "none, or zero.stage: 1")


def optimizer_offload(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """O1: optimizer offload steps with DeepSpeed's CPU Adam, not a torch AdamW
    (translate/optimizer.py says why)."""
    if recipe.zero.offload_optimizer == "cpu" and recipe.train.adam_impl in TORCH_ADAM_IMPLS:
        yield Problem(rule="O1", fields={"train.adam_impl": recipe.train.adam_impl,
                                         "zero.offload_optimizer": "cpu"},
                      message="optimizer offload steps with DeepSpeed's CPU Adam (DeepSpeed "
                              "refuses a torch optimizer there; it would step on the host "
                              "one parameter tensor at a time)",
                      fix="use train.adam_impl: auto (or deepspeed) with the offload, or "
                          "zero.offload_optimizer: none")


def compiled_layers(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """CM1: compiled layers with ZeRO-3, whose parameter hooks torch.compile cannot trace
    (DeepSpeed disables compilation inside them: a graph break at every linear layer);
    CM2: compiled MoE layers, whose token dispatch sizes every expert's work from the data (a
    graph, and a recompile, per expert batch shape); CM3: compiled layers with tensor
    parallelism (measured: torch.compile fails). runtime/assemble/compile.py."""
    if recipe.model.compile == "none":
        return
    if recipe.zero.stage == 3:
        yield Problem(rule="CM1", fields={"model.compile": "layers", "zero.stage": 3},
                      message="ZeRO-3 gathers each layer's weights in hooks torch.compile "
                              "cannot trace: every linear layer would break the graph",
                      fix="use zero.stage: 0, 1 or 2 with compiled layers, or model.compile: none")
    if recipe.parallel.tp > 1:
        yield Problem(rule="CM3", fields={"model.compile": "layers", "parallel.tp": recipe.parallel.tp},
                      message="torch.compile fails inside Megatron-Core's tensor-parallel "
                              "attention (an internal error where the tensor-parallel "
                              "communication breaks the graph; torch 2.13, Megatron-Core 0.16.1)",
                      fix="use parallel.tp: 1 with compiled layers (dp, pp and cp compile), or "
                          "model.compile: none")
    if recipe.model.moe is not None:
        yield Problem(rule="CM2", fields={"model.compile": "layers", "model.moe": "set"},
                      message="an MoE layer's token dispatch sizes each expert's batch from the "
                              "data, which breaks and recompiles the layer's graph",
                      fix="use model.compile: none for MoE models")


def fp8(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """FP1-FP5 (recipe/fp8.py): what float8 GEMMs need of the recipe."""
    yield from fp8_recipe_problems(recipe, ctx.batch.micro_batch if ctx.batch else None)


def profile_within_run(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """R4: the steps tracking.profile traces are steps of the run."""
    steps, traced = recipe.train.steps, recipe.tracking.profile_range
    if traced is not None and traced[1] >= steps:
        first = min(traced[0], max(steps - 2, 0))
        yield Problem(rule="R4", fields={"tracking.profile": recipe.tracking.profile,
                                         "train.steps": steps},
                      message=f"the run has steps 0 to {steps - 1}; step {traced[1]} never runs",
                      fix=f'use tracking.profile: "{first}:{steps - 1}" or fewer steps')


def optional_packages(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """X1 (recipe/extras.py): TensorBoard and W&B tracking need their packages."""
    yield from missing_extras(recipe)


def hugging_face_start(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """I1-I5: the model.init_from folder holds the recipe's model (dsforge/recipe/init_from.py)."""
    yield from init_from_problems(recipe.model)


RULES: tuple[Rule, ...] = (
    parallel_arithmetic, tensor_parallel_in_node, batch_arithmetic, pipeline_layers,
    pipeline_microbatches, pipeline_embeddings, tensor_parallel_shapes, context_parallel,
    sequence_length,
    expert_parallel, zero_with_pipeline, fp16_without_zero, optimizer_offload, compiled_layers, fp8, *DATA_RULES,
    profile_within_run,
    optional_packages,
    hugging_face_start,
)
