"""A host floor under each layer's forward, fitted to the GPU kit's dense runs (issue 23).

    python tools/host_floor.py

The model tried here, outside the package (benchmarks/search/README.md, "dsforge's own refit
as a default profile"): a layer's grad-enabled forward (the forward, or the recompute under
full checkpointing, whose first forward runs without autograd) takes the larger of the
device's time and the host's, h, one figure for ZeRO 0-2 and one for ZeRO-3 (its per-module
parameter fetches are host work). The step is the default profile's prediction with the
compute scaled by a, plus, for every microbatch and layer, max(0, h - the device's time of
that pass). a, h0 and h3 are fitted on a grid to the median relative error of one GPU type's
runs, and each run is predicted by a fit without it. On one GPU there is no communication,
so the compute's share of the step scales alone.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kit_phases import _resolved, kit_runs  # noqa: E402

from dsforge.estimate.flops import flops_per_token  # noqa: E402
from dsforge.hardware import gpu_for_device_name  # noqa: E402
from dsforge.search.cost import microbatch_layers, step_time  # noqa: E402
from dsforge.search.profile import default_profile  # noqa: E402

COMPUTE = np.arange(0.80, 1.101, 0.02)  # a: the default profile's compute time scaled
HOST_S = np.arange(0.0, 0.0105, 0.001)  # h0, h3: seconds a layer


@dataclass(frozen=True)
class Point:
    label: str
    measured_s: float
    total_s: float  # the default profile's prediction
    compute_s: float  # its compute term
    layers: float  # microbatches x layers of the step
    pass_s: float  # the device's time of one layer's grad-enabled forward, one microbatch
    zero3: bool


def point(run) -> Point:
    resolved = _resolved(run.recipe)
    recipe = resolved.recipe
    predicted = step_time(resolved, default_profile(gpu_for_device_name(run.device).key, 1))
    train = recipe.train
    flops = flops_per_token(recipe.model, train.seq_len, train.activation_checkpointing)
    layers = microbatch_layers(resolved)
    full = train.activation_checkpointing == "full"
    share = (flops.hardware - flops.model) if full else flops.model / 3  # recompute, or forward
    return Point(run.label, run.step_s, predicted.total, predicted.compute, layers,
                 predicted.compute * share / flops.hardware / layers, recipe.zero.stage == 3)


def predict(p: Point, a: float, h0: float, h3: float) -> float:
    h = h3 if p.zero3 else h0
    return p.total_s + (a - 1) * p.compute_s + p.layers * max(0.0, h - a * p.pass_s)


def fit(points: list[Point]) -> tuple[float, float, float]:
    """(a, h0, h3) with the smallest mean relative error; the first of equals (smaller h). A
    median would be degenerate: any floor that leaves half the runs exact would do."""
    def error(params):
        return statistics.fmean(abs(predict(p, *params) / p.measured_s - 1) for p in points)
    return min(itertools.product(COMPUTE, HOST_S, HOST_S), key=error)


def report(device: str, points: list[Point]) -> str:
    a, h0, h3 = fit(points)
    inside = [predict(p, a, h0, h3) / p.measured_s - 1 for p in points]
    left = [predict(p, *fit(points[:i] + points[i + 1:])) / p.measured_s - 1
            for i, p in enumerate(points)]
    default = [p.total_s / p.measured_s - 1 for p in points]
    efficiency = default_profile(gpu_for_device_name(device).key, 1).compute_efficiency / a
    lines = [f"{device}, {len(points)} dense runs: compute x{a:.2f} (efficiency {efficiency:.3f}), "
             f"h {h0 * 1e3:.0f} ms (ZeRO 0-2) and {h3 * 1e3:.0f} ms (ZeRO-3); median |error| "
             f"{statistics.median(map(abs, inside)):.1%} in sample, "
             f"{statistics.median(map(abs, left)):.1%} left out in turn (largest "
             f"{max(map(abs, left)):.1%}); the default profile "
             f"{statistics.median(map(abs, default)):.1%}"]
    lines += [f"  {p.label}: left out {e:+.1%}" for p, e in zip(points, left) if abs(e) > 0.05]
    return "\n".join(lines)


def main() -> None:
    runs = [r for r in kit_runs() if _resolved(r.recipe).recipe.model.moe is None]
    for device in sorted({r.device for r in runs}, reverse=True):
        print(report(device, [point(r) for r in runs if r.device == device]))


if __name__ == "__main__":
    main()
