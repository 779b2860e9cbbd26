"""The guard against bad training steps (runtime/guard/health.py) and continuing a finished run.

In one world of 2 ranks (tests/distributed/legs_worker.py: the real Trainer and train_loop with
the rank's numeric drills, runtime/guard/drills.py), rank 1's output turns NaN in step 3 at ZeRO
0 (fp32: dsforge's own skip), 1 (bf16), 3 (fp32) and with a pipeline (pp2, bf16):
- train.on_nonfinite: stop: the run ends at step 3, before any save; `latest` stays the
  checkpoint after step 2 and train.keep_last keeps it; the report names the step, the rank
  and the step's data;
- skip: step 3's update is dropped (every later loss is finite: a NaN update would have made
  them NaN), the schedule holds, the save after step 4 is not written (its last step was bad),
  the run ends.
Then: NaN from step 1 on with skip stops after train.max_consecutive_skips; a loss spike is
reported with its documents (a Megatron corpus) or stops the run; a weight turned NaN before a
save stops the run without that checkpoint (ZeRO-3's partitions); a finished run continues with
a larger train.steps, its losses equal to one run of the longer total when train.lr_decay_steps
keeps the schedule, and with the schedule's rates of the new total when it does not.

Through `dsforge run` and its launcher: the issue's run (train.lr 1e30) exits 65 with the
report and leaves nothing running; a finished run continued with --resume says what changed.
"""

from __future__ import annotations

import json
import math

import pytest

from dsforge.ckpt.retention import complete_checkpoints
from dsforge.ckpt.trust import read_latest
from dsforge.job import failure
from dsforge.job.metrics_file import read_metrics
from dsforge.job.run_dir import RunDir
from tests.conftest import REPO
from tests.distributed.legs_worker import run_legs
from tests.distributed.test_checkpoint import TEXT
from tests.distributed.test_run import _job_processes, dsforge

TINY = REPO / "recipes" / "tiny.yaml"
CORPUS = REPO / "data" / "tempest"  # a Megatron indexed dataset, one document per speech
COMMON = [f"data.source={TEXT}", "train.steps=5", "train.checkpoint_every=2",
          "train.warmup_steps=0"]
LAYOUTS = {"zero0": ["zero.stage=0"], "zero1": ["zero.stage=1", "train.precision=bf16"],
           "zero3": ["zero.stage=3"],
           "pp2": ["parallel.dp=1", "parallel.pp=2", "train.precision=bf16"]}
SPIKE = [f"data.source={CORPUS}", "model.vocab_size=257", "train.steps=6",
         "train.checkpoint_every=2", "train.spike_window=3"]
CONTINUED = [f"data.source={TEXT}", "train.checkpoint_every=3", "train.warmup_steps=2"]


def _leg(run, overrides, fault=None, resume=False, recipe=None):
    return {"run": run, "overrides": overrides, "resume": resume, "fault": fault,
            "recipe": str(recipe) if recipe else None}


