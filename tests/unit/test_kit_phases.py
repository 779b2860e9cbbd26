"""tools/kit_phases.py: the GPU kit's measured runs read back and set against the planner."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def kit_phases():
    spec = importlib.util.spec_from_file_location("kit_phases", REPO / "tools" / "kit_phases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


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


def test_the_refit_recovers_terms_it_was_made_from(kit_phases):
    terms = kit_phases.Terms(scale=0.9, floor_s=0.002, gather_s=0.003)
    xs = [{"compute": c, "optimizer": 0.04, "forward": f, "microbatches": m, "layers": 16,
           "gathers": g} for c, f, m, g in ((1.2, 0.02, 16, 0), (1.1, 0.045, 8, 0),
                                            (1.5, 0.045, 8, 256), (2.9, 0.11, 8, 0))]
    steps = [kit_phases.refitted(terms, x) for x in xs]
    fitted = kit_phases.fit(xs, steps)
    assert fitted.scale == pytest.approx(0.9, abs=0.003)
    assert fitted.floor_s == pytest.approx(0.002, abs=1e-4)
    assert fitted.gather_s == pytest.approx(0.003, rel=0.05)
