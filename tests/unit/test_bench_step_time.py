"""Issue 23: `dsforge bench` stores the planner's step time with each cell (bench/run.py
`step_time_prediction`, the model cost/step_time.py `predicted_step_time`) and `dsforge
report` puts it against the measured median step, a table and a plot (`step_time_points`, what
the plot draws). CPU cells store no step time and say why; rows stored before bench stored one
still report, saying it was not stored. The GPU numbers are the H200 ZeRO study's
(benchmarks/gpu/results/2026-11-26-h200/1-essential/bench/zero-1b: its 1B recipe names
cluster.gpu h100, and it ran on an H200)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsforge.bench import report
from dsforge.bench import run as bench_run
from dsforge.bench.report import NOT_STORED, aggregate, step_time_points, write_report
from dsforge.bench.run import bench_study, prediction, step_time_prediction
from dsforge.bench.store import Row, Store
from dsforge.bench.study import load_study
from dsforge.cost.profile import default_profile
from dsforge.cost.step_time import predicted_step_time
from dsforge.cost.step_time import step_time
from dsforge.job.run_dir import RunDir
from dsforge.recipe import resolve_file
from tests.conftest import REPO

H200 = {"type": "cuda", "name": "NVIDIA H200", "count_per_node": 1}
KIT_1B = REPO / "benchmarks" / "gpu" / "recipes" / "1b_1gpu.yaml"


@pytest.fixture(scope="module")
def kit_1b():
    """The H200 ZeRO study's ZeRO-1 cell (its recipe names cluster.gpu h100)."""
    return resolve_file(KIT_1B, ("train.activation_checkpointing=full", "train.micro_batch=2",
                                 "zero.stage=1"), world_size=1)


def test_a_gpu_cell_stores_the_step_time_of_the_gpu_it_ran_on(kit_1b):
    assert kit_1b.recipe.cluster.gpu == "h100"
    stored = step_time_prediction(kit_1b, device="cuda", manifest={"device": H200},
                                  model=predicted_step_time)
    expected = step_time(kit_1b, default_profile("h200", 1))
    assert stored["step_time_terms"] == expected.to_dict()
    assert stored["step_time_s"] == pytest.approx(expected.total)
    profile = stored["step_time_profile"]
    assert (profile["gpu"], profile["gpus_per_node"], profile["profile"]) == ("h200", 1, "default")
    assert profile["source"] == "the device the cell ran on (NVIDIA H200); the recipe's cluster.gpu is h100"
    # the rest of the prediction is unchanged, the step time added to it
    merged = prediction(kit_1b, stored)
    assert merged["step_time_s"] == stored["step_time_s"]
    assert merged["memory_bytes"] == prediction(kit_1b)["memory_bytes"]


def test_without_a_known_device_the_recipes_gpu_is_the_profile(kit_1b):
    for manifest in (None, {"device": {"type": "cuda", "name": "Some Future GPU"}}):
        stored = step_time_prediction(kit_1b, device="auto", manifest=manifest,
                                      model=predicted_step_time)
        assert stored["step_time_profile"]["gpu"] == "h100"
        assert stored["step_time_s"] == pytest.approx(step_time(kit_1b, default_profile("h100", 1)).total)
    assert "Some Future GPU is not in dsforge/hardware.py" in stored["step_time_profile"]["source"]
    unnamed = dataclasses.replace(kit_1b, recipe=dataclasses.replace(kit_1b.recipe, cluster=None))
    stored = step_time_prediction(unnamed, device="cuda", manifest=None, model=predicted_step_time)
    assert stored == {"step_time_s": None, "step_time_why": "no GPU profile: no device was recorded "
                      "and the recipe names no cluster.gpu"}


@pytest.mark.parametrize("device, tiny, manifest, how", [
    ("cpu", False, {"device": {"type": "cpu", "name": "x86_64"}}, "the study's device: cpu"),
    ("auto", True, None, "--tiny"),
    ("auto", False, {"device": {"type": "cpu", "name": "x86_64"}}, "no GPU was found"),
])
def test_a_cpu_cell_stores_no_step_time_and_why(kit_1b, device, tiny, manifest, how):
    calls = []
    stored = step_time_prediction(kit_1b, device=device, tiny=tiny, manifest=manifest,
                                  model=lambda *args: calls.append(args))
    assert stored == {"step_time_s": None, "step_time_why": f"the cell ran on CPU ({how}): the "
                      "step-time model has GPU profiles only (dsforge/cost/profile.py), so there "
                      "is no CPU prediction"}
    assert not calls  # no CPU figure is made up


# --- through the bench: a stand-in launcher, the row it stores ------------------------------

