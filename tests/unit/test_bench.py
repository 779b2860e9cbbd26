"""Bench pieces without jobs: study loading and expansion, the store, classification, report;
and, with a stand-in for the job launcher, a study's life under busy cells, Ctrl-C, edited
recipes, invalid studies, a locked or corrupted database and an unwritable --out."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from dsforge import lock
from dsforge.bench import run as bench_run
from dsforge.bench import store as bench_store
from dsforge.bench.report import write_report
from dsforge.bench.run import bench_study, cell_dir, classify, one_line, run_cell
from dsforge.bench.store import Row, Store
from dsforge.bench.study import check_study, expand, load_study, study_identity
from dsforge.cli import main
from dsforge.job import failure
from dsforge.job.run_dir import RunDir
from dsforge.job.word import JobSpec
from dsforge.problems import RecipeError
from tests.conftest import REPO

STUDIES = sorted((REPO / "recipes" / "bench").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_shipped_studies_load_and_their_cells_validate(path):
    from dsforge.bench.run import resolve_cell

    study, recipe = load_study(path)
    cells = expand(study)
    assert len(cells) == __import__("math").prod(len(v) for v in study.axes.values())
    for cell in cells:
        resolve_cell(study, recipe, cell)  # every shipped cell is valid at its declared size


def test_expansion_is_the_cartesian_product_with_schedules(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(f"recipe: {REPO / 'recipes' / 'tiny.yaml'}\nworld_size: 4\n"
                    "axes: {zero.stage: [0, 1], schedule: [none, 1f1b, interleaved:2]}\n"
                    "pipeline_stages: 2\nmeasure: {warmup_steps: 1, steps: 3}\n")
    study, _ = load_study(path)
    cells = expand(study)
    assert [c.axes for c in cells][:3] == [{"zero.stage": 0, "schedule": "none"},
                                           {"zero.stage": 0, "schedule": "1f1b"},
                                           {"zero.stage": 0, "schedule": "interleaved:2"}]
    interleaved = cells[2].overrides
    assert "parallel.pp=2" in interleaved and "parallel.vpp=2" in interleaved
    assert "train.steps=4" in interleaved and "train.timing_warmup=1" in interleaved
    assert len({c.key for c in cells}) == 6


@pytest.mark.parametrize("text, rule", [
    ("recipe: x.yaml\naxes: {}\n", "S2"),
    ("recipe: x.yaml\naxes: {schedule: [zigzag]}\n", "S3"),
    ("recipe: x.yaml\naxes: {schedule: [1f1b]}\n", "S3"),
    ("recipe: x.yaml\naxes: {zero.stage: [1]}\nmeasure: {steps: 0}\n", "S1"),
    ("recipe: x.yaml\naxes: {zero.stage: [1]}\nrepeats: 2\n", "Z6"),
])
def test_bad_studies_are_rejected(tmp_path, text, rule):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_study(path)
    assert rule in {p.rule for p in info.value.problems}


def test_invalid_cells_are_rejected_without_running(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(f"recipe: {REPO / 'recipes' / 'tiny.yaml'}\nworld_size: 2\n"
                    "axes: {train.global_batch: [7]}\n")
    study, recipe = load_study(path)
    row = run_cell(study, recipe, expand(study)[0], 0, tmp_path)
    assert row.status == "rejected" and "[B2]" in row.reason
    assert not (tmp_path / "cells").exists()


def test_store_keeps_rows_and_overwrites_a_retry(tmp_path):
    store = Store(tmp_path / "r.db")
    store.write(Row(study="s", cell="c", repeat=0, axes={"a": 1}, status="crashed", reason="boom"))
    store.write(Row(study="s", cell="c", repeat=1, axes={"a": 1}, status="ok", figures={"x": 1}))
    assert store.status("s", "c", 0) == "crashed" and store.status("s", "c", 2) is None
    store.write(Row(study="s", cell="c", repeat=0, axes={"a": 1}, status="ok"))
    store.close()
    rows = Store(tmp_path / "r.db").rows("s")
    assert sorted((r.repeat, r.status) for r in rows) == [(0, "ok"), (1, "ok")]


@pytest.mark.parametrize("code, record, expected", [
    (124, None, "timeout"),
    (3, dict(kind="hang", message="step 1 made no progress for 10s (a hung collective?)"), "timeout"),
    (1, dict(kind="exception", message="RuntimeError: injected fault"), "crashed"),
    (1, dict(kind="oom", message="torch.OutOfMemoryError: CUDA out of memory."), "oom"),
    (-9, None, "oom"),
    (1, None, "crashed"),
])
def test_classification_from_exit_code_and_failure_records(tmp_path, code, record, expected):
    """Classified from the ranks' structured failure records, never from the text they print."""
    run_dir = RunDir(tmp_path)
    run_dir.job_log.write_text("RuntimeError: out of memory (printed text is not read)\n")
    if record is not None:
        failure.write(run_dir, failure.Failure(rank=1, step=2, **record))
    status, reason = classify(code, run_dir)
    assert status == expected
    if record is not None:
        assert reason.startswith("rank 1 ") and record["message"] in reason


