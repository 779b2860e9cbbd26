"""`dsforge plan --search ... --measure`: short trials of the top candidates, re-ranked.

Each of the top K layouts runs as a bench cell (dsforge/bench: its own job and process
group, a wall-clock timeout, warmup steps excluded, ok/oom/timeout/crashed from the exit and
the log) on this machine's devices, with results in OUT/results.db so `dsforge report` can
render them and a second run skips what finished. The candidates are then ordered by
measured median step time (failed trials last) and shown next to the prediction.

The prediction is for the profile's GPU; a trial measures the machine it runs on. The
finished trials then refit the profile to this machine (cost/fit.py): the refitted
profile is written to OUT/profile.yaml and the search is ranked again with it, so off the
profile's GPU (e.g. a tiny model on CPU) the refitted predictions are of this machine.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsforge.bench.run import run_cell
from dsforge.bench.store import FAILED, Store
from dsforge.bench.study import Cell, Measure, Study, make_cell, timing
from dsforge.cost.fit import Calibration, Point, calibrate
from dsforge.cost.fit import render as render_calibration
from dsforge.cost.profile import profile_text, provenance_lines
from dsforge.files import write_atomic
from dsforge.lock import Busy
from dsforge.recipe.loader import dump_recipe
from dsforge.schema import Recipe
from dsforge.search.search import Ranked, SearchResult, search


@dataclass(frozen=True)
class Trial:
    predicted_rank: int
    candidate: Ranked
    status: str
    reason: str | None
    measured_step_s: float | None
    breakdown_s: dict[str, float] | None = None  # median seconds per phase of the trial


def candidate_overrides(r: Ranked) -> dict[str, object]:
    lay, recipe = r.resolved.layout, r.resolved.recipe
    return {"parallel.tp": lay.tp, "parallel.pp": lay.pp, "parallel.vpp": lay.vpp,
            "parallel.ep": lay.ep, "parallel.dp": -1, "parallel.etp": None,
            "parallel.sequence_parallel": lay.sequence_parallel, "zero.stage": recipe.zero.stage,
            "train.micro_batch": lay.micro_batch, "train.global_batch": lay.global_batch,
            "train.grad_accum": None,
            "train.activation_checkpointing": recipe.train.activation_checkpointing}


def candidate_label(rank: int, r: Ranked) -> str:
    """The trial's name in results.db and `dsforge report`: its rank and layout."""
    return f"#{rank} {r.shape()}"


def _cell(rank: int, r: Ranked, measure: Measure, base: str) -> Cell:
    settings = {**candidate_overrides(r), **timing(measure)}
    # The learning-rate warmup must be shorter than the trial.
    settings["train.warmup_steps"] = min(r.resolved.recipe.train.warmup_steps, settings["train.steps"] - 1)
    return make_cell({"candidate": candidate_label(rank, r)}, settings, base=base)


def measure_top(base: Recipe, result: SearchResult, top: int, out_dir: Path, measure: Measure,
                log: Callable[[str], None] = print) -> list[Trial]:
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = out_dir / "base.yaml"
    write_atomic(recipe_path, dump_recipe(base))
    shown = result.ranked[:top]
    study = Study(name=f"search-{base.model.preset or base.name}", recipe=str(recipe_path),
                  world_size=result.space.gpus, axes={"candidate": [candidate_label(i, r) for i, r in enumerate(shown, start=1)]},
                  measure=measure)
    store = Store(out_dir / "results.db")
    # The trials' key includes what they are measured on, so another base is a new trial
    # (the study's own identity would apply its timing to the base, whose warmup may not fit).
    base_identity = f"{dump_recipe(base)}\nworld_size: {result.space.gpus}"
    trials = []
    try:
        for rank, candidate in enumerate(shown, start=1):
            cell = _cell(rank, candidate, measure, base_identity)
            if store.status(study.name, cell.key, 0) in (None, *FAILED):
                try:
                    row = run_cell(study, recipe_path, cell, 0, out_dir)
                except Busy as busy:  # another dsforge measures this trial right now
                    log(f"trial {rank}/{len(shown)}: busy, not run ({busy})")
                    continue
                store.write(row)
                log(f"trial {rank}/{len(shown)}: {row.status}" + (f" ({row.reason})" if row.reason else ""))
            trials.append(_trial(rank, candidate, store, study.name, cell.key))
    finally:
        store.close()
    return sorted(trials, key=lambda t: (t.measured_step_s is None, t.measured_step_s or 0.0, t.predicted_rank))