def _study(tmp_path, device: str):
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nrecipe: {REPO / 'recipes' / 'tiny.yaml'}\nworld_size: 2\n"
                    f"device: {device}\nset: {{parallel.dp: 2, cluster: {{gpus_per_node: 2, gpu: a100}}}}\n"
                    "axes: {zero.stage: [1]}\nmeasure: {warmup_steps: 1, steps: 2}\n")
    return load_study(path)


def _launcher(manifest: dict | None):
    """A job that writes the manifest a rank would, then fails (the row is stored all the same)."""
    def launch(study, resolved, run_dir: RunDir, device):
        if manifest is not None:
            run_dir.manifest.write_text(json.dumps(manifest))
        return 3
    return launch


@pytest.mark.parametrize("device, tiny, manifest, expected", [
    ("cuda", False, {"device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}}, "h100"),
    ("cuda", False, None, "a100"),  # no manifest: the recipe's cluster.gpu
    ("cpu", False, {"device": {"type": "cpu", "name": "x86_64"}}, None),
    ("cuda", True, {"device": {"type": "cpu", "name": "x86_64"}}, None),
])
def test_each_cell_row_carries_the_prediction(tmp_path, monkeypatch, device, tiny, manifest, expected):
    study, recipe = _study(tmp_path, device)
    monkeypatch.setattr(bench_run, "launch_cell", _launcher(manifest))
    # A machine the study's two ranks fit (the fit check runs before each cell's job).
    gpu = {"name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * 2**30, "memory_free": 79 * 2**30}
    monkeypatch.setattr(bench_run, "probe", lambda: {"cpus": 2, "memory_available": 64 * 2**30,
                                                      "gpus": [gpu, gpu]})
    assert bench_study(study, recipe, tmp_path / "out", tiny=tiny, log=lambda _: None,
                       step_time_model=predicted_step_time) == 0
    (row,) = Store(tmp_path / "out" / "results.db").rows()
    if expected is None:
        assert row.prediction["step_time_s"] is None
        assert row.prediction["step_time_why"].startswith("the cell ran on CPU")
    else:
        assert row.prediction["step_time_profile"]["gpu"] == expected
        assert row.prediction["step_time_profile"]["gpus_per_node"] == 2
        assert row.prediction["step_time_s"] > 0
    assert row.prediction["memory_bytes"]["total"] > 0  # and what it stored before


def test_dsforge_bench_stores_the_planners_step_time_by_default():
    """bench sits above the cost model (dsforge/cost/): it asks it itself, no callback."""
    import inspect

    for function in (bench_run.bench_study, bench_run.step_time_prediction):
        parameters = inspect.signature(function).parameters
        name = "step_time_model" if "step_time_model" in parameters else "model"
        assert parameters[name].default is predicted_step_time


# --- the report -----------------------------------------------------------------------------

def _figures(step_times: list[float]) -> dict:
    return {"step_times_s": step_times, "tokens_per_s": 1000.0, "tokens_per_s_per_gpu": 1000.0,
            "mfu": None, "hfu": None, "final_loss": 2.0, "peak_memory_bytes": 2**30,
            "memory_source": "cuda max_memory_allocated", "bubble_share_by_stage": {}}


def _prediction(**step) -> dict:
    return {"memory_bytes": {"params": 2**28, "total": 2**29}, "bubble_share_of_step": 0.0,
            "flops_per_token": 1e9, "hardware_flops_per_token": 1.2e9, **step}


TERMS = {"compute": 1.49, "tp_comm": 0.0, "ep_comm": 0.0, "bubble": 0.0, "pp_comm": 0.0,
         "dp_comm": 0.0, "optimizer": 0.036, "total": 1.526}
PREDICTED = dict(step_time_s=1.526, step_time_terms=TERMS,
                 step_time_profile={"gpu": "h200", "gpus_per_node": 1, "profile": "default",
                                    "source": "the device the cell ran on (NVIDIA H200)"})
CPU_WHY = ("the cell ran on CPU (the study's device: cpu): the step-time model has GPU profiles "
           "only (dsforge/cost/profile.py), so there is no CPU prediction")


def _row(stage: int, prediction: dict | None, step_times=(1.52, 1.54), status="ok") -> Row:
    return Row(study="s", cell=f"z{stage}", repeat=0, axes={"zero.stage": stage}, status=status,
               figures=_figures(list(step_times)) if status == "ok" else None,
               prediction=prediction, manifest={"device": H200})


def _report(tmp_path, rows: list[Row]) -> str:
    store = Store(tmp_path / "r.db")
    for row in rows:
        store.write(row)
    store.close()
    return write_report(tmp_path / "r.db", tmp_path / "out").read_text()


def test_a_cell_with_a_prediction_shows_its_error_and_a_plot(tmp_path):
    rows = [_row(1, _prediction(**PREDICTED)),
            _row(3, _prediction(**PREDICTED), step_times=(2.40, 2.59)),
            _row(2, _prediction(**PREDICTED), status="crashed")]
    text = _report(tmp_path, rows)
    # 1.526 / 1.53 - 1 = -0.26%; 1.526 / 2.495 - 1 = -38.8%
    assert "| zero.stage | status | profile | predicted s | measured s (median) | error | model's terms s |" in text
    assert "| 1 | ok | h200 | 1.526 | 1.530 | -0.3% | compute 1.490, optimizer 0.03600 |" in text
    assert "| 3 | ok | h200 | 1.526 | 2.495 | -38.8% | compute 1.490, optimizer 0.03600 |" in text
    assert "| 2 | crashed | h200 | 1.526 | - | - | compute 1.490, optimizer 0.03600 |" in text
    assert "Median |error| over 2 measured cell(s): 19.5%." in text
    assert "![s-step-time](s-step-time.png)" in text
    assert (tmp_path / "out" / "s-step-time.png").stat().st_size > 1000
    points = step_time_points(aggregate(rows))
    assert [(p.label, p.predicted_s, p.measured_s, p.gpu) for p in points] == [
        ("zero.stage=1", 1.526, pytest.approx(1.53), "h200"),
        ("zero.stage=3", 1.526, pytest.approx(2.495), "h200")]
    assert [round(p.error, 4) for p in points] == [-0.0026, -0.3884]


def test_a_cpu_cell_has_no_prediction_and_the_report_says_why(tmp_path):
    rows = [_row(1, _prediction(step_time_s=None, step_time_why=CPU_WHY))]
    text = _report(tmp_path, rows)
    assert f"No step-time prediction for any cell: {CPU_WHY}." in text
    assert "| predicted s |" not in text  # no table of dashes
    assert step_time_points(aggregate(rows)) == ()
    assert not (tmp_path / "out" / "s-step-time.png").exists()  # no plot without a prediction
    assert (tmp_path / "out" / "s.png").exists()


def test_rows_stored_before_bench_stored_the_step_time_still_report(tmp_path):
    old = _prediction()  # what bench stored until now: no step-time keys at all
    rows = [_row(0, old), _row(1, _prediction(**PREDICTED)),
            _row(2, _prediction(step_time_s=None, step_time_why=CPU_WHY))]
    text = _report(tmp_path, rows)
    assert f"No step-time prediction for zero.stage=0: {NOT_STORED}." in text
    assert f"No step-time prediction for zero.stage=2: {CPU_WHY}." in text
    assert "| 1 | ok | h200 | 1.526 | 1.530 | -0.3% |" in text
    assert "| 0 | ok | 1,000 | 1,000 | 1530.0 [1520.0-1540.0] |" in text  # the main table as before
    only_old = _report(tmp_path / "old", [_row(0, old), _row(1, old), _row(2, None, status="rejected")])
    assert f"No step-time prediction for any cell: {NOT_STORED}." in only_old
    assert not (tmp_path / "old" / "out" / "s-step-time.png").exists()


def test_the_step_time_plot_draws_its_points_the_diagonal_and_the_labels():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [_row(0, _prediction(**PREDICTED), step_times=(1.53,)),
            _row(1, _prediction(**PREDICTED), step_times=(1.518,)),
            _row(3, _prediction(**PREDICTED), step_times=(2.495,))]
    points = step_time_points(aggregate(rows))
    fig = report.draw_step_time("s", points, plt)
    try:
        (axis,) = fig.axes
        (cells,) = [c for c in axis.collections if c.get_gid() == "cells"]
        assert [tuple(xy) for xy in cells.get_offsets()] == [
            (pytest.approx(p.predicted_s), pytest.approx(p.measured_s)) for p in points]
        (diagonal,) = [line for line in axis.lines if line.get_gid() == "diagonal"]
        xs, ys = diagonal.get_data()
        assert list(xs) == list(ys)  # predicted = measured
        assert xs[0] <= min(p.predicted_s for p in points) and xs[-1] >= max(p.measured_s for p in points)
        labels = sorted(t.get_text() for t in axis.texts)
        assert labels == ["zero.stage=0 (-0.3%)", "zero.stage=1 (+0.5%)", "zero.stage=3 (-38.8%)"]
        # labels of points close together are stacked apart
        heights = sorted(t.get_position()[1] for t in axis.texts)
        assert min(b - a for a, b in zip(heights, heights[1:])) > 0.04 * (xs[-1] - xs[0])
        assert axis.get_xlabel().startswith("predicted") and axis.get_ylabel().startswith("measured")
    finally:
        plt.close(fig)
