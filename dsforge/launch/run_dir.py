"""Where a run's files go, and who may use a run directory.

A new run gets a new, empty directory: --run-dir, or RUNS_ROOT/NAME-YYYYMMDD-HHMMSS where
RUNS_ROOT is $DSFORGE_RUNS or ./runs (relative to where dsforge is started). Resuming, and the
nodes after the first with --no-ssh, use the directory that exists. In it:
  job.log          everything the launcher and the ranks printed (engine logs included)
  recipe.yaml      the resolved recipe;  manifest.json, metrics.jsonl, summary.json
  ranks/, heartbeats/, failures/, checkpoints/
"""

from __future__ import annotations

import os
import time
from pathlib import Path

JOB_LOG = "job.log"


class RunDirError(ValueError):
    pass


def runs_root(environ=os.environ) -> Path:
    return Path(environ.get("DSFORGE_RUNS") or "runs")


def new_run_dir(run_dir: Path | None, name: str, *, create: bool = True) -> Path:
    """`run_dir`, or a fresh one under runs_root(); it must be empty so no earlier run's
    metrics are mixed in."""
    if run_dir is None:
        run_dir = runs_root() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"--run-dir {run_dir} is not empty; choose a new directory so no "
                          "earlier run's metrics are mixed in")
    if create:
        _make(run_dir)
    return run_dir


def existing_run_dir(run_dir: Path | None, *, create: bool = True) -> Path:
    """The run directory to resume or join (--resume, --no-ssh node ranks > 0)."""
    if run_dir is None:
        raise RunDirError("--resume and --no-ssh node ranks > 0 need --run-dir")
    if create:
        _make(run_dir)
    return run_dir


def _make(run_dir: Path) -> None:
    """Create it and check that it can be written, before any rank starts."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".dsforge-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(f"cannot write the run directory {run_dir}: {exc.strerror}; choose a "
                          "writable place with --run-dir, or set DSFORGE_RUNS") from None
