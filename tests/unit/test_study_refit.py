"""`dsforge refit RESULTS.db --out PROFILE.yaml` (dsforge/calibrate/refit.py): the planner's
profile refitted from bench cells, which cells it reads, and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from dsforge.bench.store import Row, Store
from dsforge.calibrate.refit import read_cells
from dsforge.cli import main
from dsforge.cost import fit as cal
from dsforge.cost.profile import default_profile, load_profile
from dsforge.cost.step_time import step_time
from dsforge.recipe import resolve_file
from dsforge.recipe.loader import dump_recipe
from tests.conftest import REPO

ONE_B = REPO / "benchmarks" / "gpu" / "recipes" / "1b_1gpu.yaml"  # cluster: 1 x h100
CPU = {"type": "cpu", "name": "cpu"}
H200 = {"type": "cuda", "name": "NVIDIA H200"}
# The CPU's additive costs, as test_calibrate's machine: compute 20% slower, 3 ms a
# microbatch and layer, 2.5 ms a ZeRO-3 gather.
TRUE = {"compute": 1.2, "fixed": 0.003, "gathers": 0.0025, "optimizer": 1.0, "communication": 1.0}
FINISHED = 1795651200.0  # 2026-11-26 00:00 UTC
LAYOUTS = [("train.micro_batch=1",), ("train.micro_batch=2",), ("train.micro_batch=4",),
           ("zero.stage=3", "train.micro_batch=2"), ("zero.stage=3", "train.micro_batch=4")]


def row_resolved(overrides):
    return resolve_file(ONE_B, list(overrides), world_size=1)


def _row(overrides, *, status="ok", device=CPU, profile=None, study="sweep", repeat=0) -> Row:
    resolved = row_resolved(overrides)
    axes = dict(o.split("=") for o in overrides)
    figures = None
    if status == "ok":
        truth = cal.apply(profile, TRUE)
        step = step_time(resolved, truth).total
        figures = {"step_times_s": [step * 0.99, step, step * 1.01], "breakdown_s": None}
    return Row(study=study, cell=" ".join(overrides), repeat=repeat, axes=axes, status=status,
               recipe=dump_recipe(resolved.recipe), manifest={"device": device}, figures=figures,
               finished=FINISHED)


def _cpu_profile():
    profile = default_profile("h100", gpus_per_node=1)  # the recipes' GPU; floors cleared on CPU
    return dataclasses.replace(profile, host_layer_s=0.0, host_layer_zero3_s=0.0)


def _store(path, rows):
    store = Store(path)
    for row in rows:
        store.write(row)
    store.close()
    return path


def _refit(*args):
    return CliRunner().invoke(main, ["refit", *map(str, args)])


def test_a_cpu_study_refits_the_profile_it_names(tmp_path):
    rows = [_row(o, profile=_cpu_profile()) for o in LAYOUTS]
    rows.append(_row(("train.micro_batch=8",), status="oom"))
    db = _store(tmp_path / "results.db", rows)
    out = tmp_path / "measured.yaml"
    result = _refit(db, "--out", out)
    assert result.exit_code == 0, result.output
    assert "not used: sweep train.micro_batch=8: no finished repeat (oom)" in result.output
    assert "refit on 5 measured trial(s)" in result.output
    written = load_profile(out, None, None)
    assert written.gpu.key == "h100" and written.measured_runs == 5
    assert written.compute_efficiency == pytest.approx(_cpu_profile().compute_efficiency / 1.2, rel=1e-3)
    assert written.microbatch_layer_s == pytest.approx(0.003, rel=1e-3)
    assert written.zero3_gather_layer_s == pytest.approx(0.0025, rel=1e-3)
    assert (written.host_layer_s, written.host_layer_zero3_s) == (0.0, 0.0)  # the CPU: none
    assert "Refitted by dsforge refit from bench cells" in out.read_text()


def test_gpu_cells_refit_the_gpu_they_ran_on_with_its_floors(tmp_path):
    """Cells that ran on an H200 refit the H200's profile (not the recipes' h100), floors
    and all: with its floors the H200's default predicts them, so nothing moves."""
    h200 = default_profile("h200", gpus_per_node=1)
    truth = {**TRUE, "compute": 1.0, "fixed": 0.0, "gathers": 0.0,
             "host": h200.host_layer_s, "host_zero3": h200.host_layer_zero3_s}
    rows = []
    for o in LAYOUTS:
        row = _row(o, device=H200, profile=h200)
        step = step_time(row_resolved(o), cal.apply(h200, truth)).total
        rows.append(dataclasses.replace(row, figures={"step_times_s": [step], "breakdown_s": None}))
    out = tmp_path / "h200.yaml"
    result = _refit(_store(tmp_path / "results.db", rows), "--out", out)
    assert result.exit_code == 0, result.output
    written = load_profile(out, None, None)
    assert written.gpu.key == "h200" and written.measured_on == "NVIDIA H200, 2026-11-26"
    assert written.compute_efficiency == pytest.approx(h200.compute_efficiency, rel=1e-3)
    assert written.host_layer_zero3_s == pytest.approx(h200.host_layer_zero3_s, abs=1e-4)