def test_a_run_whose_training_went_bad_is_diverged_though_its_ranks_exit_0(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.summary.write_text("{}")  # it wrote its summaries before stopping
    failure.write(run_dir, failure.Failure(rank=0, step=3, kind="nonfinite",
                                           message="non-finite loss and gradient norm"))
    assert classify(0, run_dir) == (
        "diverged", "the training stopped at step 4: non-finite loss and gradient norm")


def test_the_earliest_failure_record_is_the_cause(tmp_path):
    run_dir = RunDir(tmp_path)
    failure.write(run_dir, failure.Failure(rank=0, step=2, kind="exception", message="peer gone",
                                           time=200.0))
    failure.write(run_dir, failure.Failure(rank=3, step=2, kind="hang", message="stuck", time=100.0))
    (run_dir.failures / "rank00009.partial").write_text("{half")  # never read
    assert classify(1, run_dir) == ("timeout", "rank 3 stuck at step 3: stuck")


def test_report_lists_every_cell_with_predictions_and_plots(tmp_path):
    store = Store(tmp_path / "r.db")
    split = {"params": 2**28, "grads": 2**28, "optimizer": 2**29, "activations": 2**29, "buffers": 2**29}
    prediction = {"memory_bytes": {**split, "total": 2 * 1024**3}, "bubble_share_of_step": 0.2,
                  "flops_per_token": 1e9, "hardware_flops_per_token": 1.2e9}
    figures = {"step_times_s": [1.0, 1.2], "tokens_per_s": 1000.0, "tokens_per_s_per_gpu": 500.0,
               "mfu": None, "hfu": None, "final_loss": 2.0, "peak_memory_bytes": 3 * 1024**3,
               "memory_source": "cuda max_memory_allocated", "bubble_share_by_stage": {"0": 0.25, "1": 0.3},
               "tensor_bytes_backward": {"grads": 2**20, "bucket": 2**21, "total": 2**22},
               "tensor_bytes_step": {"grads": 2**22, "bucket": 2**21, "total": 2**23},
               "tensor_bytes_optimizer": {"grads": 0, "step_grads": 2**23, "total": 2**24}}
    manifest = {"device": {"name": "NVIDIA H100 80GB HBM3"}}
    store.write(Row(study="s", cell="a", repeat=0, axes={"zero.stage": 1}, status="ok",
                    figures=figures, prediction=prediction, manifest=manifest))
    store.write(Row(study="s", cell="b", repeat=0, axes={"zero.stage": 2}, status="rejected",
                    reason="[Z2] no"))
    store.close()
    report = write_report(tmp_path / "r.db", tmp_path / "out").read_text()
    assert "Peak used: 989 TFLOP/s (NVIDIA H100 SXM)" in report
    assert "| 1 | ok | 1,000 | 500 | 1100.0 [1000.0-1200.0] | n/a | n/a | 3.00 | 2.00 | 30.0% | 20.0% |" in report
    assert "{'zero.stage': 2}: rejected: [Z2] no" in report
    assert "| 1 | 256.00 | 256.00 | - | 512.00 | 512.00 | 512.00 | - | - | - | 2,048.00 | 3,072.0 |" in report
    # the census inside the step (grads and bucket as the last backward ends, grads before
    # the optimizer step, grads and the fp32 step gradient when the torch optimizer steps);
    # none after training in this row
    assert "| cuda max_memory_allocated | 1.00 | 2.00 | 4.00 | 0.00 | 8.00 | - | - | - |" in report
    assert (tmp_path / "out" / "s.png").stat().st_size > 1000
    overridden = write_report(tmp_path / "r.db", tmp_path / "o2", peak_tflops=100).read_text()
    assert "| 0.5% | 0.6% |" in overridden  # 500 tok/s x 1e9 / 1e14


# --- A job's whole life under signals, crashes and bad input (issue 10) ---------------------

TINY_TEXT = (REPO / "recipes" / "tiny.yaml").read_text()


def _study(tmp_path, axes="{zero.stage: [0, 1]}", extra="", recipe=None):
    """A study on a copy of the tiny recipe (so a test can edit it), and its parsed form."""
    if recipe is None:
        recipe = tmp_path / "tiny.yaml"
        if not recipe.exists():
            recipe.write_text(TINY_TEXT)
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nrecipe: {recipe}\nworld_size: 2\nset: {{parallel.dp: 2}}\n"
                    f"axes: {axes}\nmeasure: {{warmup_steps: 1, steps: 2}}\n{extra}")
    return path, *load_study(path)


