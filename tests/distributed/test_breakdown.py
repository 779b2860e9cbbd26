"""The step breakdown in real layouts (docs/breakdown.md): every step record has every phase,
none negative, summing to the step's time; the phases each layout has are measured (the
data-parallel reduction and ZeRO-3's gathers, recompute under full checkpointing, pipeline
waits and the bubble with pp > 1); and `tracking.profile` writes rank 0's trace of exactly
the steps asked for; an MoE model's expert loop is its own phase. Two worlds of 2 CPU ranks
(dense, MoE) train the layouts in turn."""

from __future__ import annotations

import gzip
import json

import pytest

from dsforge.job.metrics_file import PHASES
from tests.conftest import REPO
from tests.distributed.harness import run_world

STEPS = ["train.steps=4", "train.timing_warmup=1", "train.global_batch=8", "train.micro_batch=2"]
CASES = {
    "dp2_zero1_profiled": STEPS + ["parallel.dp=2", "zero.stage=1", 'tracking.profile="1:2"'],
    "dp2_zero3": STEPS + ["parallel.dp=2", "zero.stage=3"],
    "pp2_full_ckpt": STEPS + ["parallel.dp=1", "parallel.pp=2", "zero.stage=1",
                              "train.activation_checkpointing=full"],
}
# MoE: the expert loop's share, in 1F1B with full checkpointing (forward, recompute and
# backward of the experts all nested in other phases)
MOE_CASES = {"moe_ep2": STEPS + ["parallel.dp=2", "parallel.ep=2", "zero.stage=1"],
             "moe_pp2_full_ckpt": STEPS + ["parallel.dp=1", "parallel.pp=2", "parallel.ep=1",
                                           "zero.stage=1", "train.activation_checkpointing=full"]}
# Phases each layout must spend time in at every step (others may be 0).
SPENT = {"dp2_zero1_profiled": {"data", "forward", "backward", "optimizer", "dp_comm"},
         "dp2_zero3": {"data", "forward", "backward", "optimizer", "dp_comm"},
         "pp2_full_ckpt": {"data", "forward", "backward", "optimizer", "recompute", "pipeline_wait"},
         "moe_ep2": {"data", "forward", "backward", "experts", "optimizer", "dp_comm"},
         "moe_pp2_full_ckpt": {"data", "forward", "backward", "recompute", "experts", "optimizer",
                               "pipeline_wait"}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("breakdown")
    metrics = run_world(2, CASES, recipe=REPO / "recipes" / "tiny.yaml", out=out, timeout_s=240)
    metrics |= run_world(2, MOE_CASES, recipe=REPO / "recipes" / "tiny_moe.yaml", out=out / "moe",
                         timeout_s=240)
    return out, metrics


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES) + sorted(MOE_CASES))
def test_every_step_is_broken_down_into_its_phases(world, case):
    out, metrics = world
    out = out / "moe" if case in MOE_CASES else out
    steps = [r for r in metrics[case] if "step_time_s" in r]
    assert len(steps) == 4
    for record in steps:
        phases = record["breakdown_s"]
        assert tuple(phases) == PHASES
        assert all(seconds >= 0 for seconds in phases.values()), phases
        assert sum(phases.values()) == pytest.approx(record["step_time_s"], abs=1e-9)
        assert {p for p, seconds in phases.items() if seconds > 0} >= SPENT[case], phases
    summary = json.loads((out / case / "summary.json").read_text())
    assert set(summary["median_breakdown_s"]) == set(PHASES)
    ranks = [json.loads(p.read_text()) for p in sorted((out / case / "ranks").glob("rank*.json"))]
    assert len(ranks) == 2 and all(set(r["breakdown_s"]) == set(PHASES) for r in ranks)
    pipelined = "pp2" in case
    assert all((r["bubble_share"] is not None) == pipelined for r in ranks)
    assert (summary["median_breakdown_s"]["experts"] > 0) == (case in MOE_CASES)


@pytest.mark.timeout(300)
def test_the_profile_traces_steps_a_to_b_of_rank_0(world):
    out, _ = world
    traces = list((out / "dp2_zero1_profiled" / "profile").iterdir())
    assert [t.name for t in traces] == ["rank0-steps1-2.pt.trace.json.gz"]
    events = json.loads(gzip.open(traces[0]).read())["traceEvents"]
    assert {e["name"] for e in events if str(e.get("name", "")).startswith("dsforge step")} \
        == {"dsforge step 1", "dsforge step 2"}
    assert not (out / "dp2_zero3" / "profile").exists()
