"""`dsforge bench` end to end on CPU: a study survives a crashing cell, a hanging cell and an
invalid cell, skips finished cells when run again, re-runs failed ones with --retry-failed, and
`dsforge report` renders the result."""

from __future__ import annotations

import sqlite3

from tests.conftest import REPO
from tests.distributed.test_run import dsforge

STUDY = f"""
name: drill
recipe: {REPO / 'recipes' / 'tiny.yaml'}
world_size: 2
device: cpu
set: {{parallel.dp: 2}}
axes:
  train.global_batch: [8, 7]
measure: {{warmup_steps: 1, steps: 3, repeats: 1, timeout_s: 120, step_timeout_s: 10}}
"""


def _statuses(db) -> dict[str, str]:
    with sqlite3.connect(db) as con:
        return {axes: status for axes, status in con.execute("SELECT axes, status FROM results")}


def test_study_survives_failures_and_resumes(tmp_path):
    study, out = tmp_path / "drill.yaml", tmp_path / "out"
    study.write_text(STUDY)
    db = out / "results.db"
    crashed = dsforge("bench", str(study), "--out", str(out), env={"DSFORGE_INJECT_FAULT": "raise:1:2"})
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert _statuses(db) == {'{"train.global_batch": 8}': "crashed", '{"train.global_batch": 7}': "rejected"}
    assert "rank 1 failed at step 2: RuntimeError: injected fault" in crashed.stderr

    skipped = dsforge("bench", str(study), "--out", str(out))
    assert "repeat 0" not in skipped.stderr  # everything was finished: nothing ran

    hung = dsforge("bench", str(study), "--out", str(out), "--retry-failed",
                   env={"DSFORGE_INJECT_FAULT": "hang:0:1"})
    assert hung.returncode == 0
    assert _statuses(db)['{"train.global_batch": 8}'] == "timeout"  # the stuck rank was ended

    retried = dsforge("bench", str(study), "--out", str(out), "--retry-failed")
    assert retried.returncode == 0 and "train.global_batch=8 repeat 0: ok" in retried.stderr
    assert _statuses(db)['{"train.global_batch": 8}'] == "ok"

    report = dsforge("report", str(db))
    assert report.returncode == 0
    text = (out / "report.md").read_text()
    assert "| 8 | ok |" in text and "| 7 | rejected |" in text and (out / "drill.png").exists()


def test_bench_tiny_runs_a_gpu_study_layout_on_cpu(tmp_path):
    """`dsforge bench --tiny`: a GPU-scale study's cells at tiny size, stored as NAME-tiny."""
    study, out = tmp_path / "big.yaml", tmp_path / "out"
    study.write_text(f"name: big\nrecipe: {REPO / 'recipes' / '13b_8gpu_zero3.yaml'}\n"
                     "world_size: 2\nset: {cluster: null, train.global_batch: 64}\n"
                     "axes:\n  zero.stage: [3]\n"
                     "measure: {warmup_steps: 1, steps: 3, repeats: 1, timeout_s: 240}\n")
    result = dsforge("bench", str(study), "--out", str(out), "--tiny")
    assert result.returncode == 0, result.stderr[-3000:]
    with sqlite3.connect(out / "results.db") as con:
        (name, status, recipe), = con.execute("SELECT study, status, recipe FROM results")
    assert (name, status) == ("big-tiny", "ok")
    assert "hidden_size: 16" in recipe and "stage: 3" in recipe