class FakeJobs:
    """Stands in for the job launcher: records each launch, and crashes (a failure record) or
    returns the exit code it is given."""

    def __init__(self, monkeypatch, codes=()):
        self.launched, self.codes = [], list(codes)
        monkeypatch.setattr(bench_run, "launch_cell", self)

    def __call__(self, study, resolved, run_dir, device):
        self.launched.append(run_dir)
        code = self.codes.pop(0) if self.codes else 1
        if code == 1:
            failure.write(run_dir, failure.Failure(rank=0, step=1, kind="exception",
                                                   message="RuntimeError: injected"))
        return code


def _rows(db):
    return [(r.cell, r.repeat, r.status) for r in Store(db).rows()]


# Item 2: one owner per cell directory.

def test_a_directory_lock_has_one_owner_and_names_it(tmp_path):
    target = tmp_path / "cell"
    held = lock.hold_directory(target, what="study s cell c", wait_s=0)
    assert lock.lock_path(target) == tmp_path / "cell.lock"  # beside, so the owner may empty it
    with pytest.raises(lock.Busy) as info:
        lock.hold_directory(target, wait_s=0)
    assert f"pid {os.getpid()}" in str(info.value) and "study s cell c" in str(info.value)
    held.release()
    with lock.hold_directory(target, wait_s=0):
        pass


def test_a_lock_dies_with_its_owner(tmp_path):
    """flock is dropped by the kernel when its holder dies, even by SIGKILL: no stale locks."""
    target = tmp_path / "cell"
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              "from dsforge import lock\n"
                              f"lock.hold_directory(__import__('pathlib').Path({str(target)!r}))\n"
                              "print('held', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(lock.Busy, match=f"pid {child.pid}"):
            lock.hold_directory(target, wait_s=0)
    finally:
        child.kill()
        child.wait()
    lock.hold_directory(target, wait_s=0).release()


