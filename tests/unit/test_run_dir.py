"""Run directories (job/run_dir.py): where they go, and a clear exit 2 when one cannot be
written, before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from dsforge import cli
from dsforge.job.run_dir import RunDirError, new_run_dir, runs_root
from tests.conftest import REPO


def test_default_root_is_runs_or_DSFORGE_RUNS():
    assert runs_root({}) == Path("runs")
    assert runs_root({"DSFORGE_RUNS": "/scratch/me"}) == Path("/scratch/me")


def test_a_run_directory_that_cannot_be_written_is_refused(tmp_path):
    with pytest.raises(RunDirError, match="cannot write the run directory /proc/dsforge-x"):
        new_run_dir(Path("/proc/dsforge-x"), "tiny")
    result = CliRunner().invoke(cli.main, ["run", str(REPO / "recipes" / "tiny.yaml"),
                                           "--run-dir", "/proc/dsforge-x"])
    assert result.exit_code == 2 and "cannot write the run directory" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_run_directory_in_use_is_refused(tmp_path):
    """Two runs into one directory: the one that does not own it is refused (exit 2), even
    when both saw it empty (the check is repeated once owned)."""
    from dsforge.lock import hold_directory

    run_dir = tmp_path / "run"
    with hold_directory(run_dir, what="another dsforge run"):
        result = CliRunner().invoke(cli.main, ["run", str(REPO / "recipes" / "tiny.yaml"),
                                               "--run-dir", str(run_dir)])
    assert result.exit_code == 2 and "in use by another dsforge run" in result.output
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_resume_or_start_resumes_a_checkpoint_and_else_starts_over(tmp_path):
    """--resume-or-start (what a requeued Slurm job runs): a new directory starts; one a job
    left before its first checkpoint starts over, its files set aside; one with a complete
    checkpoint resumes, as --resume would."""
    import dataclasses

    from dsforge.job.run_dir import RunDir
    from dsforge.launch.start import own_run_dir, resumed_here
    from dsforge.recipe import resolve_file
    from tests.unit.helpers.checkpoints import fake_checkpoint

    resolved = resolve_file(REPO / "recipes" / "tiny.yaml")
    said = []

    def owned(path):  # as dsforge run decides (launch/entry.py _resuming), then owns it
        run_dir, lock = own_run_dir(path, resolved, resume=resumed_here(RunDir(path)),
                                    joining=False, create=True, say=said.append, or_start=True)
        lock.release()
        return run_dir

    assert not resumed_here(owned(tmp_path / "new")) and "starting its run from the beginning" in said[-1]
    died = tmp_path / "died"
    died.mkdir()
    for name in ("job.log", "metrics.jsonl", "manifest.json"):
        (died / name).write_text("x\n")
    run_dir = owned(died)
    assert not resumed_here(run_dir) and str(RunDir(died).attempts / "1") in said[-1]
    assert sorted(p.name for p in died.iterdir()) == ["attempts", "job.log"]
    assert (died / "attempts" / "1" / "metrics.jsonl").exists()
    fake_checkpoint(died, recipe=dataclasses.asdict(resolved.recipe),
                    world_size=resolved.layout.world_size)
    assert resumed_here(owned(died)) and said[-1] == f"dsforge: resuming {RunDir(died)} after step 3"


def test_resume_or_start_needs_a_run_directory_and_decides_alone():
    recipe = str(REPO / "recipes" / "tiny.yaml")
    for extra in ([], ["--run-dir", "x", "--resume"]):
        result = CliRunner().invoke(cli.main, ["run", recipe, "--resume-or-start", *extra])
        assert result.exit_code == 2 and "--resume-or-start decides for itself" in result.output
