"""`dsforge refit RESULTS.db --out PROFILE.yaml`: the planner's profile refitted from the
measured cells of bench studies (cost/fit.py), so any study (a ZeRO stage
comparison, a schedule sweep) also calibrates the planner to the machine it ran on, as
`dsforge plan --search --measure` does with its own trials.

Each current cell (bench/report.py `current_cells`: a superseded base recipe's cells are left
out) whose repeats finished is a point: the recipe its run resolved to, as the store keeps it,
resolved again; its median step over every measured step of its repeats; its median step
breakdown where the runs timed one. Cells that did not finish are listed with their status.
The cells must have run on one kind of device: on a GPU the refit fits the host floors, on a
CPU it does not (calibrate.fit), and a profile is true of one machine.

The profile refitted is `--profile` (else the GPU's default), for the GPU it names, else the
GPU the cells ran on, else (on a CPU) the one the recipes name, with the recipes' GPUs per
node.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import click

from dsforge.bench.report import current_cells
from dsforge.bench.store import BenchError, Row, Store, unusable
from dsforge.cost.fit import Calibration, Point, calibrate, render
from dsforge.cost.profile import (ClusterProfile, load_profile, profile_text, provenance_lines,
                                    read_profile)
from dsforge.files import write_atomic
from dsforge.hardware import gpu_for_device_name
from dsforge.job.metrics_file import median_breakdown
from dsforge.problems import EXIT_INVALID, RecipeError
from dsforge.recipe.loader import build_recipe, parse_yaml
from dsforge.recipe.resolve import Resolved, resolve, topology_for


@dataclass(frozen=True)
class Cell:
    """A measured cell as the refit reads it."""

    label: str  # study and axes
    device: str  # the device its ranks ran on, as the run's manifest names it
    on_gpu: bool
    point: Point
    finished: float | None  # unix time its last repeat ended
    versions: dict[str, str]  # the packages its run ran with (the run's manifest)


@dataclass(frozen=True)
class Cells:
    used: list[Cell]
    skipped: list[str]  # "label: why" for each cell not used


def read_cells(rows: list[Row], study: str | None = None) -> Cells:
    """The finished cells of every study in `rows` (or of `study`), and why the others are not
    used."""
    studies: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        if study is None or row.study == study:
            studies[row.study].append(row)
    used, skipped = [], []
    for name, study_rows in studies.items():
        for repeats in current_cells(study_rows)[0]:
            label = f"{name} " + " ".join(f"{k}={v}" for k, v in repeats[0].axes.items())
            cell, why = _cell(label, repeats)
            if cell is None:
                skipped.append(f"{label}: {why}")
            else:
                used.append(cell)
    return Cells(used, skipped)


def _cell(label: str, repeats: list[Row]) -> tuple[Cell | None, str]:
    ok = [r for r in repeats if r.status == "ok" and r.figures and r.recipe and r.manifest]
    if not ok:
        return None, "no finished repeat (" + ", ".join(sorted({r.status for r in repeats})) + ")"
    try:
        resolved = _resolved(ok[0].recipe)
    except RecipeError as exc:
        return None, f"its recipe no longer resolves ({exc.problems[0]})"
    device = ok[0].manifest.get("device") or {}
    steps = [t for r in ok for t in r.figures["step_times_s"]]
    breakdown = median_breakdown(r.figures.get("breakdown_s") for r in ok)
    point = Point(label, resolved, statistics.median(steps), breakdown)
    return Cell(label, device.get("name") or device.get("type") or "unknown",
                on_gpu=device.get("type") == "cuda", point=point,
                finished=max((r.finished for r in ok if r.finished), default=None),
                versions=ok[0].manifest.get("versions") or {}), ""


def _resolved(recipe_text: str) -> Resolved:
    """The recipe a cell ran, as the store keeps it (its layout written out), resolved again."""
    recipe = build_recipe(parse_yaml(recipe_text, source="the cell's stored recipe"))
    topology, problems = topology_for(recipe)
    if problems:
        raise RecipeError(problems)
    return resolve(recipe, topology)


def starting_profile(cells: list[Cell], path: Path | None) -> ClusterProfile:
    """`--profile` (its GPU where it names one), else the default of the GPU the cells ran on,
    else of the recipes' GPU (docstring above)."""
    first = cells[0]
    cluster = first.point.resolved.recipe.cluster
    ran_on = gpu_for_device_name(first.device) if first.on_gpu else None
    gpu = ran_on.key if ran_on else cluster.gpu if cluster else None
    if path is not None and read_profile(path).gpu is not None:
        gpu = None  # the file's
    return load_profile(path, gpu, cluster.gpus_per_node if cluster else None)


def refit_cells(cells: Cells, profile: ClusterProfile) -> Calibration:
    """The refit, measured on the cells' device and the day the last of them finished."""
    on = cells.used[0]
    last = max((c.finished for c in cells.used if c.finished), default=None)
    day = f", {time.strftime('%Y-%m-%d', time.gmtime(last))}" if last else ""
    return calibrate([c.point for c in cells.used], profile, measured_on=on.device + day,
                     host_floors=on.on_gpu)


def _check(cells: Cells, results: Path, study: str | None) -> None:
    if not cells.used:
        where = f"study {study!r}" if study else "any study"
        why = ": " + "; ".join(cells.skipped[:3]) if cells.skipped else ""
        raise BenchError(f"no finished cell in {where} to refit from", argument="RESULTS",
                         value=results, fix="run the study with dsforge bench first, or name one "
                                            f"that finished with --study{why}")
    devices = sorted({c.device for c in cells.used})
    if len(devices) > 1:
        raise BenchError(f"its cells ran on {len(devices)} kinds of device ({', '.join(devices)}); "
                         "a profile is true of one", argument="RESULTS", value=results,
                         fix="pick the studies of one machine with --study")


def refit_main(results: Path, out: Path, profile: Path | None, study: str | None) -> int:
    """Read RESULTS, refit, print the table and write OUT; 2 with the reason where it cannot."""
    try:
        store = Store(results, argument="RESULTS", read_only=True)
        try:
            rows = store.rows()
        finally:
            store.close()
        cells = read_cells(rows, study)
        _check(cells, results, study)
        calibration = refit_cells(cells, starting_profile(cells.used, profile))
        _write(out, calibration, cells)
    except BenchError as exc:
        click.echo(f"dsforge refit: {exc}", err=True)
        return exc.exit_code
    except RecipeError as exc:  # the --profile file
        click.echo(f"dsforge refit: {exc}", err=True)
        return EXIT_INVALID
    for line in cells.skipped:
        click.echo(f"not used: {line}")
    click.echo(render(calibration))
    click.echo(f"refitted profile written to {out}: use it with "
               f"dsforge plan --search --profile {out}")
    return 0


def _write(out: Path, calibration: Calibration, cells: Cells) -> None:
    lines = provenance_lines("Refitted by dsforge refit from bench cells",
                             calibration.after.measured_on)
    ran = ", ".join(f"{k} {v}" for k, v in cells.used[0].versions.items() if v)
    lines += [f"The cells ran with: {ran or 'versions not recorded'}.",
              "Use it with --profile; it is true of the machine the cells ran on.", "",
              render(calibration)]
    lines += [f"Not used: {s}" for s in cells.skipped]
    try:
        write_atomic(out, profile_text(calibration.after, "\n".join(lines)))
    except OSError as exc:
        raise unusable("--out", out, "cannot write the profile", exc,
                       elsewhere="give another --out") from None
