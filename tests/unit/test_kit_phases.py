"""tools/kit_phases.py: the GPU kit's measured runs read back and set against the planner."""

from __future__ import annotations

import pytest

from tests.conftest import load_tool


@pytest.fixture(scope="module")
def kit_phases():
    return load_tool("kit_phases")


def test_every_run_of_the_h200_session_is_read_with_its_phases(kit_phases):
    runs = [r for r in kit_phases.kit_runs() if r.folder == "2026-11-26-h200"]
    labels = {r.label for r in runs}
    assert len(runs) == 14 and {"7b-shipped", "1b-none-mb2", "zero-1b zero.stage=3"} <= labels
    for run in runs:
        assert run.device == "NVIDIA H200" and set(kit_phases.PHASES) <= set(run.phases)
        assert sum(run.phases[p] for p in kit_phases.PHASES) < run.step_s


def test_the_predicted_phases_add_up_to_the_predicted_step(kit_phases):
    run = next(r for r in kit_phases.kit_runs() if r.label == "1b-full-mb2")
    total, phases = kit_phases.predicted_phases(run)
    # one GPU: no communication, so the step is compute and the optimizer
    assert sum(phases.values()) == pytest.approx(total)
    assert phases["recompute"] == pytest.approx(phases["forward"])  # full: the forward again


def test_the_refit_leaves_each_dense_run_out_and_the_moe_out_of_the_fit(kit_phases):
    """The refit is dsforge's own (cost/fit.py, tested in test_calibrate.py)."""
    runs = kit_phases.kit_runs()
    calibration = kit_phases.calibration(runs)
    labels = [row.label for row in calibration.rows]
    assert "moe-8l" in [r.label for r in runs] and "moe-8l" not in labels
    moe_runs = sum(r.label == "moe-8l" for r in runs)  # one per session that ran it
    assert len(labels) == len(runs) - moe_runs and all(row.left_out_s for row in calibration.rows)
    assert calibration.after.measured_runs == len(labels)


def test_the_shipped_host_floors_are_the_refit_of_the_kits_runs(kit_phases):
    """dsforge/cost/profile.py's floors for the H200 and the H100 are what --measure's refit
    gives the kit's dense runs of that GPU in the default profile's form (one compute
    efficiency, no `other` term) to 0.01 ms, with the compute's scale within 1% of the
    default's, so the shipped efficiencies stand beside them."""
    from dsforge.cost.profile import default_profile
    from dsforge.hardware import gpu_for_device_name

    runs = kit_phases.kit_runs()
    for device in {r.device for r in runs}:
        c = kit_phases.default_form_fit([r for r in runs if r.device == device])
        shipped = default_profile(gpu_for_device_name(device).key)
        assert c["host"] == pytest.approx(shipped.host_layer_s, abs=1e-5)
        assert c["host_zero3"] == pytest.approx(shipped.host_layer_zero3_s, abs=1e-5)
        assert c["compute"] == pytest.approx(1.0, abs=0.01)
        dense = kit_phases.dense_points([r for r in runs if r.device == device])
        assert shipped.measured_on.startswith(f"the GPU kit's {len(dense)} dense runs "
                                              f"on one {device}")
    assert default_profile("a100").measured_on == ""  # never measured: the search says so
