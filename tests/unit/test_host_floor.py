"""tools/host_floor.py: the host-floor fit recovers a floor it was given, and reads the kit."""

from __future__ import annotations

import pytest

from tests.conftest import load_tool


@pytest.fixture(scope="module")
def host_floor():
    return load_tool("host_floor")


def test_the_floor_charges_only_the_host_bound_layers(host_floor):
    p = host_floor.Point("p", 1.0, total_s=1.0, compute_s=0.8, layers=100, pass_s=0.002,
                         zero3=False)
    assert host_floor.predict(p, 1.0, 0.001, 0.0) == 1.0  # the device is slower: no charge
    assert host_floor.predict(p, 1.0, 0.003, 0.0) == pytest.approx(1.1)  # 1 ms x 100 layers
    assert host_floor.predict(p, 1.0, 0.0, 0.009) == 1.0  # the ZeRO-3 floor is not this run's
    assert host_floor.predict(p, 0.5, 0.0, 0.0) == pytest.approx(0.6)  # half the compute


def test_the_fit_recovers_the_floors_and_the_compute_it_was_given(host_floor):
    true = (0.9, 0.003, 0.008)
    shapes = [(pass_s, zero3) for pass_s in (0.001, 0.002, 0.004, 0.006, 0.012)
              for zero3 in (False, True)]
    points = []
    for i, (pass_s, zero3) in enumerate(shapes):
        p = host_floor.Point(f"p{i}", 0.0, total_s=2.0, compute_s=1.5, layers=128, pass_s=pass_s,
                             zero3=zero3)
        points.append(host_floor.Point(p.label, host_floor.predict(p, *true), p.total_s,
                                       p.compute_s, p.layers, p.pass_s, p.zero3))
    assert host_floor.fit(points) == pytest.approx(true)


def test_every_dense_kit_run_becomes_a_point(host_floor):
    runs = [r for r in host_floor.kit_runs()
            if host_floor._resolved(r.recipe).recipe.model.moe is None]
    points = [host_floor.point(r) for r in runs]
    assert len(points) >= 37 and all(0 < p.pass_s < p.total_s for p in points)
    assert any(p.zero3 for p in points) and not all(p.zero3 for p in points)
