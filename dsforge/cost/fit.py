"""The profile's coefficients refitted from measured step times (`dsforge plan --search
--measure`, docs/search.md "Calibration").

A measured run is a point: its resolved recipe and its median step time. Under the profile the
prediction splits into terms (cost.StepTime); the refit scales seven of them:

    measured ~ a x compute + f x microbatch-layers + g x gathers + o x other-units
               + d x attention + b x optimizer + c x communication

Each term carries its share of the pipeline bubble. compute is the GEMM and attention work,
and where the profile has a rate of its own for the attention, attention is its share again:
d corrects a on it alone (d may be negative, a + d > 0);
the microbatch-layers are the microbatches a step times the busiest rank's layers (each pays
a fixed cost: launching its kernels); gathers are ZeRO-3's per-layer parameter fetches (a
layer's forward, backward and recompute each fetch it); other-units are the tokens x hidden
units x layers of the work outside the GEMMs and attention (cost.other_units); optimizer is the
16-bit optimizer step; communication is every collective and pipeline send the model counts.
Where points have a step breakdown, the optimizer's coefficient comes from its own phase in
them instead (measured over modelled seconds), and the step's fit leaves it out: a run
without one (DSFORGE_BREAKDOWN=off) still counts in the step's fit.
The fit minimises the relative error and takes the terms in that order, each only if the
points tell it apart from the terms before it (_determined: at least DISTINCT of its feature
lies outside what theirs can make; layouts that differ only where the model sees no
difference determine one term, however many they are). A term whose coefficient would come
out negative is held at 0 and the rest refitted (non-negative least squares: communication at
0 is an engine that hides it all); compute never is (when it alone comes out negative, the
last other term is left out at the profile's coefficient).

On a GPU (`host_floors`) the host launches kernels beside the device, so its cost is a floor
under each layer's grad-enabled forward (cost.host_wait), not an addition: the two floors
(ZeRO 0-2's and ZeRO-3's) are fitted in place of f and g, right after compute, each only where
the points determine it (cost/floor_fit.py searches them; the linear terms are solved at
each).

The refitted profile: compute_efficiency / a (and a measured attention_efficiency / (a + d)
and expert_efficiency / a: the compute term holds the attention and the experts),
microbatch_layer_s = f, zero3_gather_layer_s = g (or the floors, host_layer_s and
host_layer_zero3_s), other_s_per_token_hidden = o, the
optimizer's fixed cost and bytes x b, the bandwidths / c and the p2p latency x c. With 3 or
more points each is predicted from a refit without it (leave-one-out); the median of
those errors becomes the profile's prediction_error, the band `dsforge plan --search` draws
and breaks ties with. Fewer points keep the band it had.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dsforge.cost.floor_fit import Waits, fit_floors
from dsforge.cost.profile import ClusterProfile
from dsforge.cost.step_time import (compute_split, forward_pass, gather_count, microbatch_layers,
                                 other_factor, other_units, step_time)
from dsforge.estimate.bubble import bubble_fraction
from dsforge.recipe.resolve import Resolved

# The order they are fitted. `other` comes after the fixed costs: within one model it differs
# from compute only by the GEMMs' saturation, so it needs runs of different widths.
# `attention` corrects compute's coefficient on the attention's share alone, after `other`: at
# one sequence length that share varies with the width as other's does (as s / h against
# 1 / h), so it needs runs of different sequence lengths.
TERMS = ("compute", "fixed", "gathers", "other", "attention", "optimizer", "communication")
# Terms whose coefficient may be negative: attention's is added to compute's (their sum > 0).
SIGNED = ("attention",)
DEVICE_TERMS = ("compute", "attention", "other")  # the device's work in a layer's forward
DISTINCT = 0.05  # the share of a term's feature the terms before it must leave unexplained
FLOOR_REPLACES = ("fixed", "gathers")  # on a GPU the host's cost is a floor, not an addition
FLOOR_NAMES = ("host", "host_zero3")  # the floors' coefficients: ZeRO 0-2's and ZeRO-3's seconds
LEAVE_ONE_OUT_MIN = 3  # points needed for a band from leave-one-out residuals


@dataclass(frozen=True)
class Point:
    label: str
    resolved: Resolved
    measured_s: float
    phases: dict[str, float] | None = None  # the step breakdown's medians, where measured


@dataclass(frozen=True)
class Row:
    label: str
    measured_s: float
    before_s: float  # predicted by the profile as it was
    after_s: float  # by the refitted profile
    left_out_s: float | None  # by a refit without this point


@dataclass(frozen=True)
class Calibration:
    before: ClusterProfile
    after: ClusterProfile
    coefficients: dict[str, float]  # per fitted term; terms left out keep 1 (f: seconds)
    rows: list[Row]

    @property
    def left_out_error(self) -> float | None:
        """Median |left-out prediction / measured - 1|; None with too few points."""
        errors = [abs(r.left_out_s / r.measured_s - 1) for r in self.rows if r.left_out_s]
        return statistics.median(errors) if errors else None


def features(resolved: Resolved, profile: ClusterProfile) -> dict[str, float]:
    """The prediction's terms under `profile` without its fixed costs, host floors and other
    work; `fixed` counts the microbatch-layers and `other` the other row's units (seconds come
    from the coefficients). `compute` holds the attention too; `attention` is the attention's
    seconds again, where the profile has a rate of its own for it (else 0: it runs at the
    GEMMs' rate, which compute's coefficient scales)."""
    unfixed = dataclasses.replace(profile, microbatch_layer_s=0.0, zero3_gather_layer_s=0.0,
                                  host_layer_s=0.0, host_layer_zero3_s=0.0,
                                  other_s_per_token_hidden=0.0)
    t = step_time(resolved, unfixed)
    lay = resolved.layout
    bubble = bubble_fraction(lay.pp, lay.vpp, lay.num_microbatches)
    # The bubble is that share of every term in the pipeline's slots (cost.step_time): with
    # the fixed and gather terms at 0, what is not compute's share is communication's.
    communication = (t.tp_comm + t.ep_comm + t.cp_comm + t.pp_comm + t.dp_comm + t.bubble
                     - bubble * t.compute)
    attention = (0.0 if profile.attention_efficiency is None
                 else compute_split(resolved, unfixed)[1])
    return {"compute": t.compute * (1 + bubble), "attention": attention * (1 + bubble),
            "fixed": microbatch_layers(resolved) * (1 + bubble),
            "gathers": gather_count(resolved) * (1 + bubble),
            "other": other_units(resolved) * other_factor(resolved, profile) * (1 + bubble),
            "optimizer": t.optimizer, "communication": communication}


def fit(points: list[Point], profile: ClusterProfile, host_floors: bool = False,
        keep: tuple[str, ...] = ()) -> dict[str, float]:
    """Coefficients of the terms the points determine (docstring above); the rest keep 1
    (fixed, gathers, other and the floors: the profile's seconds). With `host_floors` (the
    points ran on a GPU) the floors are fitted and replace the fixed and gather costs; without,
    the floors are 0 (a CPU's host costs add to its compute). The terms in `keep` are not
    fitted (the profile's coefficient stays)."""
    rows = [features(p.resolved, profile) for p in points]
    relative = np.array([[r[t] / p.measured_s for t in TERMS] for r, p in zip(rows, points)])
    coefficients = {"compute": 1.0, "attention": 0.0, "fixed": profile.microbatch_layer_s,
                    "gathers": profile.zero3_gather_layer_s,
                    "other": profile.other_s_per_token_hidden, "optimizer": 1.0,
                    "communication": 1.0, "host": profile.host_layer_s,
                    "host_zero3": profile.host_layer_zero3_s}
    columns = {t: relative[:, i] for i, t in enumerate(TERMS)}
    order = list(TERMS)
    if host_floors:
        coefficients.update(fixed=0.0, gathers=0.0)
        waits = host_waits(points, rows)
        # Where a floor binds, its wait is microbatch-layers x the floor: that is its feature.
        columns.update(host=np.where(waits.zero3, 0.0, waits.layers) / waits.measured_s,
                       host_zero3=np.where(waits.zero3, waits.layers, 0.0) / waits.measured_s)
        order = ["compute", *FLOOR_NAMES, *(t for t in TERMS[1:] if t not in FLOOR_REPLACES)]
    else:  # the host is the device (a CPU): its costs add, as f and g; no floor
        coefficients.update(host=0.0, host_zero3=0.0)
    measured_optimizer = optimizer_from_breakdowns(points, rows)
    if measured_optimizer is not None:  # the breakdowns time the optimizer step itself
        coefficients["optimizer"] = measured_optimizer
        order.remove("optimizer")
    chosen = _determined(columns, [t for t in order if t not in keep])
    floors = [name for name in chosen if name in FLOOR_NAMES]
    chosen = [name for name in chosen if name not in FLOOR_NAMES]
    if floors:
        with_floors = _refit(relative, coefficients, chosen,
                             _floor_solver(waits, profile, coefficients, floors))
        if with_floors is not None:
            return {**coefficients, **with_floors}
    return {**coefficients, **(_refit(relative, coefficients, chosen, _least_squares) or {})}


# A solver of the chosen terms (names, their features' matrix, the target): their fitted
# values, or None and which term to drop (an index into the names; None: the last).
Solver = Callable[[list[str], np.ndarray, np.ndarray], tuple[dict[str, float] | None, int | None]]


def _refit(relative: np.ndarray, coefficients: dict[str, float], chosen: list[str],
           solve: Solver) -> dict[str, float] | None:
    """The chosen terms solved on what the rest leave of each point (the terms left out keep
    their coefficients: what they predict leaves the target), compute first. Where the solver
    allows no fit, the term it names (the points push it below 0) is held at 0, its bound (a
    signed term's correction: none), and the rest refitted, as non-negative least squares
    would; where it names none (compute alone came out <= 0), the last term is left out with
    the profile's coefficient. None where compute alone allows no fit."""
    chosen, held = list(chosen), {}
    while chosen and chosen[0] == "compute":
        current = {**coefficients, **held}
        kept = sum((current[t] * relative[:, i] for i, t in enumerate(TERMS) if t not in chosen),
                   np.zeros(len(relative)))
        values, drop = solve(chosen, relative[:, [TERMS.index(t) for t in chosen]], 1.0 - kept)
        if values is not None:
            return {**held, **values}
        if len(chosen) == 1:
            return None  # compute alone comes out <= 0: nothing to fit
        if drop is None:
            chosen.pop()
        else:
            held[chosen.pop(drop)] = 0.0
    return None


def _least_squares(chosen: list[str], x: np.ndarray, target: np.ndarray):
    """Least squares; refused where compute comes out <= 0 or another term negative (a signed
    term: its sum with compute), naming the most negative term (_refit holds it at 0); when
    only compute is negative, the terms after it bent it there, and none is named."""
    solution, *_ = np.linalg.lstsq(x, target, rcond=None)
    margins = term_margins(chosen, solution)
    negative = [i for i in range(1, len(chosen)) if margins[i] < 0]
    if solution[0] > 0 and not negative:
        return dict(zip(chosen, (float(v) for v in solution))), None
    return None, min(negative, key=lambda i: margins[i]) if negative else None


def term_margins(chosen: list[str], solution: np.ndarray) -> np.ndarray:
    """Each coefficient as a fit must keep it >= 0: a signed term's with compute's (the first)
    added. `solution` may hold one column of coefficients per fit (floor_fit's grid)."""
    signed = np.array([t in SIGNED for t in chosen])
    shape = (-1,) + (1,) * (solution.ndim - 1)
    return solution + np.where(signed.reshape(shape), solution[0], 0.0)


def _floor_solver(waits: HostWaits, profile: ClusterProfile, coefficients: dict[str, float],
                  floors: list[str]) -> Solver:
    """The chosen terms beside the floors (cost/floor_fit.py), searched where `floors` names
    them, the others at the profile's."""
    fitted = tuple(name in floors for name in FLOOR_NAMES)
    kept_floors = tuple(coefficients[name] for name in FLOOR_NAMES)

    def solve(chosen: list[str], x: np.ndarray, target: np.ndarray):
        start = np.array([coefficients[t] for t in chosen])
        found = fit_floors(x, target, waits.for_terms(chosen, coefficients), fitted, kept_floors,
                           start, profile.compute_efficiency,
                           lambda solution: term_margins(chosen, solution))
        if found.solution is None:
            return None, found.most_negative
        return {**dict(zip(chosen, (float(v) for v in found.solution))), "host": found.host,
                "host_zero3": found.host_zero3}, None
    return solve


@dataclass(frozen=True)
class HostWaits:
    """What cost.host_wait reads, for every point, under the profile: whether it ran at ZeRO-3,
    its microbatch-layers (with the bubble's share: the wait fills and drains with the
    pipeline), and the device's seconds of one layer's grad-enabled forward per unit
    coefficient of each of the device's terms (DEVICE_TERMS)."""

    zero3: np.ndarray
    layers: np.ndarray
    pass_per_unit: dict[str, np.ndarray]
    measured_s: np.ndarray

    def for_terms(self, chosen: list[str], coefficients: dict[str, float]) -> Waits:
        """floor_fit.Waits for these fitted terms; the device's terms not among them at their
        coefficients."""
        zero = np.zeros_like(self.measured_s)
        per_term = np.column_stack([self.pass_per_unit.get(t, zero) for t in chosen])
        kept = sum((coefficients[t] * self.pass_per_unit[t] for t in DEVICE_TERMS
                    if t not in chosen), zero)
        return Waits(self.zero3, self.layers, per_term, kept, self.measured_s)


def host_waits(points: list[Point], rows: list[dict[str, float]]) -> HostWaits:
    """HostWaits of the points, from their features (rows, as `features` gives them)."""
    zero3, layers, per_unit = [], [], {t: [] for t in DEVICE_TERMS}
    for p, row in zip(points, rows):
        lay = p.resolved.layout
        bubble = bubble_fraction(lay.pp, lay.vpp, lay.num_microbatches)
        for term in DEVICE_TERMS:
            count, seconds = forward_pass(p.resolved, row[term] / (1 + bubble))
            per_unit[term].append(seconds)
        zero3.append(p.resolved.recipe.zero.stage == 3)
        layers.append(count * (1 + bubble))
    return HostWaits(np.array(zero3), np.array(layers),
                     {t: np.array(v) for t, v in per_unit.items()},
                     np.array([p.measured_s for p in points]))


def _determined(columns: dict[str, np.ndarray], order: list[str]) -> list[str]:
    """The terms of `order`, in order, each only if the points tell it apart from the terms
    before it: at least DISTINCT of its feature (over the points) lies outside what theirs
    can make. Layouts that differ only where the model sees no difference determine one term,
    however many they are, and a term the points barely tell apart (its least-squares
    coefficient would swing with the noise of a run) waits for points that do."""
    chosen: list[str] = []
    for term in order:
        column = columns[term]
        norm = np.linalg.norm(column)
        if norm == 0:
            continue
        if chosen:
            basis = np.column_stack([columns[t] for t in chosen])
            fitted, *_ = np.linalg.lstsq(basis, column, rcond=None)
            column = column - basis @ fitted
        if np.linalg.norm(column) >= DISTINCT * norm:
            chosen.append(term)
    return chosen


def optimizer_from_breakdowns(points: list[Point], rows: list[dict[str, float]]) -> float | None:
    """The optimizer's coefficient from the breakdowns' optimizer phase (measured over the
    modelled seconds, summed over the points that have a breakdown); None where none has."""
    timed = [(p, r) for p, r in zip(points, rows) if p.phases and "optimizer" in p.phases]
    modelled = sum(r["optimizer"] for _, r in timed)
    measured = sum(p.phases["optimizer"] for p, _ in timed)
    return measured / modelled if modelled > 0 and measured > 0 else None


def apply(profile: ClusterProfile, coefficients: dict[str, float]) -> ClusterProfile:
    """The profile whose prediction is the fitted one, to first order: tensor-parallel traffic
    hidden behind a GEMM changes with the GEMM's length, and an efficiency above 1 is cut to 1."""
    a = coefficients["compute"]
    # A coefficient of exactly 0 would leave a bandwidth or a byte count no profile may hold.
    b, c = (max(coefficients[t], 1e-6) for t in ("optimizer", "communication"))
    # compute holds the attention too: a measured attention rate scales with the GEMMs', and
    # with attention's own correction where the points determined one.
    attention_scale = max(a + coefficients.get("attention", 0.0), 1e-6)
    attention = (None if profile.attention_efficiency is None
                 else min(1.0, profile.attention_efficiency / attention_scale))
    experts = (None if profile.expert_efficiency is None  # in compute, with the GEMMs
               else min(1.0, profile.expert_efficiency / a))
    return dataclasses.replace(
        profile, compute_efficiency=min(1.0, profile.compute_efficiency / a),
        attention_efficiency=attention, expert_efficiency=experts,
        microbatch_layer_s=coefficients["fixed"], zero3_gather_layer_s=coefficients["gathers"],
        other_s_per_token_hidden=coefficients.get("other", profile.other_s_per_token_hidden),
        host_layer_s=coefficients.get("host", profile.host_layer_s),
        host_layer_zero3_s=coefficients.get("host_zero3", profile.host_layer_zero3_s),
        optimizer_bytes_per_param=profile.optimizer_bytes_per_param * b,
        optimizer_bytes_per_param_fp32=profile.optimizer_bytes_per_param_fp32 * b,
        optimizer_fixed_s=profile.optimizer_fixed_s * b,
        intra_node_gbps=profile.intra_node_gbps / c, inter_node_gbps=profile.inter_node_gbps / c,
        p2p_latency_s=profile.p2p_latency_s * c)


def calibrate(points: list[Point], profile: ClusterProfile, measured_on: str,
              host_floors: bool = False) -> Calibration:
    """The refitted profile, every point predicted before and after, and left out in turn;
    `host_floors`: the points ran on a GPU, whose host works beside it (fit)."""
    coefficients = fit(points, profile, host_floors)
    after = apply(profile, coefficients)
    left_out = [_left_out(points, i, profile, host_floors) for i in range(len(points))]
    calibration = Calibration(
        before=profile, after=after, coefficients=coefficients,
        rows=[Row(p.label, p.measured_s, step_time(p.resolved, profile).total,
                  step_time(p.resolved, after).total, left) for p, left in zip(points, left_out)])
    band = calibration.left_out_error
    after = dataclasses.replace(after, measured_on=measured_on, measured_runs=len(points),
                                prediction_error=min(band, 0.99) if band is not None
                                else profile.prediction_error)
    return dataclasses.replace(calibration, after=after)


def _left_out(points: list[Point], i: int, profile: ClusterProfile,
              host_floors: bool) -> float | None:
    if len(points) < LEAVE_ONE_OUT_MIN:
        return None
    others = points[:i] + points[i + 1:]
    return step_time(points[i].resolved, apply(profile, fit(others, profile, host_floors))).total


def _coefficients_line(calibration: Calibration) -> str:
    """What the refit found, term by term."""
    c, before, after = calibration.coefficients, calibration.before, calibration.after
    parts = [f"compute x{c['compute']:.3g} (efficiency {before.compute_efficiency:.3g} -> "
             f"{after.compute_efficiency:.3g})"]
    if c.get("attention"):
        parts.append(f"attention x{c['compute'] + c['attention']:.3g} (efficiency "
                     f"{before.attention_efficiency:.3g} -> {after.attention_efficiency:.3g})")
    if before.expert_efficiency is not None:  # scaled with the GEMMs (apply)
        parts.append(f"experts' efficiency {before.expert_efficiency:.3g} -> "
                     f"{after.expert_efficiency:.3g}")
    parts += [f"{c['other'] * 1e12:.3g} ps a token, layer and hidden unit outside them",
              f"{c['fixed'] * 1e3:.3g} ms per microbatch and layer",
              f"{c['gathers'] * 1e3:.3g} ms per ZeRO-3 layer gather",
              f"host floor {c['host'] * 1e3:.3g} ms a layer ({c['host_zero3'] * 1e3:.3g} at ZeRO-3)",
              f"optimizer x{c['optimizer']:.3g}", f"communication x{c['communication']:.3g}"]
    return f"refit on {len(calibration.rows)} measured trial(s): " + ", ".join(parts)


def render(calibration: Calibration) -> str:
    """Predicted against measured for each point, before and after the refit."""
    after = calibration.after
    lines = [_coefficients_line(calibration),
             "  layout                                          measured ms  before ms  error   "
             "after ms  error   left out ms  error"]
    for r in calibration.rows:
        left = (f"{r.left_out_s * 1e3:>11,.1f}  {r.left_out_s / r.measured_s - 1:+6.1%}"
                if r.left_out_s else f"{'-':>11}  {'':>6}")
        lines.append(f"  {r.label:<46}  {r.measured_s * 1e3:>11,.1f}  {r.before_s * 1e3:>9,.1f}  "
                     f"{r.before_s / r.measured_s - 1:+6.1%}  {r.after_s * 1e3:>8,.1f}  "
                     f"{r.after_s / r.measured_s - 1:+6.1%}  {left}")
    band = calibration.left_out_error
    lines.append(f"band: +-{band:.1%}, the median error of each trial predicted from the others"
                 if band is not None else
                 f"band: +-{after.prediction_error:.1%} kept (leave-one-out needs "
                 f"{LEAVE_ONE_OUT_MIN} trials; --top {LEAVE_ONE_OUT_MIN} measures enough)")
    return "\n".join(lines)
