"""`dsforge bench` and `dsforge report` as functions: check, run, print; each returns its exit
status (docs/bench.md). The click options are cli.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from dsforge.problems import EXIT_INVALID, RecipeError, print_problems


def bench_main(study: str, out: Path | None, *, retry_failed: bool, tiny: bool,
               skip_fit_check: bool = False, db_timeout: float | None = None) -> int:
    """Refuse an invalid study before any cell runs; run the others' cells into
    OUT/results.db, a tiny study under its own name (NAME-tiny), waiting up to `db_timeout`
    seconds [as long as the study's cells may run] for another process's lock on it. Each
    cell's row stores the planner's step time (dsforge/cost/) where the cell runs on a GPU. A cell whose job does not fit this machine is rejected unless
    `skip_fit_check` (bench/run.py `fit_refusal`)."""
    from dsforge.bench.run import bench_study
    from dsforge.bench.study import check_study, load_study
    from dsforge.launch.checks import check_rank_imports

    try:
        parsed, recipe_path = load_study(study)
    except RecipeError as exc:
        print_problems(study, exc.problems)
        return EXIT_INVALID
    problems = check_study(parsed, recipe_path)
    if problems:  # before any cell runs
        print_problems(study, problems)
        return EXIT_INVALID
    check_rank_imports(Path.cwd())  # its cells' ranks start as dsforge run's do (BadOptions)
    if tiny:  # never mixed with the study's real results
        parsed = dataclasses.replace(parsed, name=f"{parsed.name}-tiny")
    out = out or Path("benchmarks") / parsed.name
    code = bench_study(parsed, recipe_path, out, retry_failed=retry_failed, tiny=tiny,
                       check_fit=not skip_fit_check, db_timeout=db_timeout,
                       log=lambda line: click.echo(line, err=True))
    if code != EXIT_INVALID:
        click.echo(f"results: {out / 'results.db'}; report: dsforge report {out / 'results.db'}")
    return code


def report_main(results: Path, out: Path | None, *, peak_tflops: float | None) -> int:
    """The report next to RESULTS (or in OUT), or what made it impossible."""
    from dsforge.bench.report import write_report
    from dsforge.bench.store import BenchError

    try:
        path = write_report(results, out or results.parent, peak_tflops=peak_tflops)
    except BenchError as exc:  # not a results database, or OUT not writable
        click.echo(f"dsforge report: {exc}", err=True)
        return exc.exit_code
    click.echo(f"report: {path}")
    return 0
