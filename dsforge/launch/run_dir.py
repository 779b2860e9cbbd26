"""Where a run's files go, and who may use a run directory.

A new run gets a new, empty directory: --run-dir, or RUNS_ROOT/NAME-YYYYMMDD-HHMMSS where
RUNS_ROOT is $DSFORGE_RUNS or ./runs (relative to where dsforge is started). Resuming, and the
nodes after the first with --no-ssh, use the directory that exists. In it:
  job.log          everything the launcher and the ranks printed (engine logs included)
  recipe.yaml      the resolved recipe;  manifest.json, metrics.jsonl, summary.json
  ranks/, heartbeats/, failures/, checkpoints/
Beside it, NAME.lock: held (flock) by the dsforge that owns the directory while it runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from dsforge.lock import Busy, Lock, hold_directory

JOB_LOG = "job.log"
RECIPE = "recipe.yaml"  # the resolved recipe, as the ranks wrote it


class RunDirError(ValueError):
    pass


def runs_root(environ=os.environ) -> Path:
    return Path(environ.get("DSFORGE_RUNS") or "runs")


# What an earlier run leaves behind. With --no-ssh, other nodes of the same job may already
# have written their own files (pid files, heartbeats) when node 0 looks: only these count.
EARLIER_RUN = ("metrics.jsonl", "summary.json", "checkpoints")


def new_run_dir(run_dir: Path | None, name: str, *, create: bool = True,
                peers_may_join: bool = False) -> Path:
    """`run_dir`, or a fresh one under runs_root(); it must be empty so no earlier run's
    metrics are mixed in. (With `create`, call `claim` before relying on the emptiness: two
    runs may check at the same moment.)"""
    if run_dir is None:
        run_dir = runs_root() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    _check_empty(run_dir, peers_may_join)
    if create:
        _make(run_dir)
    return run_dir


def claim(run_dir: Path, *, fresh: bool, peers_may_join: bool = False) -> Lock:
    """Own `run_dir` for this process's lifetime (dsforge/lock.py: a flock beside it, and no
    live process of an earlier job in it). A `fresh` directory is checked again for
    emptiness once owned, so of two runs started together one is refused. With
    `peers_may_join` (--no-ssh node 0) other nodes' processes of this same job may already
    run here (several nodes on one machine), so live job processes are not waited for."""
    try:
        lock = hold_directory(run_dir, what=f"dsforge run (run directory {run_dir})",
                              check_jobs=not peers_may_join)
    except Busy as busy:
        raise RunDirError(f"{busy}; wait for it to end, or choose another --run-dir") from None
    if fresh:
        try:
            _check_empty(run_dir, peers_may_join)
        except RunDirError:
            lock.release()
            raise
    return lock


def _check_empty(run_dir: Path, peers_may_join: bool = False) -> None:
    if peers_may_join:
        used = any((run_dir / name).exists() for name in EARLIER_RUN)
    else:
        used = run_dir.exists() and any(run_dir.iterdir())
    if used:
        raise RunDirError(f"--run-dir {run_dir} is not empty; choose a new directory so no "
                          "earlier run's metrics are mixed in")


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
