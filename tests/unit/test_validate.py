"""Every validation rule with a failing and a passing case (rule ids: docs/validation.md)."""

from __future__ import annotations

import pytest

from dsforge.launch.hostfile import parse_hostfile
from dsforge.recipe import Topology, resolve, topology_for, validate
from dsforge.problems import RecipeError
from tests.conftest import make_recipe, rule_ids

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
    ("E1", ["parallel.ep=2"], 8, [*MOE, "parallel.ep=2"], 8),
    ("E3", [*MOE, "parallel.tp=2"], 8, [*MOE, "parallel.tp=2", "parallel.sequence_parallel=true"], 8),
    ("E4", [*MOE, "model.bias=true", "parallel.tp=2", "parallel.sequence_parallel=true"], 8,
     [*MOE, "model.bias=true", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=1"], 8),
    ("E6", [*MOE, "parallel.ep=2", "zero.stage=3"], 8, [*MOE, "parallel.ep=1", "zero.stage=3"], 8),
    ("D2", ["data.source=/nonexistent/tokens.bin"], 8, ["data.source=synthetic"], 8),
    ("E7", [*MOE, "parallel.ep=2", "zero.stage=0", "train.checkpoint_every=2"], 8,
     [*MOE, "parallel.ep=2", "zero.stage=1", "train.checkpoint_every=2"], 8),
    ("Z2", ["parallel.pp=2", "zero.stage=2"], 8, ["parallel.pp=2", "zero.stage=1"], 8),
    ("Z2", ["parallel.pp=2", "zero.stage=3"], 8, ["parallel.pp=1", "zero.stage=3"], 8),
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
    ("T5", ["parallel.cp=2"], ["parallel.cp=1"]),
    ("T2", ["model.hidden_size=66"], ["model.hidden_size=66", "model.kv_channels=16"]),
    ("M1", ["model.num_layers=0"], ["model.num_layers=2"]),
    ("M2", ["model.num_kv_heads=3"], ["model.num_kv_heads=4"]),
    ("M3", [*MOE, "model.moe.frequency=5"], [*MOE, "model.moe.frequency=2"]),
    ("E2", [*MOE, "model.moe.top_k=5"], [*MOE, "model.moe.top_k=4"]),
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
    assert "pp*vpp=24" in l2.message and "use vpp in {1, 2, 4, 5, 10, 20}" in l2.fix


def test_batch_fix_offers_nearby_valid_values():
    (b2,) = [p for p in problems_for("train.global_batch=12") if p.rule == "B2"]
    assert "use global_batch 8 or 16" in b2.fix


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
    found = rules_for("parallel.tp=8", "parallel.pp=3", "zero.stage=2", "train.seq_len=512",
                      "model.tie_embeddings=true", world=24)
    assert {"T1", "L1", "L5", "T6", "Z2"} <= found


def test_world_size_sources_must_agree():
    recipe = make_recipe("parallel.dp=2", "cluster.nodes=2", "cluster.gpus_per_node=4")
    topology, problems = topology_for(recipe)
    assert topology is None and rule_ids(problems) == {"Y4"}
    assert "cluster.nodes x cluster.gpus_per_node" in str(problems[0])
    hostfile = parse_hostfile(["a slots=4", "b slots=4"])
    topology, problems = topology_for(make_recipe("cluster.nodes=2", "cluster.gpus_per_node=4"),
                                      hostfile=hostfile, world_size=8)
    assert problems == [] and topology.world_size == 8 and topology.node_slots == (4, 4)
    _, problems = topology_for(make_recipe(), hostfile=hostfile, world_size=6)
    assert rule_ids(problems) == {"Y4"}


def test_unknown_world_size_is_an_error_with_the_ways_to_give_one():
    topology, problems = topology_for(make_recipe())
    assert topology is None and "--world-size" in problems[0].fix


def test_world_free_rules_still_run_without_a_world():
    assert "T6" in rules_for("train.seq_len=512", world=None)


def test_resolve_derives_dp_and_grad_accum_without_mutating():
    recipe = make_recipe("parallel.tp=2", "train.global_batch=16", "train.micro_batch=2")
    resolved = resolve(recipe, Topology(world_size=8))
    assert recipe.parallel.dp == -1 and recipe.train.grad_accum is None
    assert resolved.recipe.parallel.dp == 4 and resolved.recipe.train.grad_accum == 2
    lay = resolved.layout
    assert (lay.dp, lay.grad_accum, lay.num_microbatches, lay.global_batch) == (4, 2, 2, 16)


@pytest.mark.parametrize("given, expected", [
    (("train.global_batch=16",), (16, 2)),
    (("train.global_batch=null", "train.grad_accum=3"), (24, 3)),
    (("train.global_batch=null",), (8, 1)),
    (("train.global_batch=32", "train.grad_accum=4"), (32, 4)),
    (("train.global_batch=64", "train.grad_accum=4", "train.micro_batch=null"), (64, 4)),
])
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
