"""The dry run's checks of the GPU kit (kit.py --dry-run, --check-wheels): the wheels and pins,
every planned run and study against dsforge's validation and memory model, no two runs of a
selection alike, each selection's estimate against its limit, the runtime's imports, and the
corpus the runs read. Each check returns the lines to print and the problems found.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import corpus as kit_corpus
import kit_plan
import kit_steps
import kit_wheels
from dsforge.units import GiB
from kit_plan import CALL_BUDGET_S, MEASUREMENTS, PLANNED_GPUS, SELECTIONS


def wheel_check(folder: Path, with_tree: bool = True) -> tuple[list[str], list[str]]:
    """Lines to print and the problems: pins against setup.cfg, the folder's wheels (absent is
    'not built', not a problem), their requirements, the size that travels."""
    pins = kit_wheels.read_pins()
    pin_found = kit_wheels.pin_problems(pins, kit_wheels.setup_requirements(),
                                        kit_wheels.extra_requirements())
    problems = list(pin_found)
    report = kit_wheels.check_wheels(folder, kit_wheels.expected_wheels(pins))
    if report.state == "incomplete":
        problems += report.problems
    elif report.state == "complete":
        problems += kit_wheels.requirement_problems(folder)
    resolver = _resolver_lines(folder, problems) if report.state == "complete" else []
    tree = kit_wheels.tree_bytes() if with_tree else None
    carried = kit_wheels.folder_bytes(folder)
    if tree is not None and tree + carried > kit_wheels.TREE_LIMIT_BYTES:
        problems.append("the working tree and the carried folder exceed the device tool's 64 MiB")
    lines = kit_wheels.wheel_lines(report, pins, tree, carried) + resolver
    lines.append("pins: " + ("match setup.cfg (install_requires and the gpu extra)"
                             if not pin_found else "DO NOT match setup.cfg"))
    lines += [f"  problem: {p}" for p in problems]
    return lines, problems


def _resolver_lines(folder: Path, problems: list[str]) -> list[str]:
    """pip's resolver on the install step, where a Python 3.12 is found here."""
    python312 = kit_wheels.find_python312()
    if python312 is None:
        return ["  pip resolver: not tried (no Python 3.12 here; set KIT_PYTHON312)"]
    ok, tail = kit_wheels.resolve_install(folder, kit_steps.install_requirements(), python312)
    if not ok:
        problems.append(f"pip cannot install the kit from {folder}: {tail}")
    return ["  pip resolver (Python 3.12 venv, the image's packages as stand-ins): "
            + ("ok: " + tail.splitlines()[-1] if ok else "FAILS")]


def spec_check() -> tuple[list[str], list[str]]:
    """Every run of every measurement on each planned GPU: valid for one GPU, and fitting
    where it is planned (a planned run that does not fit is a problem: the kit would skip it);
    no two runs planned on a GPU alike (a recipe changed to what its alternative measures)."""
    lines, problems = ["runs (world size 1; memory by dsforge's model, as dsforge plan --json):"], []
    for m in MEASUREMENTS.values():
        for spec in m.runs:
            for gpu in PLANNED_GPUS:
                line, problem = _run_verdict(spec, gpu)
                lines.append(f"  {m.name:10} {spec.label:26} {gpu}: {line}")
                problems += [problem] if problem else []
    problems += duplicate_runs() if not problems else []
    study_lines, study_problems = study_check()
    return lines + study_lines, problems + study_problems


def duplicate_runs() -> list[str]:
    """Runs of one selection planned on the same GPU whose resolved recipes are equal: one
    of them measures nothing new (e.g. a recipe now ships what its alternative measured).
    Runs that differ in their environment (the breakdown off) are different runs.
    Each selection's table stands alone, so its comparisons are all made in one command;
    across selections a configuration may repeat."""
    problems = []
    for selection, names in SELECTIONS.items():
        for gpu in PLANNED_GPUS:
            seen: dict = {}
            for spec in (s for n in names for s in MEASUREMENTS[n].runs if gpu in s.gpus):
                recipe = (kit_steps.resolve_run(spec, gpu).recipe, spec.env)
                if recipe in seen:
                    problems.append(f"{spec.label} and {seen[recipe]} run the same recipe on {gpu} "
                                    f"in {selection}; change one of them")
                seen.setdefault(recipe, spec.label)
    return problems


def _run_verdict(spec: kit_plan.RunSpec, gpu: str) -> tuple[str, str | None]:
    from dsforge.problems import RecipeError

    try:
        resolved = kit_steps.resolve_run(spec, gpu)
    except RecipeError as exc:
        return "INVALID", f"{spec.label} ({spec.recipe}): " + "; ".join(map(str, exc.problems))
    total = kit_steps.prediction(resolved)["memory_bytes"]["total"]
    note = kit_steps.fit_note(resolved, gpu)
    if gpu not in spec.gpus:
        return f"{total / GiB:6.1f} GiB, not planned on this GPU", None
    if note:
        return f"{total / GiB:6.1f} GiB, DOES NOT FIT", f"{spec.label} on {gpu}: {note}"
    return f"{total / GiB:6.1f} GiB, fits, runs", None


