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
