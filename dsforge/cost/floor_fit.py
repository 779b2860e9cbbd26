"""The host floors fitted beside the refit's least squares (cost/fit.py,
docs/search.md "Calibration").

A floor is not a linear term: a layer's grad-enabled forward costs max(floor, the device's
time of it), and the device's time scales with the coefficients of the device's terms
(compute and other). So the floors are searched on a grid (0.1 ms steps up to 30 ms, both
floors at once, then 0.01 ms steps around the best), and at each grid point the linear terms
are solved by least squares, a few times over, each from the last solve's coefficients. Every grid point is solved at once: the terms' matrix is
the same for all, only the target moves.

A floor joins the fit only where the runs determine it (calibrate.py ranks its feature, the
microbatch-layers of the runs at its ZeRO stage, with the terms'). Where it binds in none of
them the error is flat in it, and of the equal fits the one nearest the profile's floor is
taken: the runs say only that the floor is no higher than their layers' forward. A fit is
refused where it would run the GEMMs faster than the peak (a below the profile's compute
efficiency) or give another term a negative coefficient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# The fitted coefficients (terms x fits) as each must stay >= 0: calibrate.term_margins.
Margins = Callable[[np.ndarray], np.ndarray]

STEP_S, MAX_S = 0.0001, 0.030  # the floors' grid, seconds a layer
ITERATIONS = 4  # least-squares solves per grid point, each from the last one's coefficients


@dataclass(frozen=True)
class Waits:
    """What cost.host_wait reads, for every point at once: whether it ran at ZeRO-3, its
    microbatch-layers (with the pipeline bubble's share), the device's seconds of one layer's
    grad-enabled forward per unit coefficient of each fitted term (columns as the fit's; 0 for
    a term that is not the device's work) and from the terms kept as they are; and its
    measured seconds."""

    zero3: np.ndarray
    layers: np.ndarray
    pass_per_term: np.ndarray  # points x fitted terms
    pass_kept: np.ndarray
    measured_s: np.ndarray

    def relative(self, host: np.ndarray, host_zero3: np.ndarray,
                 solution: np.ndarray) -> np.ndarray:
        """Each point's wait over its measured time (rows), per grid point (columns, with the
        fitted coefficients of each): microbatch-layers x max(0, floor - the pass)."""
        floor = np.where(self.zero3[:, None], host_zero3[None, :], host[None, :])
        pass_s = self.pass_kept[:, None] + self.pass_per_term @ solution
        wait = self.layers[:, None] * np.maximum(0.0, floor - pass_s)
        return wait / self.measured_s[:, None]


@dataclass(frozen=True)
class FloorFit:
    host: float
    host_zero3: float
    solution: np.ndarray | None  # the linear terms' coefficients; None where no fit is allowed
    most_negative: int | None  # the term to drop when none is (None: only compute's bound)


def fit_floors(x: np.ndarray, target: np.ndarray, waits: Waits, fitted: tuple[bool, bool],
               kept: tuple[float, float], start: np.ndarray, min_compute: float,
               margins: Margins) -> FloorFit:
    """Floors (host, host_zero3) and coefficients of x's columns (compute first, from `start`)
    that fit x @ c + wait = target, the floors flagged in `fitted` searched, the others at
    `kept`: on the grid, then on one ten times finer around its choice. `margins` gives the
    coefficients as each must stay >= 0 (calibrate.term_margins)."""
    grids = [np.arange(0.0, MAX_S + STEP_S / 2, STEP_S) if fit else np.array([value])
             for fit, value in zip(fitted, kept)]
    found = _best_on(grids, x, target, waits, start, min_compute, margins, kept)
    if found.solution is None:
        return found
    finer = [np.arange(max(0.0, v - STEP_S), v + STEP_S * 1.05, STEP_S / 10) if fit
             else np.array([v]) for fit, v in zip(fitted, (found.host, found.host_zero3))]
    return _best_on(finer, x, target, waits, start, min_compute, margins, kept)


def _best_on(grids: list[np.ndarray], x: np.ndarray, target: np.ndarray, waits: Waits,
             start: np.ndarray, min_compute: float, margins: Margins,
             prior: tuple[float, float]) -> FloorFit:
    host, host_zero3 = (g.ravel() for g in np.meshgrid(*grids, indexing="ij"))
    solution = np.repeat(start[:, None], len(host), axis=1)
    for _ in range(ITERATIONS):
        offset = waits.relative(host, host_zero3, solution)
        solution, *_ = np.linalg.lstsq(x, target[:, None] - offset, rcond=None)
    a = solution[0]
    error = np.sum((x @ solution + offset - target[:, None]) ** 2, axis=0)
    margin = margins(solution)[1:]
    allowed = (a >= min_compute) & np.all(margin >= 0, axis=0)
    if not allowed.any():
        nearest = int(np.argmin(error))
        negative = margin[:, nearest]
        worst = int(np.argmin(negative)) + 1 if (negative < 0).any() else None
        return FloorFit(float(host[nearest]), float(host_zero3[nearest]), None, worst)
    # A floor that binds nowhere leaves the error flat: of the equal fits, the one nearest the
    # profile's floors (what the runs cannot tell stays as it was).
    equal = allowed & (error <= error[allowed].min() * (1 + 1e-9) + 1e-15)
    choice = min(np.flatnonzero(equal),
                 key=lambda i: (abs(host[i] - prior[0]) + abs(host_zero3[i] - prior[1]), error[i]))
    return FloorFit(float(host[choice]), float(host_zero3[choice]), solution[:, choice], None)
