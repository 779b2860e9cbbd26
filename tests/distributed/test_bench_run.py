"""`dsforge bench` end to end on CPU: a study survives a crashing cell, a hanging cell and an
invalid cell, skips finished cells when run again, re-runs failed ones with --retry-failed, and
`dsforge report` renders the result. Ctrl-C stops the study with no row for the cell in flight;
a re-run after a SIGKILLed bench never shares a cell with the orphaned job."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

from dsforge import lock
from tests.conftest import REPO, as_foreground_job
from tests.distributed.test_run import dsforge

# ZeRO-3, so a measured cell's tensor census (runtime/loop/tensor_census.py) meets ZeRO-3's
# partitioned parameters; the --tiny test's cell is ZeRO-0, plan --measure's are ZeRO-1 and 2.
STUDY = f"""
name: drill
recipe: {REPO / 'recipes' / 'tiny.yaml'}
world_size: 2
device: cpu
set: {{parallel.dp: 2, zero.stage: 3}}
axes:
  train.global_batch: [8, 7]
measure: {{warmup_steps: 1, steps: 3, repeats: 1, timeout_s: 120, step_timeout_s: 5}}
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
    assert "rank 1 failed at step 3: RuntimeError: injected fault" in crashed.stderr

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
    """`dsforge bench --tiny`: a GPU-scale study's cells at tiny size, stored as NAME-tiny.

    The cell is ZeRO-0 in bf16 over 2 data-parallel ranks, DeepSpeed's FP16_Optimizer in bf16
    mode rather than a ZeRO optimizer (test_reshard's bf16 pair resumes from that path)."""
    study, out = tmp_path / "big.yaml", tmp_path / "out"
    study.write_text(f"name: big\nrecipe: {REPO / 'recipes' / '13b_8gpu_zero3.yaml'}\n"
                     "world_size: 2\nset: {cluster: null, train.global_batch: 64}\n"
                     "axes:\n  zero.stage: [0]\n"
                     "measure: {warmup_steps: 1, steps: 3, repeats: 1, timeout_s: 240}\n")
    result = dsforge("bench", str(study), "--out", str(out), "--tiny")
    assert result.returncode == 0, result.stderr[-3000:]
    with sqlite3.connect(out / "results.db") as con:
        (name, status, recipe), = con.execute("SELECT study, status, recipe FROM results")
    assert (name, status) == ("big-tiny", "ok")
    assert "hidden_size: 16" in recipe and "stage: 0" in recipe and "precision: bf16" in recipe
    assert "dp: 2" in recipe


def _start_bench(study, out) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dsforge", "bench", str(study), "--out", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_foreground_job)


def _wait_for_job(out, timeout_s: float = 60.0):
    """The cell directory whose job runs now, once its processes are up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for cell in (out / "cells").glob("*/repeat0"):
            if cell.is_dir() and lock.job_processes(cell):
                return cell
        time.sleep(0.2)
    raise AssertionError("no cell job started")


def _rows(db) -> list:
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        return con.execute("SELECT axes, status FROM results").fetchall()


def test_ctrl_c_stops_the_study_and_a_killed_bench_leaves_no_shared_cell(tmp_path):
    study, out = tmp_path / "drill.yaml", tmp_path / "out"
    study.write_text(STUDY.replace("train.global_batch: [8, 7]", "train.global_batch: [8, 16]"))
    db = out / "results.db"

    bench = _start_bench(study, out)
    cell = _wait_for_job(out)
    bench.send_signal(signal.SIGINT)
    _, stderr = bench.communicate(timeout=60)
    assert bench.returncode == 130, stderr[-3000:]
    assert "stopped while train.global_batch=8 repeat 0 ran" in stderr
    assert _rows(db) == [] and [p.name for p in (out / "cells").iterdir() if p.is_dir()] == [cell.parent.name]
    assert not lock.job_processes(cell)  # nothing of the job is left

    one_cell = tmp_path / "drill-8.yaml"  # the same study's first cell alone
    one_cell.write_text(STUDY.replace("train.global_batch: [8, 7]", "train.global_batch: [8]"))
    bench = _start_bench(one_cell, out)
    cell = _wait_for_job(out)
    bench.kill()  # SIGKILL: its job ends with it (its keeper, launch/keeper.py)
    bench.communicate()
    deadline = time.monotonic() + 15
    while lock.job_processes(cell) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = lock.job_processes(cell)
    for pid in orphans:  # a failing test leaves nothing behind
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not orphans, f"the killed bench's job outlived it by 15 s: {orphans}"
    rerun = dsforge("bench", str(one_cell), "--out", str(out))
    assert rerun.returncode == 0, rerun.stderr[-3000:]  # the cell is free, not busy
    assert '{"train.global_batch": 8}' in dict(_rows(db))
