"""Bench pieces without jobs: study loading and expansion, the store, classification, report."""

from __future__ import annotations

import pytest

from dsforge.bench.report import write_report
from dsforge.bench.run import classify, run_cell
from dsforge.runtime import failure
from dsforge.bench.store import Row, Store
from dsforge.bench.study import expand, load_study
from dsforge.problems import RecipeError
from tests.conftest import REPO

STUDIES = sorted((REPO / "recipes" / "bench").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_shipped_studies_load_and_their_cells_validate(path):
    from dsforge.bench.run import _resolve_cell

    study, recipe = load_study(path)
    cells = expand(study)
    assert len(cells) == __import__("math").prod(len(v) for v in study.axes.values())
    for cell in cells:
        _resolve_cell(study, recipe, cell)  # every shipped cell is valid at its declared size


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
    (tmp_path / "job.log").write_text("RuntimeError: out of memory (printed text is not read)\n")
    if record is not None:
        failure.write(tmp_path, failure.Failure(rank=1, step=2, **record))
    status, reason = classify(code, tmp_path)
    assert status == expected
    if record is not None:
        assert reason.startswith("rank 1 ") and record["message"] in reason


def test_the_earliest_failure_record_is_the_cause(tmp_path):
    failure.write(tmp_path, failure.Failure(rank=0, step=2, kind="exception", message="peer gone",
                                            time=200.0))
    failure.write(tmp_path, failure.Failure(rank=3, step=2, kind="hang", message="stuck", time=100.0))
    (failure.directory(tmp_path) / "rank00009.partial").write_text("{half")  # never read
    assert classify(1, tmp_path) == ("timeout", "rank 3 stuck at step 2: stuck")


def test_report_lists_every_cell_with_predictions_and_plots(tmp_path):
    store = Store(tmp_path / "r.db")
    split = {"params": 2**28, "grads": 2**28, "optimizer": 2**29, "activations": 2**29, "buffers": 2**29}
    prediction = {"memory_bytes": {**split, "total": 2 * 1024**3}, "bubble_share_of_step": 0.2,
                  "flops_per_token": 1e9, "hardware_flops_per_token": 1.2e9}
    figures = {"step_times_s": [1.0, 1.2], "tokens_per_s": 1000.0, "tokens_per_s_per_gpu": 500.0,
               "mfu": None, "hfu": None, "final_loss": 2.0, "peak_memory_bytes": 3 * 1024**3,
               "memory_source": "cuda max_memory_allocated", "bubble_share_by_stage": {"0": 0.25, "1": 0.3}}
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
    assert "| 1 | 256.00 | 256.00 | 512.00 | 512.00 | 512.00 | 2,048.00 | 3,072.0 |" in report
    assert (tmp_path / "out" / "s.png").stat().st_size > 1000
    overridden = write_report(tmp_path / "r.db", tmp_path / "o2", peak_tflops=100).read_text()
    assert "| 0.5% | 0.6% |" in overridden  # 500 tok/s x 1e9 / 1e14