def test_a_job_still_writing_into_the_directory_makes_it_busy(tmp_path):
    """An orphaned job (its dsforge killed) is found by the run directory in its --job word."""
    target = tmp_path / "cell"
    word = JobSpec(recipe_yaml="", run_dir=str(target.resolve())).encode()
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--job", word])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--job",
                              JobSpec(recipe_yaml="", run_dir=str(target) + "0").encode()])
    tagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, lock.JOB_DIR_ENV: str(target.resolve())})
    try:
        deadline = time.monotonic() + 10
        while len(lock.job_processes(target)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.job_processes(target) == sorted([job.pid, tagged.pid])  # not cell0's
        tagged.kill()
        tagged.wait()
        with pytest.raises(lock.Busy, match=f"pids {job.pid}"):
            lock.hold_directory(target, wait_s=0.3)
    finally:
        for p in (job, other, tagged):
            p.kill()
            p.wait()
    lock.hold_directory(target, wait_s=0).release()  # and the lock was given back


def test_a_busy_cell_is_neither_run_nor_recorded(tmp_path, monkeypatch):
    """A cell another owner holds keeps its directory untouched; the study says so (exit 75)."""
    path, study, recipe = _study(tmp_path)
    jobs = FakeJobs(monkeypatch)
    out = tmp_path / "out"
    first = expand(study, base=study_identity(study, recipe))[0]
    busy_dir = cell_dir(out, first, 0)
    busy_dir.path.mkdir(parents=True)
    busy_dir.job_log.write_text("the other owner's job\n")
    lines = []
    with lock.hold_directory(busy_dir.path, what="another bench", wait_s=0):
        assert bench_study(study, recipe, out, log=lines.append) == 75
    assert busy_dir.job_log.read_text() == "the other owner's job\n"
    assert jobs.launched == [cell_dir(out, expand(study, base=study_identity(study, recipe))[1], 0)]
    assert [status for _, _, status in _rows(out / "results.db")] == ["crashed"]
    assert any("zero.stage=0 repeat 0: busy, not run" in line and "another bench" in line
               for line in lines)


# Item 7: Ctrl-C / SIGTERM stop the study, leave no row and exit 130 / 143.

@pytest.mark.parametrize("code", [130, 143])
def test_a_stopped_cell_stops_the_study_without_a_row(tmp_path, monkeypatch, code):
    path, study, recipe = _study(tmp_path)
    jobs = FakeJobs(monkeypatch, codes=[code])
    lines = []
    assert bench_study(study, recipe, tmp_path / "out", log=lines.append) == code
    assert len(jobs.launched) == 1  # the next cell was not started
    assert _rows(tmp_path / "out" / "results.db") == []
    assert "stopped while zero.stage=0 repeat 0 ran" in lines[-1]
    assert bench_study(study, recipe, tmp_path / "out", log=lines.append) == 0  # runs it now
    assert len(jobs.launched) == 3


# Item 8: a cell's identity includes its recipe; invalid studies fail before any cell runs.

def test_an_edited_base_recipe_gives_new_cells_and_keeps_the_old_rows(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path)
    jobs = FakeJobs(monkeypatch)
    db = tmp_path / "out" / "results.db"
    assert bench_study(study, recipe, tmp_path / "out", log=lambda _: None) == 0
    assert len(jobs.launched) == 2
    recipe.write_text("# a comment changes nothing measured\n" + TINY_TEXT)
    bench_study(study, recipe, tmp_path / "out", log=lambda _: None)
    assert len(jobs.launched) == 2
    recipe.write_text(TINY_TEXT.replace("lr: 1.0e-3", "lr: 2.0e-3"))
    bench_study(study, recipe, tmp_path / "out", log=lambda _: None)
    assert len(jobs.launched) == 4  # every cell again, for the edited recipe
    rows = _rows(db)
    assert len(rows) == 4 and len({cell for cell, _, _ in rows}) == 4  # the old rows stay


def test_identity_covers_the_world_and_the_base_but_not_formatting(tmp_path):
    path, study, recipe = _study(tmp_path)
    key = expand(study, base=study_identity(study, recipe))[0].key
    assert key != expand(study)[0].key
    wider = dataclasses.replace(study, world_size=4, set={"parallel.dp": 4})
    assert expand(wider, base=study_identity(wider, recipe))[0].key != key


@pytest.mark.parametrize("case, expected", [
    ("missing", ["[Y6]", "recipe file not found"]),
    ("axis", ["[Z6] zero.stag=0: unknown key (in axis zero.stag)", 'Did you mean "stage"?',
              "[Z6] train.micro_bach=1: unknown key (in axis train.micro_bach)"]),
    ("base", ["[Y2] train.lr='fast'", "in the study's base recipe"]),
    ("value", ["[Y3] train.precision='fp64'", "(in axis train.precision)"]),
])
def test_an_invalid_study_exits_2_listing_every_problem_before_any_cell(tmp_path, monkeypatch,
                                                                        case, expected):
    jobs = FakeJobs(monkeypatch)
    recipe = tmp_path / "gone.yaml" if case == "missing" else None
    axes = {"axis": "{zero.stag: [0, 1], train.micro_bach: [1], zero.stage: [0]}",
            "value": "{train.precision: [bf16, fp64]}"}.get(case, "{zero.stage: [0, 1]}")
    path, study, _ = _study(tmp_path, axes=axes, recipe=recipe)
    if case == "base":
        path.write_text(path.read_text().replace("set: {parallel.dp: 2}",
                                                 "set: {parallel.dp: 2, train.lr: fast}"))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    for text in expected:
        assert text in result.output
    assert result.output.count("zero.stag=") <= 1  # an unknown axis once, not once per value
    assert not jobs.launched and not out.exists()


def test_cells_invalid_in_some_combinations_are_rejected_rows(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path, axes="{train.global_batch: [8, 7]}")
    jobs = FakeJobs(monkeypatch)
    assert check_study(study, recipe) == []
    assert bench_study(study, recipe, tmp_path / "out", log=lambda _: None) == 0
    assert sorted(s for _, _, s in _rows(tmp_path / "out" / "results.db")) == ["crashed", "rejected"]
    assert len(jobs.launched) == 1


def test_rejected_cells_are_checked_again_and_run_once_valid(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path, axes="{zero.stage: [1]}")
    jobs = FakeJobs(monkeypatch)
    cell = expand(study, base=study_identity(study, recipe))[0]
    db = tmp_path / "out" / "results.db"
    store = Store(db)
    store.write(Row(study="s", cell=cell.key, repeat=0, axes=cell.axes, status="rejected",
                    reason="[X1] a rule an older dsforge had"))
    store.close()
    assert bench_study(study, recipe, tmp_path / "out", log=lambda _: None) == 0
    assert len(jobs.launched) == 1 and _rows(db) == [(cell.key, 0, "crashed")]


def _machine(monkeypatch, memory_available, gpus=()):
    monkeypatch.setattr(bench_run, "probe", lambda: {"cpus": 2, "memory_available": memory_available,
                                                      "gpus": list(gpus)})


def test_a_cell_this_machine_cannot_hold_is_rejected_before_its_job(tmp_path, monkeypatch):
    """As `dsforge run` refuses it: CPU ranks over the host's available memory (FIT2; the
    ranks would take it from everything else on the machine), or a cuda study with more ranks
    than GPUs (FIT1). --skip-fit-check runs it anyway."""
    path, study, recipe = _study(tmp_path, axes="{zero.stage: [1]}")
    jobs = FakeJobs(monkeypatch)
    _machine(monkeypatch, memory_available=64 * 2**20)
    messages = []
    assert bench_study(study, recipe, tmp_path / "out", log=messages.append) == 0
    (row,) = Store(tmp_path / "out" / "results.db").rows()
    assert jobs.launched == [] and row.status == "rejected"
    assert row.reason.startswith("does not fit this machine: [FIT2]") and "available RAM" in row.reason
    assert any("rejected (does not fit this machine" in m for m in messages)

    gpu_study = dataclasses.replace(study, device="cuda", name="s-gpu")
    _machine(monkeypatch, memory_available=64 * 2**30)
    assert bench_study(gpu_study, recipe, tmp_path / "out", log=lambda _: None) == 0
    gpu_row = next(r for r in Store(tmp_path / "out" / "results.db").rows() if r.study == "s-gpu")
    assert jobs.launched == [] and "[FIT1]" in gpu_row.reason

    _machine(monkeypatch, memory_available=64 * 2**20)
    assert bench_study(study, recipe, tmp_path / "out", check_fit=False, log=lambda _: None) == 0
    assert len(jobs.launched) == 1  # the rejected row is checked again, and this time it runs


def test_a_rerun_says_what_it_kept(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path, axes="{zero.stage: [1, 2]}")
    jobs = FakeJobs(monkeypatch)
    assert bench_study(study, recipe, tmp_path / "out", log=lambda _: None) == 0
    messages = []
    assert bench_study(study, recipe, tmp_path / "out", log=messages.append) == 0
    assert len(jobs.launched) == 2  # the first run's two cells only
    assert messages[-1] == ("study s: 2 cell repeat(s) already had a result and were not run "
                            "again (--retry-failed runs the failed ones again)")


def test_bench_takes_skip_fit_check(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_run, "bench_study", lambda *a, **k: seen.update(k) or 0)
    path, _, _ = _study(tmp_path, axes="{zero.stage: [1]}")
    result = CliRunner().invoke(main, ["bench", str(path), "--out", str(tmp_path / "o"),
                                       "--skip-fit-check"])
    assert result.exit_code == 0, result.output
    assert seen["check_fit"] is False


def test_a_cell_still_invalid_keeps_its_row(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path, axes="{train.global_batch: [7]}")
    FakeJobs(monkeypatch)
    db = tmp_path / "out" / "results.db"
    lines = []
    bench_study(study, recipe, tmp_path / "out", log=lines.append)
    (first,) = Store(db).rows()
    bench_study(study, recipe, tmp_path / "out", log=lines.append)
    (again,) = Store(db).rows()
    assert again == first and sum("rejected" in line for line in lines) == 1


# Item 9: a locked database waits a bounded time; no finished result is lost.

def _hold_write_lock(db):
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    return other


def test_a_write_waits_for_a_lock_that_is_released(tmp_path):
    store = Store(tmp_path / "r.db", timeout_s=10)
    other = _hold_write_lock(tmp_path / "r.db")
    threading.Timer(0.5, other.rollback).start()
    store.write(Row(study="s", cell="c", repeat=0, axes={}, status="ok"))
    assert store.status("s", "c", 0) == "ok"


def test_a_locked_database_keeps_the_result_in_the_cell_and_imports_it(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path, axes="{zero.stage: [0, 1]}")
    jobs = FakeJobs(monkeypatch)
    out = tmp_path / "out"
    Store(out / "results.db").close()
    other = _hold_write_lock(out / "results.db")
    lines = []
    started = time.monotonic()
    assert bench_study(study, recipe, out, db_timeout=0.5, log=lines.append) == 75
    assert time.monotonic() - started < 10  # bounded, not forever
    assert lines[-2] == (f"dsforge bench: waiting for the lock on {out / 'results.db'}: another "
                         "process holds it; waiting up to 0.5s for it to go")
    assert "lock for more than 0.5s" in lines[-1] and "imported when the study runs again" in lines[-1]
    # A refusal's form: where and its value, what, Fix: (75, not 2: nothing is lost).
    assert lines[-1].startswith(f"dsforge bench: OUT/results.db='{out / 'results.db'}': ")
    assert lines[-1].endswith("again. Fix: run the study again once the other process lets go of "
                              f"it (fuser -v {out / 'results.db'} lists who has it open), or "
                              "give a longer --db-timeout")
    saved = cell_dir(out, expand(study, base=study_identity(study, recipe))[0], 0).bench_result
    assert json.loads(saved.read_text())["status"] == "crashed"
    other.rollback()
    other.close()
    assert bench_study(study, recipe, out, log=lines.append) == 0
    assert any("imported from" in line and str(saved) in line for line in lines)
    assert len(jobs.launched) == 2  # the saved cell was imported, not measured again
    assert sorted(s for _, _, s in _rows(out / "results.db")) == ["crashed", "crashed"]


# Issue 25 item 4: a database another process holds is waited for as long as the study's cells
# may run (or --db-timeout), with a line saying so every WAIT_NOTICE_S, and written when it goes.

HOLD_LOCK = """import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
db.rollback()
"""


@pytest.fixture
def hold_lock():
    """hold_lock(db, seconds): another process holds `db`'s lock (BEGIN EXCLUSIVE) for
    `seconds` from now; it is ended by its pid when the test ends."""
    held = []

    def start(db, seconds):
        Store(db).close()  # a results database in WAL mode, as dsforge bench makes it
        child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(db), str(seconds)],
                                 stdout=subprocess.PIPE, text=True)
        held.append(child)
        assert child.stdout.readline() == "held\n"
        return time.monotonic()

    yield start
    for child in held:
        child.kill()
        child.wait()
        child.stdout.close()