LEGS = [
    *[_leg(f"stop-{name}", COMMON + layout + ["train.keep_last=1"], "nan:1:3")
      for name, layout in LAYOUTS.items()],
    *[_leg(f"skip-{name}", COMMON + layout + ["train.on_nonfinite=skip"], "nan:1:3")
      for name, layout in LAYOUTS.items()],
    _leg("limit", COMMON + ["train.on_nonfinite=skip", "train.max_consecutive_skips=2"],
         "nan-from:1:1"),
    _leg("spike-report", SPIKE, "spike:1:4"),
    _leg("spike-stop", SPIKE + ["train.on_spike=stop"], "spike:1:4"),
    _leg("weights", COMMON + ["zero.stage=3"], "nan-weights:1:3"),
    _leg("continued", CONTINUED + ["train.steps=6", "train.lr_decay_steps=12"]),
    _leg("continued", CONTINUED + ["train.steps=12", "train.lr_decay_steps=12"], resume=True),
    _leg("straight", CONTINUED + ["train.steps=12", "train.lr_decay_steps=12"]),
    _leg("new-total", CONTINUED + ["train.steps=6"]),
    _leg("new-total", CONTINUED + ["train.steps=12"], resume=True),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("guard")
    ends = run_legs(out, TINY, LEGS, timeout_s=420)
    return out, {leg["run"]: end for leg, end in zip(LEGS, ends)}


def _records(run_dir) -> list[dict]:
    _strict_json(run_dir / "metrics.jsonl")
    return read_metrics(run_dir / "metrics.jsonl")[0]


def _strict_json(path) -> None:
    """Every line of `path` is JSON a strict reader takes: no bare NaN or Infinity (a value
    that is not finite is written as null)."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    texts = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
    for text in texts:
        json.loads(text, parse_constant=refuse)


def _anomalies(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "anomalies.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_step_stops_the_run_before_any_save(world, layout):
    out, ends = world
    run_dir = out / f"stop-{layout}"
    assert ends[f"stop-{layout}"] == {"halted": 3, "kind": "nonfinite",
                                      "what": "non-finite loss and gradient norm"}
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records[:3]) and records[3]["loss"] is None
    assert records[3]["skipped"] and records[3]["grad_norm"] is None
    _strict_json(run_dir / "summary.json")
    assert json.loads((run_dir / "summary.json").read_text())["final_loss"] is None
    root = run_dir / "checkpoints"
    assert read_latest(root) == "step00000002" and list(complete_checkpoints(root)) == [2]
    [bad] = _anomalies(run_dir)
    assert bad["step"] == 3 and bad["action"] == "stop" and bad["ranks"] == [1]
    assert bad["data"]["samples"] == [24, 31] and str(TEXT) in bad["data"]["token offsets"]
    record = failure.first(RunDir(run_dir))
    assert record.kind == "nonfinite" and record.rank == 0 and record.step == 3
    assert "the last good checkpoint: " + str(root / "step00000002") in record.detail
    assert "--set train.on_nonfinite=skip" in record.detail


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_step_is_skipped_and_the_run_goes_on(world, layout):
    out, ends = world
    run_dir = out / f"skip-{layout}"
    assert ends[f"skip-{layout}"] is None
    records = _records(run_dir)
    assert [r["skipped"] for r in records] == [False, False, False, True, False]
    # Its update was dropped: a NaN update would have left every later loss NaN.
    assert records[3]["loss"] is None and math.isfinite(records[4]["loss"])
    assert records[4]["lr"] == records[3]["lr"]  # the schedule did not advance
    stopped_here = _records(out / f"stop-{layout}")
    assert [r["loss"] for r in records[:3]] == [r["loss"] for r in stopped_here[:3]]
    # No checkpoint right after the bad step: the one after step 4 was not written.
    assert list(complete_checkpoints(run_dir / "checkpoints")) == [2, 5]
    [bad] = _anomalies(run_dir)
    assert (bad["step"], bad["action"], bad["ranks"]) == (3, "skip", [1])
    _strict_json(run_dir / "summary.json")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 5


def test_skipping_stops_after_too_many_bad_steps_in_a_row(world):
    out, ends = world
    assert ends["limit"] == {
        "halted": 3, "kind": "nonfinite",
        "what": "non-finite loss and gradient norm, 3 steps in a row: more than "
                "train.max_consecutive_skips (2)"}
    assert [a["action"] for a in _anomalies(out / "limit")] == ["skip", "skip", "stop"]
    assert not (out / "limit" / "checkpoints").exists()  # the save after step 1 was withheld
    assert "the run has likely diverged" in failure.first(RunDir(out / "limit")).detail


def test_a_loss_spike_is_reported_with_its_documents_or_stops_the_run(world):
    out, ends = world
    assert ends["spike-report"] is None
    [spike] = _anomalies(out / "spike-report")
    assert spike["kind"] == "spike" and spike["step"] == 4 and spike["action"] == "report"
    assert "x the median" in spike["what"] and spike["data"]["samples"] == [32, 39]
    documents = spike["data"]["documents"][str(CORPUS)]
    assert documents and all(isinstance(d, int) for d in documents)
    assert len(_records(out / "spike-report")) == 6
    assert ends["spike-stop"]["halted"] == 4 and ends["spike-stop"]["kind"] == "spike"
    assert read_latest(out / "spike-stop" / "checkpoints") == "step00000004"
    assert "--set train.on_spike=report" in failure.first(RunDir(out / "spike-stop")).detail


def test_non_finite_weights_are_never_saved(world):
    """ZeRO-3: a weight of rank 1's partition turns NaN after step 3's update."""
    out, ends = world
    assert ends["weights"] == {"halted": 3, "kind": "weights", "what": "non-finite weights "
                               "before the save of step 4; the checkpoint was not written"}
    root = out / "weights" / "checkpoints"
    assert read_latest(root) == "step00000002" and list(complete_checkpoints(root)) == [2]
    assert not (root / "step00000004").exists()
    assert "on rank 1" in failure.first(RunDir(out / "weights")).detail


def test_a_finished_run_continues_as_one_longer_run(world):
    """train.lr_decay_steps: 12 from the start: the 6-step run's schedule is the 12-step run's,
    so continuing it to 12 steps gives the straight run's losses bitwise."""
    out, ends = world
    assert ends["continued"] is None and ends["straight"] is None
    continued, straight = _records(out / "continued"), _records(out / "straight")
    assert len(continued) == 12 and [r["loss"] for r in continued] == [r["loss"] for r in straight]
    manifest = json.loads((out / "continued" / "manifest.json").read_text())
    assert manifest["resumed"] == {"after_step": 6, "checkpoint": "step00000006",
                                   "changes": ["train.steps: 6 in the checkpoint, 12 now"]}


def test_a_continued_run_takes_the_new_totals_schedule(world):
    """Without train.lr_decay_steps the schedule spans the new total from the resumed step on
    (as Megatron-LM's --override-opt_param-scheduler): step 6 on trains at the 12-step rates."""
    out, _ = world
    new_total, straight = _records(out / "new-total"), _records(out / "straight")
    assert [r["lr"] for r in new_total[6:]] == [r["lr"] for r in straight[6:]]
    assert new_total[5]["lr"] < straight[5]["lr"]  # the first 6 steps decayed over 6
    manifest = json.loads((out / "new-total" / "manifest.json").read_text())
    assert "the learning-rate schedule now decays over 12 steps instead of 6" in \
        manifest["resumed"]["changes"][-1]


def test_the_issue_run_stops_with_its_report_through_dsforge_run(tmp_path):
    """train.lr 1e30: step 0's update is finite and ruins the weights; step 1 is NaN."""
    run_dir = tmp_path / "run"
    result = dsforge("run", str(TINY), "--set", "train.lr=1e30", "--set", "train.warmup_steps=0",
                     "--set", "train.grad_clip=0", "--set", "train.checkpoint_every=4",
                     "--run-dir", str(run_dir), timeout=180)
    assert result.returncode == 65, result.stderr[-3000:]
    assert "dsforge: the training stopped at step 2: non-finite loss and gradient norm (on " \
           "ranks 0, 1)" in result.stderr
    assert "no checkpoint had been saved before it" in result.stderr
    assert "exit code 65" in result.stderr and not (run_dir / "checkpoints").exists()
    assert not _job_processes(run_dir)


def test_a_finished_run_continues_through_dsforge_run(tmp_path):
    run_dir = tmp_path / "run"
    common = ["--set", "train.checkpoint_every=2", "--run-dir", str(run_dir)]
    first = dsforge("run", str(TINY), "--set", "train.steps=4", *common, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    again = dsforge("run", str(TINY), "--set", "train.steps=4", *common, "--resume", timeout=60)
    assert again.returncode == 2 and "continue it with a larger total" in again.stderr
    longer = dsforge("run", str(TINY), "--set", "train.steps=6", *common, "--resume", timeout=180)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "changed: train.steps: 4 in the checkpoint, 6 now" in longer.stderr
    assert "the learning-rate schedule now spans 6 steps (it spanned 4): the next step trains " \
           "at lr" in longer.stderr
    assert len(_records(run_dir)) == 6 and read_latest(run_dir / "checkpoints") == "step00000006"
