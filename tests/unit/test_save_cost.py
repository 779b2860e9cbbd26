"""What a checkpoint costs (estimate/save_cost.py): bytes per rank and host, the host memory a
snapshot takes (FIT2 on CPU, FIT4 on GPU machines), the Young/Daly interval, and `dsforge plan`'s
section."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner

from dsforge import cli
from dsforge.estimate.save_cost import (STATE_BYTES_PER_PARAM, host_state_bytes, rank_state_bytes,
                                    save_cost)
from dsforge.estimate.params import count_params
from dsforge.launch.fit import (CPU_RANK_OVERHEAD_BYTES, Gpu, Machine, fit_problems,
                                rank_memory_bytes)
from dsforge.problems import RecipeError
from dsforge.recipe import resolve_file
from dsforge.units import GiB
from tests.conftest import REPO

TINY, TINY_MOE = REPO / "recipes" / "tiny.yaml", REPO / "recipes" / "tiny_moe.yaml"


@pytest.mark.parametrize("recipe, overrides, writers", [
    (TINY, [], [0, 1]),  # ZeRO-1: each rank its half
    (TINY, ["zero.stage=3"], [0, 1]),
    (TINY, ["zero.stage=0"], [0]),  # ZeRO-0: data-parallel rank 0 writes it all
    (TINY, ["parallel.dp=1", "parallel.pp=2"], [0, 1]),  # each stage its layers
    (TINY_MOE, [], [0, 1]),  # experts over the expert-data-parallel ranks
])
def test_every_parameter_is_written_once(recipe, overrides, writers):
    resolved = resolve_file(recipe, overrides, world_size=2)
    per_rank = rank_state_bytes(resolved)
    params = count_params(resolved.recipe.model).total
    assert sum(per_rank) == STATE_BYTES_PER_PARAM * params
    assert [rank for rank, nbytes in enumerate(per_rank) if nbytes] == writers


@pytest.mark.parametrize("recipe, overrides, world", [
    (TINY, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"], 8),
    (TINY, ["parallel.dp=2", "parallel.cp=2", "parallel.pp=2"], 8),
    (TINY_MOE, ["parallel.dp=4", "parallel.tp=2", "parallel.ep=2",
                "parallel.sequence_parallel=true"], 8),
    (TINY_MOE, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2",
                "parallel.etp=1", "parallel.sequence_parallel=true"], 8),
])
def test_rank_coordinates_follow_megatrons_order(recipe, overrides, world):
    from dsforge.estimate.save_cost import _coordinates
    from dsforge.translate.groups import rank_groups

    lay = resolve_file(recipe, overrides, world_size=world).layout
    groups = rank_groups(lay)
    stage = {r: i for group in groups["pp"] for i, r in enumerate(group)}
    dense_first = {g[0] for g in groups["dp"]} & {g[0] for g in groups.get("cp", [[r] for r in range(world)])}
    expert_first = {g[0] for g in groups["edp"]} if "edp" in groups else dense_first
    for rank in range(world):
        assert _coordinates(lay, rank) == (stage[rank], rank in dense_first, rank in expert_first)


def test_the_estimate_is_what_a_rank_wrote():
    """A tiny dp2 ZeRO-1 run's rank wrote 1,305,984 bytes of state (its summary.json's
    checkpoints.bytes, the safetensors file less its header)."""
    assert rank_state_bytes(resolve_file(TINY)) == [1305984.0, 1305984.0]


def test_hosts_add_their_ranks():
    resolved = resolve_file(REPO / "recipes" / "70b_pp4.yaml")
    hosts = host_state_bytes(resolved)
    assert len(hosts) == resolved.recipe.cluster.nodes
    assert sum(hosts) == pytest.approx(sum(rank_state_bytes(resolved)))


def test_the_interval_is_young_daly_in_whole_steps():
    resolved = resolve_file(REPO / "recipes" / "70b_pp4.yaml")
    cost = save_cost(resolved, device="cuda", step_s=None)
    nodes = resolved.recipe.cluster.nodes
    assert cost.job_mtbf_s == pytest.approx(6335 * 3600 / nodes)
    assert cost.interval_s == pytest.approx(math.sqrt(2 * cost.job_mtbf_s * cost.stall_s))
    assert cost.stall_s == cost.snapshot_s  # a background save stops training for its snapshot
    in_steps = save_cost(resolved, device="cuda", step_s=10.0)
    assert in_steps.interval_steps == math.ceil(cost.interval_s / 10.0)
    assert in_steps.lost_to_failures == pytest.approx(in_steps.interval_s / 2 / cost.job_mtbf_s)
    foreground = _with(resolved, train={"checkpoint_async": False})
    sync = save_cost(foreground, device="cuda", step_s=None)
    assert sync.stall_s == pytest.approx(cost.snapshot_s + cost.write_s)
    assert sync.interval_s > cost.interval_s  # a dearer save is made less often


def test_a_background_save_is_not_made_more_often_than_one_write():
    slow_disk = _with(resolve_file(REPO / "recipes" / "70b_pp4.yaml"),
                      cluster={"checkpoint_write_gbps": 0.001, "node_mtbf_hours": 1.0})
    cost = save_cost(slow_disk, device="cuda", step_s=None)
    assert cost.interval_s == pytest.approx(cost.write_s)


def test_a_save_staged_in_parts_holds_the_step_for_the_writes_before_the_last():
    resolved = _with(resolve_file(REPO / "recipes" / "7b_1gpu.yaml"), train={"checkpoint_every": 100})
    whole = save_cost(resolved, device="cuda", step_s=None)
    assert whole.part_bytes is None and whole.stall_s == whole.snapshot_s
    parts = save_cost(_with(resolved, train={"checkpoint_staging_gb": 16.0}), device="cuda",
                      step_s=None)
    assert parts.part_bytes == 16e9
    held = (whole.rank_bytes - 16e9) / (whole.write_gbps * 1e9)  # one rank on its host
    assert parts.stall_s == pytest.approx(whole.snapshot_s + held)
    roomy = save_cost(_with(resolved, train={"checkpoint_staging_gb": 100.0}), device="cuda",
                      step_s=None)
    assert roomy.part_bytes is None and roomy.stall_s == whole.stall_s


def test_a_gpu_host_that_cannot_hold_the_snapshot_stages_it_in_parts():
    """The 7B at ZeRO-0 on one H200: its one rank stages 80.9 GB of state per save. A host
    with 64 GiB stages it in parts (a warning: the step waits for the writes); a
    train.checkpoint_staging_gb the host cannot give is refused."""
    saving = _with(resolve_file(REPO / "recipes" / "7b_1gpu.yaml"), train={"checkpoint_every": 100})
    h200 = Gpu(name="NVIDIA H200", memory_total=141 * GiB, memory_free=140 * GiB)
    small = Machine(name="gpu1", cpus=16, memory_available=64 * GiB, gpus=(h200,))
    problems = fit_problems(saving, small, device="cuda")
    assert [(p.rule, p.severity) for p in problems] == [("FIT4", "warning")]
    assert "in parts of 31.8 GiB a rank" in problems[0].message  # half of 64 GiB less a process
    large = dataclasses.replace(small, memory_available=192 * GiB)
    assert fit_problems(saving, large, device="cuda") == []
    never_saves = _with(saving, train={"checkpoint_every": 0})
    assert fit_problems(never_saves, small, device="cuda") == []
    asks_too_much = _with(saving, train={"checkpoint_staging_gb": 100.0})
    problems = fit_problems(asks_too_much, small, device="cuda")
    assert [(p.rule, p.severity) for p in problems] == [("FIT4", "error")]
    assert "train.checkpoint_staging_gb" in problems[0].fix
    bounded = _with(saving, train={"checkpoint_staging_gb": 8.0})  # parts even where it fits
    for machine in (small, large):
        problems = fit_problems(bounded, machine, device="cuda")
        assert [p.severity for p in problems] == ["warning"] and "7.5 GiB" in problems[0].message


def test_cpu_ranks_count_the_snapshot_in_host_memory():
    saving = _with(resolve_file(TINY), train={"checkpoint_every": 10})
    ranks = 2 * (rank_memory_bytes(saving, "cpu") + CPU_RANK_OVERHEAD_BYTES)
    snapshot = sum(rank_state_bytes(saving))
    roomy = Machine(name="m", cpus=2, memory_available=int(ranks + 2 * snapshot) + 1)
    assert fit_problems(saving, roomy, device="cpu") == []
    tight = Machine(name="m", cpus=2, memory_available=int(ranks + snapshot))
    problems = fit_problems(saving, tight, device="cpu")
    assert [(p.rule, p.severity) for p in problems] == [("FIT4", "warning")]
    assert "in parts" in problems[0].message
    never_saves = _with(saving, train={"checkpoint_every": 0})
    assert fit_problems(never_saves, tight, device="cpu") == []


def test_cluster_prices_are_positive():
    with pytest.raises(RecipeError, match=r"\[C3\].*cluster.checkpoint_write_gbps"):
        resolve_file(REPO / "recipes" / "70b_pp4.yaml", ["cluster.checkpoint_write_gbps=0"])


def test_plan_shows_the_save_cost():
    result = CliRunner().invoke(cli.main, ["plan", str(REPO / "recipes" / "70b_pp4.yaml"),
                                           "--device", "cuda"])
    assert result.exit_code == 0, result.output
    assert "Checkpoints (estimate; written in the background" in result.output
    assert "best interval (Young/Daly, node MTBF 6,335 h" in result.output
    as_json = CliRunner().invoke(cli.main, ["plan", str(TINY), "--json"])
    cost = json.loads(as_json.output)["checkpoint"]
    assert cost["total_bytes"] == 2 * 1305984 and cost["interval_steps"] is None


def _with(resolved, **sections):
    recipe = resolved.recipe
    for name, values in sections.items():
        recipe = dataclasses.replace(recipe, **{name: dataclasses.replace(getattr(recipe, name),
                                                                          **values)})
    return dataclasses.replace(resolved, recipe=recipe)


def test_checkpoint_every_auto_loads_and_a_negative_interval_is_refused():
    auto = resolve_file(TINY, ["train.checkpoint_every=auto"])
    assert auto.recipe.train.checkpoint_every == "auto"
    with pytest.raises(RecipeError, match=r"\[R1\].*must be >= 0 or auto"):
        resolve_file(TINY, ["train.checkpoint_every=-1"])
    with pytest.raises(RecipeError, match="train.checkpoint_every"):
        resolve_file(TINY, ["train.checkpoint_every=often"])


def test_a_numbered_interval_saves_as_before():
    from dsforge.runtime.loop.save_interval import SaveInterval

    resolved = _with(resolve_file(TINY), train={"checkpoint_every": 4, "steps": 10})
    interval = SaveInterval(resolved, device="cpu", first_timed_step=1, say=None)
    assert [s + 1 for s in range(10) if interval.due(s)] == [4, 8, 10]
    never = SaveInterval(_with(resolved, train={"checkpoint_every": 0}), device="cpu",
                         first_timed_step=1, say=None)
    assert not any(never.due(s) for s in range(10))


def test_auto_chooses_the_young_daly_interval_from_the_measured_steps():
    """Until it has measured 3 steps after the warmup an auto run saves only its last step;
    then every rank (each given the same mean step time) chooses the same interval."""
    from dsforge.runtime.loop.save_interval import MEASURED_STEPS, SaveInterval

    resolved = _with(resolve_file(TINY), train={"checkpoint_every": "auto", "steps": 100_000})
    said = []
    interval = SaveInterval(resolved, device="cpu", first_timed_step=2, say=said.append)
    for step, seconds in enumerate([9.0, 9.0, 0.5, 0.7, 0.6]):  # two warmup steps, then three
        assert not interval.due(step)
        interval.measured(step, seconds)
    expected = save_cost(resolved, device="cpu", step_s=0.6).interval_steps
    assert MEASURED_STEPS == 3 and interval.every == expected > 1
    assert interval.due(expected - 1) and not interval.due(expected) and interval.due(99_999)
    assert said == [f"dsforge: checkpoint every {expected:,} steps (train.checkpoint_every auto: "
                    f"0.6 s a step, {said[0].split('0.6 s a step, ')[1]}"]
    assert "a job MTBF of 6,335 h" in said[0]


def test_a_tiny_run_keeps_auto():
    from dsforge.recipe.tiny import TINY_STEPS, shrink

    recipe = resolve_file(REPO / "recipes" / "7b_1gpu.yaml", ["train.checkpoint_every=auto"]).recipe
    assert shrink(recipe, grad_accum=2).train.checkpoint_every == "auto"
    numbered = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train,
                                                                     checkpoint_every=1000))
    assert shrink(numbered, grad_accum=2).train.checkpoint_every == TINY_STEPS