def test_a_write_waits_for_another_process_and_says_so(tmp_path, monkeypatch, hold_lock):
    monkeypatch.setattr(bench_store, "WAIT_NOTICE_S", 0.5)
    db, lines = tmp_path / "r.db", []
    store = Store(db, timeout_s=10, waiting=lines.append)
    held = hold_lock(db, 2)
    store.write(Row(study="s", cell="c", repeat=0, axes={}, status="ok"))
    waited = time.monotonic() - held
    assert 1.5 < waited < 10 and store.status("s", "c", 0) == "ok"
    assert lines[0] == (f"waiting for the lock on {db}: another process holds it; waiting up to "
                        "10s for it to go")
    still = lines[1:-1]
    assert len(still) >= 2 and all(line.startswith(f"still waiting for the lock on {db}: ") and
                                   line.endswith("s of up to 10s") for line in still)
    assert lines[-1].startswith(f"the lock on {db} went after ")
    assert lines[-1].endswith("; going on")
    store.close()


def test_bench_waits_for_the_lock_as_long_as_db_timeout_and_writes_the_rows(
        tmp_path, monkeypatch, hold_lock):
    path, study, recipe = _study(tmp_path, axes="{zero.stage: [0, 1]}")
    jobs = FakeJobs(monkeypatch)
    out = tmp_path / "out"
    held = hold_lock(out / "results.db", 2)
    result = CliRunner().invoke(main, ["bench", str(path), "--out", str(out), "--db-timeout", "10"])
    assert result.exit_code == 0, result.output
    assert time.monotonic() - held > 1.5  # it waited, and did not give up
    assert f"dsforge bench: waiting for the lock on {out / 'results.db'}: another process holds " \
           "it; waiting up to 10s for it to go" in result.output
    assert f"dsforge bench: the lock on {out / 'results.db'} went after " in result.output
    assert len(jobs.launched) == 2
    assert sorted(s for _, _, s in _rows(out / "results.db")) == ["crashed", "crashed"]