def study_check() -> tuple[list[str], list[str]]:
    lines, problems = ["studies (as dsforge bench checks them, on the kit's corpus; memory by "
                       "dsforge's model):"], []
    with tempfile.TemporaryDirectory(prefix="dsforge-kit-studies-") as folder:
        for spec in (s for m in MEASUREMENTS.values() for s in m.studies):
            study_lines, study_problems = _study_verdict(spec, Path(folder))
            lines += study_lines
            problems += study_problems
    return lines, problems


def _study_verdict(spec: kit_plan.StudySpec, folder: Path) -> tuple[list[str], list[str]]:
    """The study as the kit runs it (kit_steps.write_study): valid, and each cell fitting."""
    from dsforge.bench.study import check_study, expand, load_study, study_identity
    from dsforge.problems import RecipeError
    from dsforge.recipe import resolve_file

    try:
        study, recipe = load_study(kit_steps.write_study(spec, folder))
        found = check_study(study, recipe)
        cells = expand(study, base=study_identity(study, recipe)) if not found else []
    except RecipeError as exc:
        found, cells = list(exc.problems), []
    lines, problems = [], [f"{spec.study}: {p}" for p in found]
    for cell in cells:
        resolved = resolve_file(recipe, cell.overrides, world_size=study.world_size)
        total = kit_steps.prediction(resolved)["memory_bytes"]["total"]
        fits = {g: kit_steps.fit_note(resolved, g) is None for g in PLANNED_GPUS}
        problems += [f"{spec.study} {cell.axes} does not fit {g}" for g, ok in fits.items() if not ok]
        lines.append(f"  {spec.label} {cell.axes}: {total / GiB:.1f} GiB, fits "
                     + ", ".join(g for g, ok in fits.items() if ok))
    return lines, problems


def selection_check() -> tuple[list[str], list[str]]:
    """Each selection's estimated command on each GPU against its limit: the essential one
    within ESSENTIAL_S (8 minutes) less the finish and a margin, the others within one
    command's budget. Estimates include install and environment, not the machine's start."""
    lines = [f"selections (estimates; essential within {kit_plan.ESSENTIAL_S} s less "
             f"{kit_plan.FINISH_S} s to finish and {kit_plan.ESSENTIAL_MARGIN_S} s margin, "
             f"the others within {CALL_BUDGET_S} s):"]
    problems = []
    for selection in SELECTIONS:
        limit = kit_plan.selection_limit(selection)
        for gpu in PLANNED_GPUS:
            planned = kit_steps.selection_steps(selection, gpu)
            seconds = sum(s.expected_s for s in planned)
            measured = sum(s.expected_s for s in planned if s.basis.startswith("measured"))
            lines.append(f"  {selection:9} on {gpu}: ~{seconds:.0f} s of {limit:.0f} s "
                         f"({measured:.0f} s in steps whose main parts were measured)")
            if seconds > limit:
                problems.append(f"{selection} on {gpu}: ~{seconds:.0f} s > {limit:.0f} s")
    return lines, problems


def import_check() -> tuple[list[str], list[str]]:
    found = kit_wheels.imported_distributions()
    problems = kit_wheels.import_problems(found, kit_wheels.read_pins())
    lines = [f"imports: dsforge's runtime loads {len(found)} distributions; "
             + ("each is carried or in the GPU image" if not problems else "SOME ARE MISSING")]
    return lines + [f"  problem: {p}" for p in problems], problems




def corpus_check(selected: list[str]) -> tuple[list[str], Path | None]:
    """What the built corpus holds against what the largest run reads; where it is not built,
    a small stand-in (UTF-8 bytes, made once per process) that the recipes are checked on
    instead, returned."""
    prefix = kit_plan.corpus()
    if not kit_corpus.built(prefix):
        stand_in = kit_corpus.stand_in()
        return [f"corpus: not built at {prefix} (bash benchmarks/gpu/build_kit.sh builds it); "
                f"the runs are checked on a {kit_corpus.STAND_IN_BYTES // 1024} KiB stand-in"], stand_in
    about = kit_corpus.about(prefix)
    most = max((kit_steps.tokens_read(spec) for m in kit_plan.select(selected) for spec in m.runs),
               default=0)
    line = (f"corpus: {about['tokens'] / 1e6:.2f}M tokens ({about['source']}, vocabulary "
            f"{about['vocab_size']:,}); the largest run reads {most / 1e6:.2f}M")
    return [line + ("" if most <= about["tokens"] else " (it wraps around: more text needed)")], None