def test_only_the_named_study_and_its_current_cells_are_read():
    rows = [_row(o, profile=_cpu_profile()) for o in LAYOUTS[:3]]
    rows.append(_row(LAYOUTS[3], profile=_cpu_profile(), study="other"))
    assert len(read_cells(rows).used) == 4
    assert [c.label for c in read_cells(rows, "other").used] == ["other zero.stage=3 train.micro_batch=2"]


@pytest.mark.parametrize("case", ["nothing finished", "two devices", "unknown study"])
def test_what_cannot_be_refitted_is_refused_and_nothing_written(tmp_path, case):
    rows = {"nothing finished": [_row(o, status="crashed") for o in LAYOUTS[:2]],
            "two devices": [_row(LAYOUTS[0], profile=_cpu_profile()),
                            _row(LAYOUTS[1], device=H200, profile=_cpu_profile())],
            "unknown study": [_row(o, profile=_cpu_profile()) for o in LAYOUTS[:2]]}[case]
    out = tmp_path / "p.yaml"
    study = ["--study", "nope"] if case == "unknown study" else []
    result = _refit(_store(tmp_path / "results.db", rows), "--out", out, *study)
    assert result.exit_code == 2 and not out.exists()
    expected = {"nothing finished": "no finished cell in any study", "two devices": "2 kinds of device",
                "unknown study": "no finished cell in study 'nope'"}[case]
    assert "RESULTS=" in result.output and expected in result.output


def test_a_file_that_is_not_a_results_database_is_refused(tmp_path):
    bogus = tmp_path / "results.db"
    bogus.write_text("not sqlite")
    result = _refit(bogus, "--out", tmp_path / "p.yaml")
    assert result.exit_code == 2 and "RESULTS=" in result.output


def test_a_profile_given_is_the_one_refitted_for_the_gpu_it_names(tmp_path):
    db = _store(tmp_path / "results.db", [_row(o, profile=_cpu_profile()) for o in LAYOUTS])
    named, bare = tmp_path / "a100.yaml", tmp_path / "bare.yaml"
    named.write_text("gpu: a100\nintra_node_gbps: 100\n")
    bare.write_text("intra_node_gbps: 100\n")
    for given, gpu in ((named, "a100"), (bare, "h100")):  # else the recipes' cluster.gpu
        out = tmp_path / f"out-{gpu}.yaml"
        assert _refit(db, "--out", out, "--profile", given).exit_code == 0
        written = load_profile(out, None, None)
        assert written.gpu.key == gpu and written.intra_node_gbps == pytest.approx(100.0)


def test_the_gpu_trials_of_the_search_refit_here_as_they_did_on_the_gpu():
    """`dsforge plan --search --measure` on one H200 (benchmarks/gpu/results/2026-11-27-h200/
    2-search-measure): its three trials, read back from the committed results.db, refit to the
    profile the GPU wrote beside them (compute's efficiency and the band), on any machine."""
    from dsforge.calibrate.refit import refit_cells, starting_profile
    from dsforge.cost.profile import read_profile

    folder = REPO / "benchmarks" / "gpu" / "results" / "2026-11-27-h200" / "2-search-measure"
    store = Store(folder / "results.db")
    try:
        cells = read_cells(store.rows())
    finally:
        store.close()
    assert [c.device for c in cells.used] == ["NVIDIA H200"] * 3 and not cells.skipped
    result = refit_cells(cells, starting_profile(cells.used, None))
    on_the_gpu = read_profile(folder / "profile.yaml")
    assert result.after.compute_efficiency == pytest.approx(on_the_gpu.compute_efficiency, rel=1e-3)
    assert result.after.prediction_error == pytest.approx(on_the_gpu.prediction_error, rel=1e-2)
    assert result.after.measured_on == "NVIDIA H200, 2026-11-27"
