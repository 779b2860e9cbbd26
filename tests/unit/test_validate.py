"""Every validation rule with a failing and a passing case (rule ids: docs/validation.md)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import yaml

from dsforge.problems import RecipeError, errors
from dsforge.recipe import Topology, resolve, resolve_file, validate
from dsforge.schema import (ClusterConfig, DataConfig, ModelConfig, MoEConfig, ParallelConfig,
                            TrainConfig, ZeroConfig)
from tests.conftest import BASE, REPO, make_recipe, rule_ids

MOE = ("model.preset=tiny-moe",)


def problems_for(*overrides: str, world: int | None = 8, node_slots=None):
    recipe = make_recipe(*overrides)
    topology = Topology(world_size=world, node_slots=node_slots) if world else None
    return validate(recipe, topology)


def rules_for(*overrides: str, world: int | None = 8, node_slots=None) -> set[str]:
    return rule_ids(problems_for(*overrides, world=world, node_slots=node_slots))


def section_rules(*overrides: str) -> set[str]:
    """Rule ids raised while building the sections (local rules)."""
    with pytest.raises(RecipeError) as info:
        make_recipe(*overrides)
    return rule_ids(info.value)


# Each case: (rule, overrides that break it, world, overrides that satisfy it, world).
CROSS_SECTION_CASES = [
    ("P1", ["parallel.dp=3"], 8, ["parallel.dp=8"], 8),
    ("P2", ["parallel.tp=2", "parallel.pp=2"], 6, ["parallel.tp=2", "parallel.pp=2"], 8),
    ("B1", ["train.grad_accum=2"], 8, ["train.grad_accum=1"], 8),
    ("B2", ["train.global_batch=12"], 8, ["train.global_batch=16"], 8),
    ("L1", ["parallel.pp=3", "train.global_batch=24"], 3, ["parallel.pp=2"], 2),
    ("L2", ["parallel.pp=2", "parallel.vpp=4"], 2, ["parallel.pp=2", "parallel.vpp=2"], 2),
    ("L4", ["parallel.pp=2", "parallel.vpp=2", "train.global_batch=3"], 2,
     ["parallel.pp=2", "parallel.vpp=2", "train.global_batch=4"], 2),
    ("L5", ["parallel.pp=2", "model.tie_embeddings=true"], 2,
     ["parallel.pp=1", "model.tie_embeddings=true"], 2),
    ("L6", ["parallel.pp=4", "train.global_batch=2"], 4, ["parallel.pp=4", "train.global_batch=4"], 4),
    ("T1", ["parallel.tp=8"], 8, ["parallel.tp=4"], 8),  # tiny has 4 heads
    ("T6", ["train.seq_len=512"], 8, ["train.seq_len=256"], 8),
    # Context parallelism: 2 cp chunks of the sequence, heads and KV heads per tp rank / cp.
    ("T7", ["parallel.cp=4", "train.seq_len=100", "model.num_kv_heads=4"], 8,
     ["parallel.cp=4", "train.seq_len=96", "model.num_kv_heads=4"], 8),
    ("T7", ["parallel.cp=4"], 8, ["parallel.cp=2"], 8),  # tiny has 2 KV heads
    ("T7", ["parallel.cp=2", "parallel.tp=2"], 8, ["parallel.cp=2", "model.num_kv_heads=4", "parallel.tp=2"], 8),
    # Sequence parallelism splits each rank's sequence into tp parts (Megatron asserted at step 1)
    ("T9", ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=127"], 8,
     ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=126"], 8),
    ("E1", ["parallel.ep=2"], 8, [*MOE, "parallel.ep=2"], 8),
    ("E3", [*MOE, "parallel.tp=2"], 8, [*MOE, "parallel.tp=2", "parallel.sequence_parallel=true"], 8),
    ("E4", [*MOE, "model.bias=true", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"], 8,
     [*MOE, "model.bias=true", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=1",
      "parallel.ep=2"], 8),
    ("E8", [*MOE, "model.bias=true"], 8, [*MOE, "model.bias=true", "parallel.ep=2"], 8),
    ("E10", [*MOE, "parallel.etp=2"], 8, [*MOE, "parallel.etp=2", "parallel.ep=2"], 8),
    ("E10", [*MOE, "parallel.tp=4", "parallel.sequence_parallel=true", "parallel.etp=2"], 8,
     [*MOE, "parallel.tp=4", "parallel.sequence_parallel=true", "parallel.etp=1"], 8),
    ("E6", [*MOE, "parallel.ep=2", "zero.stage=3"], 8, [*MOE, "parallel.ep=1", "zero.stage=3"], 8),
    ("D7", ["data.source=/nonexistent/tokens.bin"], 8, ["data.source=synthetic"], 8),
    ("E7", [*MOE, "parallel.ep=2", "zero.stage=0", "train.checkpoint_every=2"], 8,
     [*MOE, "parallel.ep=2", "zero.stage=1", "train.checkpoint_every=2"], 8),
    ("Z2", ["parallel.pp=2", "parallel.vpp=2", "zero.stage=2", "zero.offload_optimizer=cpu"], 8,
     ["parallel.pp=2", "zero.stage=2", "zero.offload_optimizer=cpu"], 8),
    ("Z7", ["train.precision=fp16", "zero.stage=0"], 8, ["train.precision=fp16", "zero.stage=1"], 8),
    ("Z2", ["parallel.pp=2", "zero.stage=2", "train.precision=fp16"], 8,
     ["parallel.pp=2", "zero.stage=2", "train.precision=bf16"], 8),
    ("Z2", ["parallel.pp=2", "zero.stage=1", "train.precision=fp16"], 8,
     ["parallel.pp=1", "zero.stage=1", "train.precision=fp16"], 8),
]


@pytest.mark.parametrize("rule, bad, bad_world, good, good_world", CROSS_SECTION_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CROSS_SECTION_CASES)])
def test_cross_section_rule_fails_and_passes(rule, bad, bad_world, good, good_world):
    assert rule in rules_for(*bad, world=bad_world)
    assert rule not in rules_for(*good, world=good_world)


SECTION_CASES = [
    ("P3", ["parallel.tp=0"], ["parallel.tp=1"]),
    ("P3", ["parallel.dp=0"], ["parallel.dp=-1"]),
    ("T3", ["parallel.sequence_parallel=true"], ["parallel.sequence_parallel=true", "parallel.tp=2"]),
    ("L3", ["parallel.vpp=2"], ["parallel.vpp=2", "parallel.pp=2"]),
    ("T2", ["model.hidden_size=66"], ["model.hidden_size=66", "model.kv_channels=16"]),
    ("M1", ["model.num_layers=0"], ["model.num_layers=2"]),
    ("M2", ["model.num_kv_heads=3"], ["model.num_kv_heads=4"]),
    ("M3", [*MOE, "model.moe.frequency=5"], [*MOE, "model.moe.frequency=2"]),
    ("E2", [*MOE, "model.moe.top_k=5"], [*MOE, "model.moe.top_k=4"]),
    ("E2", [*MOE, "model.moe.top_k=0"], [*MOE, "model.moe.top_k=1"]),  # top-1: Switch routing
    ("Z1", ["zero.stage=4"], ["zero.stage=3"]),
    ("Z4", ["zero.offload_params=cpu", "zero.stage=2"], ["zero.offload_params=cpu", "zero.stage=3"]),
    ("Z4", ["zero.offload_optimizer=cpu", "zero.stage=0"], ["zero.offload_optimizer=cpu", "zero.stage=1"]),
    ("Z4", ["zero.offload_optimizer=cpu", "zero.offload_ratio=0.5", "zero.stage=2"],
     ["zero.offload_optimizer=cpu", "zero.offload_ratio=0.5", "zero.stage=3"]),
    ("B2", ["train.micro_batch=0"], ["train.micro_batch=1"]),
    ("R1", ["train.warmup_steps=10"], ["train.warmup_steps=9"]),
    ("R2", ["train.warmup_steps=1"], ["train.warmup_steps=2"]),
    ("Y3", ["train.precision=bf32"], ["train.precision=bf16"]),
    ("Y3", ["train.activation_checkpointing=some"], ["train.activation_checkpointing=selective"]),
    ("C1", ["cluster.gpus_per_node=0"], ["cluster.gpus_per_node=8"]),
    ("C2", ["cluster.gpus_per_node=8", "cluster.gpu=h300"], ["cluster.gpus_per_node=8", "cluster.gpu=h200"]),
    ("D1", ["data.source=' '"], ["data.source=synthetic"]),
]


@pytest.mark.parametrize("rule, bad, good", SECTION_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(SECTION_CASES)])
def test_section_rule_fails_and_passes(rule, bad, good):
    assert rule in section_rules(*bad)
    make_recipe(*good)


def test_l2_fix_lists_the_valid_virtual_stage_counts():
    problems = problems_for("model.num_layers=80", "parallel.pp=4", "parallel.vpp=6",
                            "train.global_batch=16", world=4)
    (l2,) = [p for p in problems if p.rule == "L2"]
    assert l2.fields == {"model.num_layers": 80, "parallel.pp": 4, "parallel.vpp": 6}
    assert "pp*vpp=24" in l2.message and "use parallel.vpp in {1, 2, 4, 5, 10, 20}" in l2.fix
    assert "model.num_layers in {..., 72, 96," in l2.fix


def test_batch_fix_offers_nearby_valid_values():
    (b2,) = [p for p in problems_for("train.global_batch=12") if p.rule == "B2"]
    assert b2.fix == "use train.global_batch in {8, 16, 24, 32, ...}"


def test_expert_grid_must_tile_the_world():
    # tp2 x ep4 x pp1 = 8 does not divide a world of 4 (dp = 2).
    assert "E1" in rules_for(*MOE, "parallel.tp=2", "parallel.sequence_parallel=true",
                             "parallel.ep=4", world=4)
    assert "E1" in rules_for(*MOE, "parallel.ep=3", world=6)  # 4 experts over 3 ranks


def test_tp_spanning_nodes_is_a_warning_not_an_error():
    problems = problems_for("parallel.tp=4", world=8, node_slots=(2, 2, 2, 2))
    (p4,) = [p for p in problems if p.rule == "P4"]
    assert p4.severity == "warning" and "2 tensor-parallel group(s) span nodes" in p4.message
    assert "P4" not in rules_for("parallel.tp=4", world=8, node_slots=(4, 4))
    resolved = resolve(make_recipe("parallel.tp=4"), Topology(world_size=8, node_slots=(2,) * 4))
    assert [w.rule for w in resolved.warnings] == ["P4"]


def test_uneven_nodes_detect_a_straddling_tp_group():
    assert "P4" in rules_for("parallel.tp=2", world=8, node_slots=(3, 5))


def test_all_violations_are_reported_together():
    found = rules_for("parallel.tp=8", "parallel.pp=3", "train.precision=fp16", "train.seq_len=512",
                      "model.tie_embeddings=true", world=24)
    assert {"T1", "L1", "L5", "T6", "Z2"} <= found


@pytest.fixture
def base_file(recipe_file):
    return recipe_file(yaml.safe_dump(BASE))


@pytest.fixture
def two_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=4\nb slots=4\n")
    return path


def _raised(*args, **kwargs) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        resolve_file(*args, **kwargs)
    return info.value


def test_world_size_sources_must_agree(base_file, two_hosts):
    exc = _raised(base_file, ["parallel.dp=2", "cluster.nodes=2", "cluster.gpus_per_node=4"])
    assert rule_ids(exc) == {"Y4"} and "cluster.nodes x cluster.gpus_per_node" in str(exc)
    resolved = resolve_file(base_file, ["cluster.nodes=2", "cluster.gpus_per_node=4"],
                            hostfile=two_hosts, world_size=8)
    assert resolved.topology.world_size == 8 and resolved.topology.node_slots == (4, 4)
    assert rule_ids(_raised(base_file, hostfile=two_hosts, world_size=6)) == {"Y4"}


def test_unknown_world_size_is_an_error_with_the_ways_to_give_one(base_file):
    (y4,) = _raised(base_file).problems
    assert y4.rule == "Y4" and "--world-size" in y4.fix


def test_resolve_file_reports_hostfile_and_recipe_problems_together(base_file, tmp_path):
    exc = _raised(base_file, ["parallel.tpp=2"], hostfile=tmp_path / "missing")
    assert rule_ids(exc) == {"H3", "Z6"}


def test_resolve_file_narrows_the_hostfile_and_validates(base_file, two_hosts):
    resolved = resolve_file(base_file, hostfile=two_hosts, include="a")
    assert resolved.layout.world_size == 4 and resolved.topology.node_slots == (4,)
    assert rule_ids(_raised(base_file, ["train.global_batch=12"], world_size=8)) == {"B2"}


def test_world_free_rules_still_run_without_a_world():
    assert "T6" in rules_for("train.seq_len=512", world=None)


def test_resolve_derives_dp_and_grad_accum_without_mutating():
    recipe = make_recipe("parallel.tp=2", "train.global_batch=16", "train.micro_batch=2")
    resolved = resolve(recipe, Topology(world_size=8))
    assert recipe.parallel.dp == -1 and recipe.train.grad_accum is None
    assert resolved.recipe.parallel.dp == 4 and resolved.recipe.train.grad_accum == 2
    lay = resolved.layout
    assert (lay.dp, lay.grad_accum, lay.num_microbatches, lay.global_batch) == (4, 2, 2, 16)


BATCH_CASES = [
    (("train.global_batch=16",), (16, 2)),
    (("train.global_batch=null", "train.grad_accum=3"), (24, 3)),
    (("train.global_batch=null",), (8, 1)),
    (("train.global_batch=32", "train.grad_accum=4"), (32, 4)),
    (("train.global_batch=64", "train.grad_accum=4", "train.micro_batch=null"), (64, 4)),
]


@pytest.mark.parametrize("given, expected", BATCH_CASES)
def test_any_two_batch_values_fix_the_third(given, expected):
    lay = resolve(make_recipe(*given), Topology(world_size=8)).layout
    assert (lay.global_batch, lay.grad_accum) == expected
    assert lay.global_batch == lay.micro_batch * lay.grad_accum * lay.dp


def test_micro_batch_is_derived_from_global_batch_and_grad_accum():
    recipe = make_recipe("train.global_batch=64", "train.grad_accum=4", "train.micro_batch=null")
    resolved = resolve(recipe, Topology(world_size=8))
    assert resolved.layout.micro_batch == 2 and resolved.recipe.train.micro_batch == 2
    bad = rules_for("train.global_batch=60", "train.grad_accum=4", "train.micro_batch=null")
    assert bad == {"B2"}


def test_resolve_refuses_an_invalid_recipe():
    with pytest.raises(RecipeError) as info:
        resolve(make_recipe("train.global_batch=12"), Topology(world_size=8))
    assert rule_ids(info.value) == {"B2"}


# Recipes that fail a cross-section rule, for the checks on what the problems name. Each:
# (overrides, world, node slots).
FAILING = [(tuple(bad), world, None) for _, bad, world, _, _ in CROSS_SECTION_CASES] + [
    (("parallel.pp=2", "parallel.vpp=2", "train.micro_batch=null", "train.global_batch=18"), 4, None),
    (("parallel.pp=2", "parallel.vpp=2", "train.global_batch=null", "train.micro_batch=null",
      "train.grad_accum=3"), 4, None),
    (("parallel.pp=4", "train.global_batch=null", "train.micro_batch=2"), 4, None),
    (("train.global_batch=60", "train.grad_accum=4", "train.micro_batch=null"), 8, None),
    (("model.num_layers=80", "parallel.pp=4", "parallel.vpp=6", "train.global_batch=16"), 4, None),
    ((*MOE, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4"), 4, None),
    ((*MOE, "parallel.ep=3", "train.global_batch=6"), 6, None),
    (("model.ffn_hidden_size=177", "parallel.tp=2"), 8, None),
    ((*MOE, "model.moe.ffn_hidden_size=97", "parallel.tp=2", "parallel.sequence_parallel=true"), 8, None),
    (("model.num_attention_heads=6", "model.hidden_size=96", "model.num_kv_heads=3",
      "parallel.tp=2"), 8, None),
    (("parallel.tp=2", "parallel.dp=4"), 6, None),
    (("parallel.tp=3", "parallel.dp=2"), 8, None),
    (("parallel.tp=4",), 8, (2, 2, 2, 2)),
]

_SECTIONS = {"model": ModelConfig, "model.moe": MoEConfig, "parallel": ParallelConfig,
             "zero": ZeroConfig, "train": TrainConfig, "data": DataConfig, "cluster": ClusterConfig}
RECIPE_FIELDS = {f"{prefix}.{name}" for prefix, cls in _SECTIONS.items()
                 for name in cls.__dataclass_fields__}
# Not recipe fields but what the user gave: the world (--world-size, hostfile, or a bare
# Topology in these tests) and the node sizes.
WORLD_FIELDS = {"world size", "GPUs per node"}
_SUGGESTION = re.compile(r"([a-z_]+(?:\.[a-z_]+)+) in \{([^}]*)\}")


def _suggestions(fix: str) -> list[tuple[str, int]]:
    """(field, value) for every value a fix offers ("use train.global_batch in {16, 20, ...}")."""
    return [(path, int(value)) for path, values in _SUGGESTION.findall(fix)
            for value in values.split(", ") if value != "..."]


def _ids(cases):
    return [" ".join(c[0]) + f" @{c[1]}" for c in cases]


@pytest.mark.parametrize("overrides, world, slots", FAILING, ids=_ids(FAILING))
def test_problems_name_only_fields_the_user_can_change(overrides, world, slots):
    problems = problems_for(*overrides, world=world, node_slots=slots)
    assert problems
    for problem in problems:
        assert set(problem.fields) <= RECIPE_FIELDS | WORLD_FIELDS, problem
        assert problem.fix, problem


@pytest.mark.parametrize("overrides, world, slots", FAILING, ids=_ids(FAILING))
def test_following_a_suggested_value_clears_the_problem(overrides, world, slots):
    """Each value a fix offers, set alone, clears that rule, breaks nothing new and leaves no
    problem about the field it changed."""
    before = rules_for(*overrides, world=world, node_slots=slots)
    for problem in problems_for(*overrides, world=world, node_slots=slots):
        for path, value in _suggestions(problem.fix):
            after = problems_for(*overrides, f"{path}={value}", world=world, node_slots=slots)
            assert problem.rule not in rule_ids(after) and rule_ids(after) <= before, (problem, path, value)
            assert not [p for p in after if path in p.fields], (problem, path, value)


def test_interleaved_microbatches_are_fixed_through_the_batch_the_user_wrote():
    """Issue 9: the user wrote only global_batch; the fix must not talk about grad_accum."""
    (l4,) = problems_for("parallel.pp=2", "parallel.vpp=2", "train.micro_batch=null",
                         "train.global_batch=18", world=4)
    assert l4.rule == "L4"
    assert l4.fields == {"train.global_batch": 18, "parallel.pp": 2, "parallel.vpp": 2}
    assert "use train.global_batch in {..., 16, 20, 24, 28, ...}" == l4.fix
    assert "9 microbatches per step, dp 2 = world size 4 / (tp 1 x pp 2)" in l4.message


def test_a_microbatch_count_the_user_wrote_is_fixed_through_grad_accum():
    (l4,) = problems_for("parallel.pp=2", "parallel.vpp=2", "train.global_batch=null",
                         "train.micro_batch=null", "train.grad_accum=3", world=4)
    assert l4.fields["train.grad_accum"] == 3 and "train.global_batch" not in l4.fields
    assert l4.fix.startswith("use train.grad_accum in {2, 4, 6, 8")


def test_expert_tp_is_named_by_the_field_that_sets_it():
    moe_tp2 = (*MOE, "model.moe.ffn_hidden_size=97", "parallel.tp=2", "parallel.sequence_parallel=true")
    (t1,) = problems_for(*moe_tp2)
    assert t1.fields == {"model.moe.ffn_hidden_size": 97, "parallel.tp": 2}
    assert "parallel.etp is unset" in t1.message and "parallel.etp in {1}" in t1.fix
    (t1,) = problems_for(*moe_tp2, "parallel.etp=2")
    assert t1.fields == {"model.moe.ffn_hidden_size": 97, "parallel.etp": 2}


def test_the_world_is_named_by_where_it_came_from(base_file):
    exc = _raised(base_file, ["train.global_batch=12"], world_size=8)
    (b2,) = exc.problems
    assert "dp 8 = --world-size 8 / (tp 1 x pp 1)" in b2.message


# Recipes the validator accepts in the tests above, as (overrides, world); each must also build
# its Megatron-Core model (tests/unit/test_accepted_builds.py).
ACCEPTED = sorted({(tuple(good), world) for _, _, _, good, world in CROSS_SECTION_CASES}
                  | {(tuple(good), 8) for _, _, good in SECTION_CASES}
                  | {(tuple(given), 8) for given, _ in BATCH_CASES}
                  | {(("parallel.tp=2", "train.global_batch=16", "train.micro_batch=2"), 8),
                     ((*MOE, "model.num_kv_heads=1"), 8),
                     ((*MOE, "model.moe.top_k=1", "parallel.ep=2"), 8),
                     ((*MOE, "model.moe.frequency=2", "parallel.pp=2"), 4),
                     (("parallel.pp=2", "parallel.vpp=2", "train.global_batch=16"), 4),
                     (("train.activation_checkpointing=full", "model.bias=true"), 8)})


@pytest.mark.parametrize("overrides, world", ACCEPTED, ids=[" ".join(o) + f" @{w}" for o, w in ACCEPTED])
def test_accepted_recipes_validate(overrides, world):
    assert not errors(problems_for(*overrides, world=world))


def test_a_suggested_tp_also_clears_the_other_problems_about_tp():
    """tp 3 on 32 GPUs with pp 4 breaks P2 and T1: tp 16 would fix T1 but not P2."""
    problems = problems_for("model.preset=llama3-70b", "model.num_layers=8", "parallel.tp=3",
                            "parallel.pp=4", "train.global_batch=64", world=32)
    assert {p.rule for p in problems} == {"P2", "T1"}
    assert all(p.fix.startswith("use parallel.tp in {1, 2, 4, 8}") for p in problems)


# Issue 10, item 14: values without bounds hung `plan` (num_layers 10**30) or crashed every
# rank (seed 2**62). Each: (overrides, rule, field).
OUT_OF_BOUNDS = [
    (["model.num_layers=10001"], "M1", "model.num_layers"),
    (["model.num_layers=1000000000000000000"], "M1", "model.num_layers"),
    (["model.hidden_size=1048577"], "M1", "model.hidden_size"),
    (["model.ffn_hidden_size=1048577"], "M1", "model.ffn_hidden_size"),
    (["model.num_attention_heads=65537"], "M1", "model.num_attention_heads"),
    (["model.vocab_size=16777217"], "M1", "model.vocab_size"),
    (["model.max_seq_len=4194305"], "M1", "model.max_seq_len"),
    (["model.rotary_base=1000000000001"], "M1", "model.rotary_base"),
    ([*MOE, "model.moe.num_experts=4097"], "M1", "model.moe.num_experts"),
    ([*MOE, "model.moe.ffn_hidden_size=1048577"], "M1", "model.moe.ffn_hidden_size"),
    (["train.seq_len=4194305"], "B2", "train.seq_len"),
    (["train.global_batch=16777217"], "B2", "train.global_batch"),
    (["train.micro_batch=16777217"], "B2", "train.micro_batch"),
    (["train.steps=1000000001"], "R1", "train.steps"),
    (["train.seed=4611686018427387904"], "R1", "train.seed"),
    (["train.seed=4294967296"], "R1", "train.seed"),
    (["train.seed=-1"], "R1", "train.seed"),
    (["parallel.tp=262145"], "P3", "parallel.tp"),
    (["parallel.dp=262145"], "P3", "parallel.dp"),
    (["cluster.gpus_per_node=262145"], "C1", "cluster.gpus_per_node"),
    (["data.source=\"a\\0b\""], "D1", "data.source"),
]


@pytest.mark.parametrize("overrides, rule, field", OUT_OF_BOUNDS,
                         ids=[c[0][-1] for c in OUT_OF_BOUNDS])
def test_values_beyond_dsforge_limits_are_rejected(overrides, rule, field):
    with pytest.raises(RecipeError) as info:
        make_recipe(*overrides)
    assert any(p.rule == rule and field in p.fields for p in info.value.problems), info.value


def test_the_limits_themselves_are_accepted():
    recipe = make_recipe("train.seed=4294967295", "train.seed=0", "model.num_layers=10000",
                         "train.steps=1000000000")
    assert recipe.train.seed == 0 and recipe.model.num_layers == 10000


def test_a_world_beyond_the_limit_is_rejected(base_file):
    exc = _raised(base_file, [], world_size=2**18 + 1)
    assert rule_ids(exc) == {"Y4"} and "at most 262,144" in str(exc)


@pytest.mark.parametrize("overrides, world, rule", [
    (("model.ffn_hidden_size=1048575", "parallel.tp=2", "train.global_batch=16"), 8, "T1"),
    (("train.global_batch=16777215",), 8, "B2"),
    (("train.global_batch=16777215", "train.micro_batch=null"), 8, "B2"),
    (("model.num_layers=9999", "parallel.pp=2", "train.global_batch=16"), 8, "L1"),
    (("parallel.tp=3",), 2**18, "P2"),
])
def test_suggestions_for_values_near_the_limits_come_quickly(overrides, world, rule):
    start = time.monotonic()
    problems = problems_for(*overrides, world=world)
    assert rule in rule_ids(problems) and time.monotonic() - start < 20
    assert all(problem.fix for problem in problems)


def test_tp_groups_spanning_nodes_are_found_without_a_loop_over_ranks():
    start = time.monotonic()
    problems = problems_for("parallel.tp=2", world=2**18, node_slots=(1,) * 2**18)
    assert "P4" in rule_ids(problems) and time.monotonic() - start < 20
    spanning = [p for p in problems_for("parallel.tp=4", world=12, node_slots=(2, 4, 6))
                if p.rule == "P4"]
    assert spanning and spanning[0].message.startswith("2 tensor-parallel group(s)")


# Issue 10, item 12: token files that do not match the recipe fail at validation, not in the
# ranks after start-up.
def _token_file(tmp_path, ids, dtype: str, name="tokens.bin") -> str:
    path = tmp_path / name
    np.asarray(ids).astype(np.dtype(dtype).newbyteorder("=")).tofile(path)
    return str(path)


IDS = np.random.default_rng(0).integers(1, 250, 5000)


def _data_problems(source: str, *overrides: str) -> list:
    return [p for p in problems_for(f"data.source={source}", *overrides) if p.rule.startswith("D")]


def test_a_matching_token_file_passes(tmp_path):
    assert not _data_problems(_token_file(tmp_path, IDS, "uint16"))
    assert not _data_problems(_token_file(tmp_path, IDS, "uint32"), "data.token_dtype=uint32")
    assert not _data_problems(str(REPO / "data" / "tempest.u16.bin"))


def test_a_directory_is_not_a_token_file(tmp_path):
    (problem,) = _data_problems(str(tmp_path))
    assert problem.rule == "D2" and "is a directory" in problem.message


def test_a_vocabulary_smaller_than_the_files_ids(tmp_path):
    (problem,) = _data_problems(_token_file(tmp_path, IDS * 100, "uint16"))
    assert problem.rule == "D3"
    assert set(problem.fields) == {"data.source", "data.token_dtype", "model.vocab_size"}
    assert f"at least {IDS.max() * 100 + 1}" in problem.fix


def test_a_uint16_file_declared_uint32(tmp_path):
    (problem,) = _data_problems(_token_file(tmp_path, IDS, "uint16"), "data.token_dtype=uint32")
    assert problem.rule == "D4" and problem.fix == "set data.token_dtype: uint16"
    odd = _token_file(tmp_path, IDS[:4999], "uint16", name="odd.bin")
    (problem,) = _data_problems(odd, "data.token_dtype=uint32")
    assert problem.rule == "D2" and "not a whole number of uint32 tokens" in problem.message


def test_a_uint32_file_read_as_uint16_is_caught_by_its_zero_high_halves(tmp_path):
    (problem,) = _data_problems(_token_file(tmp_path, IDS, "uint32"))
    assert problem.rule == "D4" and problem.fix == "set data.token_dtype: uint32"
    assert {"data.source", "data.token_dtype"} <= set(problem.fields)


def test_large_32bit_vocabularies_read_as_uint16_are_caught_too(tmp_path):
    ids = np.random.default_rng(1).integers(0, 128_000, 5000)
    (problem,) = _data_problems(_token_file(tmp_path, ids, "uint32"), "model.vocab_size=128256")
    assert problem.rule == "D4"
    assert not _data_problems(_token_file(tmp_path, ids, "uint32", name="ok.bin"),
                              "model.vocab_size=128256", "data.token_dtype=uint32")


def test_a_large_file_is_checked_from_a_sample(tmp_path):
    ids = np.random.default_rng(2).integers(1, 250, 3_000_000)
    (problem,) = _data_problems(_token_file(tmp_path, ids, "uint32"))
    assert problem.rule == "D4" and "in a sample of" in problem.message