def test_bench_waits_as_long_as_the_study_cells_may_run_by_default(tmp_path, monkeypatch,
                                                                    hold_lock):
    """The default wait is measure.timeout_s x cells x repeats (here 0.5 x 2 x 1 s), not a fixed
    60 s; past it the study stops with 75 and its results kept in the cell folders."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_TEXT)
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nrecipe: {recipe}\nworld_size: 2\nset: {{parallel.dp: 2}}\n"
                    "axes: {zero.stage: [0, 1]}\n"
                    "measure: {warmup_steps: 1, steps: 2, repeats: 1, timeout_s: 0.5}\n")
    study, _ = load_study(path)
    FakeJobs(monkeypatch)
    out = tmp_path / "out"
    hold_lock(out / "results.db", 60)
    lines = []
    started = time.monotonic()
    assert bench_study(study, recipe, out, log=lines.append) == 75
    assert time.monotonic() - started < 10
    assert "waiting up to 1s for it to go" in lines[-2] and "more than 1s" in lines[-1]
    cell = expand(study, base=study_identity(study, recipe))[0]
    assert json.loads(cell_dir(out, cell, 0).bench_result.read_text())["status"] == "crashed"
    assert bench_run.db_timeout_s(study) == 1.0


def test_a_saved_result_newer_than_its_row_replaces_it(tmp_path, monkeypatch):
    """A retry whose row was lost (db locked) is imported even though an older row exists."""
    path, study, recipe = _study(tmp_path, axes="{zero.stage: [1]}")
    FakeJobs(monkeypatch)
    out = tmp_path / "out"
    bench_study(study, recipe, out, log=lambda _: None)
    cell = expand(study, base=study_identity(study, recipe))[0]
    saved = cell_dir(out, cell, 0).bench_result
    newer = json.loads(saved.read_text()) | {"status": "ok", "reason": None,
                                              "finished": time.time() + 1}
    saved.write_text(json.dumps(newer))
    bench_study(study, recipe, out, log=lambda _: None)
    assert _rows(out / "results.db") == [(cell.key, 0, "ok")]


# Item 11: a killed rank is oom; reasons carry no progress bars.

@pytest.mark.parametrize("code", [-9, 137, 247])
def test_a_rank_killed_by_sigkill_is_oom(tmp_path, code):
    run_dir = RunDir(tmp_path)
    status, reason = classify(code, run_dir)
    assert status == "oom" and "killed by SIGKILL" in reason
    # Its peers may record the broken connection; the kill is still the cause.
    failure.write(run_dir, failure.Failure(rank=1, step=3, kind="exception",
                                           message="RuntimeError: Connection closed by peer"))
    assert classify(code, run_dir)[0] == "oom"


@pytest.mark.parametrize("message, code, expected", [
    ("killed by SIGKILL (out of memory? the kernel's OOM killer sends SIGKILL)", 247, "oom"),
    ("killed by SIGSEGV", 245, "crashed"),
])
def test_a_rank_its_supervisor_saw_killed(tmp_path, message, code, expected):
    """runtime/guard/supervise.py records a rank that died of a signal as kind 'killed'."""
    run_dir = RunDir(tmp_path)
    failure.write(run_dir, failure.Failure(rank=1, step=3, kind="killed", message=message))
    assert classify(code, run_dir) == (expected, f"rank 1 died at step 4: {message}")


def test_a_reason_never_holds_progress_bars_or_escapes(tmp_path):
    bar = "\rTraining:  40%|####      | 4/10 [00:01<00:02,  3.10it/s]"
    run_dir = RunDir(tmp_path)
    failure.write(run_dir, failure.Failure(
        rank=1, step=2, kind="exception", message=f"{bar}\x1b[31mRuntimeError: boom\x1b[0m{bar}\nnext"))
    status, reason = classify(1, run_dir)
    assert (status, reason) == ("crashed", "rank 1 failed at step 3: RuntimeError: boom next")
    assert one_line("x" * 900).endswith("...") and len(one_line("x" * 900)) == 500


# Item 13: a corrupted database or an unwritable --out is a clear exit 2 naming the path.

def test_a_corrupted_database_is_an_error_naming_it(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path)
    FakeJobs(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.db").write_bytes(b"this is not sqlite" * 100)
    lines = []
    assert bench_study(study, recipe, out, log=lines.append) == 2
    assert str(out / "results.db") in lines[-1] and "not a usable results database" in lines[-1]
    result = CliRunner().invoke(main, ["report", str(out / "results.db")])
    assert result.exit_code == 2 and str(out / "results.db") in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_an_unwritable_out_is_an_error_naming_it(tmp_path, monkeypatch):
    path, study, recipe = _study(tmp_path)
    FakeJobs(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be\n")
    result = CliRunner().invoke(main, ["bench", str(path), "--out", str(blocker / "out")])
    assert result.exit_code == 2 and str(blocker / "out") in result.output, result.output
    store = Store(tmp_path / "r.db")
    store.write(Row(study="s", cell="c", repeat=0, axes={"a": 1}, status="crashed", reason="x"))
    store.close()
    result = CliRunner().invoke(main, ["report", str(tmp_path / "r.db"), "--out", str(blocker / "rep")])
    assert result.exit_code == 2 and "cannot write the report" in result.output, result.output
    assert str(blocker / "rep") in result.output


def test_the_report_shows_the_cells_of_the_current_base_recipe(tmp_path):
    """Rows of an edited recipe's earlier cells stay in the database; the report shows, for
    each combination of axes, the cell measured last."""
    store = Store(tmp_path / "r.db")
    store.write(Row(study="s", cell="old", repeat=0, axes={"zero.stage": 1}, status="crashed",
                    reason="the old recipe", finished=100.0))
    store.write(Row(study="s", cell="new", repeat=0, axes={"zero.stage": 1}, status="oom",
                    reason="the new recipe", finished=200.0))
    store.close()
    report = write_report(tmp_path / "r.db", tmp_path / "out").read_text()
    assert "the new recipe" in report and "the old recipe" not in report
    assert "1 earlier cell(s) of s, measured for an earlier version of its base recipe" in report