def _trial(rank: int, candidate: Ranked, store: Store, study: str, key: str) -> Trial:
    row = next(r for r in store.rows() if r.study == study and r.cell == key and r.repeat == 0)
    ok = row.status == "ok" and row.figures
    step = statistics.median(row.figures["step_times_s"]) if ok else None
    return Trial(predicted_rank=rank, candidate=candidate, status=row.status, reason=row.reason,
                 measured_step_s=step, breakdown_s=row.figures.get("breakdown_s") if ok else None)


def render_trials(trials: list[Trial]) -> str:
    lines = ["measured (re-ranked by median step time of the trial):",
             "  measured  predicted  layout                                          predicted ms  measured ms  status"]
    for position, t in enumerate(trials, start=1):
        shape = t.candidate.shape()
        measured = f"{t.measured_step_s * 1e3:,.1f}" if t.measured_step_s is not None else "-"
        lines.append(f"  {position:>8}  {t.predicted_rank:>9}  {shape:<46}  {t.candidate.time.total * 1e3:>12,.3f}"
                     f"  {measured:>11}  {t.status}" + (f": {t.reason}" if t.reason else ""))
    return "\n".join(lines + [verdict(trials)])


def verdict(trials: list[Trial]) -> str:
    """Whether the measurement changes the search's answer (its #1)."""
    ok = [t for t in trials if t.measured_step_s is not None]
    if not ok:
        return "no trial finished: the predicted order stands"
    best = ok[0]  # trials are sorted by measured step time
    if best.predicted_rank == 1:
        return "the measurement keeps the search's answer: #1 measured fastest"
    first = next((t for t in ok if t.predicted_rank == 1), None)
    by = (f"; #1 took {first.measured_step_s / best.measured_step_s - 1:.1%} longer" if first else
          " (#1 did not finish)")
    return (f"the measurement changes the answer: #{best.predicted_rank} ({best.candidate.shape()}) "
            f"measured fastest{by}: prefer it on this hardware")


@dataclass(frozen=True)
class Refit:
    calibration: Calibration
    before: SearchResult
    after: SearchResult  # the search again, with the refitted profile
    path: Path  # where the refitted profile was written


def refit_from_trials(base: Recipe, result: SearchResult, trials: list, out: Path) -> Refit | None:
    """The profile refitted from the finished trials (cost/fit.py), written to
    OUT/profile.yaml with where and how it was measured, and the search re-ranked by it."""
    points = [Point(t.candidate.shape(), t.candidate.resolved, t.measured_step_s, t.breakdown_s)
              for t in trials if t.measured_step_s is not None]
    if not points:
        return None
    calibration = calibrate(points, result.profile, measured_on=measured_on(),
                            host_floors=trials_ran_on_a_gpu())
    path = out / "profile.yaml"
    write_atomic(path, profile_text(calibration.after, provenance(calibration)))
    return Refit(calibration, result, search(base, result.space, calibration.after), path)


def trials_ran_on_a_gpu() -> bool:
    """Whether the trials ran on a GPU, whose host launches kernels beside it: the refit then
    fits the host floors; on a CPU the host's costs add to the compute (calibrate.fit)."""
    import torch

    return torch.cuda.is_available()


def measured_on() -> str:
    """The device the trials ran on (a GPU where one is visible) and the date."""
    import torch

    from dsforge.calibrate.kernel_timing import measured_on as on_device

    return on_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def provenance(calibration: Calibration) -> str:
    lines = provenance_lines("Refitted by dsforge plan --search --measure",
                             calibration.after.measured_on)
    return "\n".join(lines + ["Use it with --profile; it is true of this machine.", "",
                               render_calibration(calibration)])


def render_refit(refit: Refit, top: int) -> str:
    lines = [render_calibration(refit.calibration), f"refitted profile written to {refit.path}",
             "re-ranked with it (predicted step s before -> after):"]
    before = {r.shape(): r.time.total for r in refit.before.ranked}
    for i, r in enumerate(refit.after.ranked[:top], start=1):
        old = before.get(r.shape())
        was = f"{old:.4g}" if old is not None else "-"
        lines.append(f"  {i}. {r.shape():<46} {was} -> {r.time.total:.4g} s, band "
                     f"{r.band[0]:.4g}-{r.band[1]:.4g} s" + ("  tie" if r.tied else ""))
    return "\n".join(lines)


def refit_json(refit: Refit, top: int) -> dict[str, Any]:
    c = refit.calibration
    return {"coefficients": c.coefficients, "profile": str(refit.path),
            "measured_on": c.after.measured_on, "left_out_error": c.left_out_error,
            "prediction_error": c.after.prediction_error,
            "trials": [dataclasses.asdict(r) for r in c.rows],
            "reranked": [{"layout": r.layout_row(), "predicted_step_s": r.time.total,
                          "band_s": list(r.band), "tied": r.tied} for r in refit.after.ranked[:top]]}
