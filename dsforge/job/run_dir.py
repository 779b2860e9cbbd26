"""The run directory as code (`RunDir`), and who may use a run directory.

A new run gets a new, empty directory: --run-dir, or RUNS_ROOT/NAME-YYYYMMDD-HHMMSS where
RUNS_ROOT is $DSFORGE_RUNS or ./runs (relative to where dsforge is started). Resuming, and the
nodes after the first with --no-ssh, use the directory that exists. What is in it is
`RunDir`'s members (listed in docs/launch.md, "Run directories"); no other module spells one of
their names.
Beside it, NAME.lock: held (flock) by the dsforge that owns the directory while it runs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dsforge.lock import Busy, Lock, hold_directory


@dataclass(frozen=True)
class RunDir:
    """One run directory; each entry a named member. Per-rank files are named rankNNNNN (five
    digits, so they sort by rank) with a suffix that says what they hold."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __str__(self) -> str:  # messages name the directory as the user gave it
        return str(self.path)

    def absolute(self) -> RunDir:
        """The same directory named from the root, symbolic links resolved: what a job word
        carries to every rank and what tags the job's processes (dsforge/lock.py)."""
        return RunDir(self.path.resolve())

    @property
    def job_log(self) -> Path:
        """Everything the launcher and the ranks printed (engine logs included)."""
        return self.path / "job.log"

    @property
    def recipe(self) -> Path:
        """The resolved recipe, as the ranks wrote it."""
        return self.path / "recipe.yaml"

    @property
    def metrics(self) -> Path:
        """One JSON line per step and per validation (job/metrics_file.py)."""
        return self.path / "metrics.jsonl"

    @property
    def hostfiles(self) -> Path:
        """The hosts each attempt runs on, as its launcher reads them (DeepSpeed's hostfile,
        Slurm's SLURM_HOSTFILE): written before the last attempt's records are set aside."""
        return self.path / "hostfiles"

    @property
    def requeue_exclude(self) -> Path:
        """Under Slurm, the nodes a job left out and could not do without (launch/restart.py):
        `dsforge sbatch`'s script requeues the job excluding them, then removes the file."""
        return self.path / "requeue_exclude"

    @property
    def summary(self) -> Path:
        """The run's summary, written by rank 0 when the run ends."""
        return self.path / "summary.json"

    @property
    def manifest(self) -> Path:
        """Versions, devices and implementations the run used."""
        return self.path / "manifest.json"

    @property
    def anomalies(self) -> Path:
        """One JSON line per step the guard found bad: non-finite or a loss spike, with what
        it did and the step's data (runtime/guard/health.py)."""
        return self.path / "anomalies.jsonl"

    @property
    def checkpoints(self) -> Path:
        """Checkpoints: stepNNNNNNNN/ and `latest` (ckpt/trust.py)."""
        return self.path / "checkpoints"

    @property
    def profile(self) -> Path:
        """The torch profiler's traces (`dsforge run --profile`)."""
        return self.path / "profile"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb(self) -> Path:
        """W&B's own files (wandb.init(dir=RUN_DIR) makes the folder)."""
        return self.path / "wandb"

    @property
    def reference(self) -> RunDir:
        """`dsforge run --tiny`'s single-rank reference run: a run directory of its own."""
        return RunDir(self.path / "reference")

    @property
    def bench_result(self) -> Path:
        """A `dsforge bench` cell's row, written when the cell is done (cells only)."""
        return self.path / "result.json"

    @property
    def ranks(self) -> Path:
        """Each rank's summary (rankNNNNN.json) and pid file (rankNNNNN.pid)."""
        return self.path / "ranks"

    @property
    def failures(self) -> Path:
        """Each failing rank's record (rankNNNNN.json, job/failure.py)."""
        return self.path / "failures"

    @property
    def heartbeats(self) -> Path:
        """Each rank's step and time of its last progress (rankNNNNN, job/heartbeat.py)."""
        return self.path / "heartbeats"

    @property
    def drills(self) -> Path:
        """What the drills of DSFORGE_INJECT_FAULT left for the whole run, every attempt
        (runtime/guard/drills.py): a host marked down, a drill that fires once."""
        return self.path / "drills"

    @property
    def attempts(self) -> Path:
        """What each earlier attempt left (`set_aside`, before a restart or a --resume):
        attempts/N/ holds attempt N's failures/, heartbeats/ and ranks/, and everything it
        wrote when the job restarted from the start."""
        return self.path / "attempts"

    def attempt(self, number: int) -> RunDir:
        return RunDir(self.attempts / str(number))

    def next_attempt(self) -> RunDir:
        """attempts/N for the next attempt set aside: one more than the highest there."""
        taken = [int(p.name) for p in self.attempts.glob("*") if p.name.isdigit()]
        return self.attempt(max(taken, default=0) + 1)

    def rank_summary(self, rank: int) -> Path:
        return self.ranks / f"{rank_name(rank)}.json"

    def rank_summaries(self) -> list[Path]:
        return sorted(self.ranks.glob("rank[0-9]*.json"))

    def pid_file(self, rank: int) -> Path:
        return self.ranks / f"{rank_name(rank)}.pid"

    def pid_files(self) -> Iterator[tuple[int, Path]]:
        yield from _per_rank(self.ranks.glob("rank[0-9]*.pid"))

    def failure(self, rank: int) -> Path:
        return self.failures / f"{rank_name(rank)}.json"

    def failure_files(self) -> Iterator[tuple[int, Path]]:
        yield from _per_rank(self.failures.glob("rank[0-9]*.json"))

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / rank_name(rank)

    def heartbeat_files(self) -> Iterator[tuple[int, Path]]:
        yield from _per_rank(p for p in self.heartbeats.glob("rank[0-9]*") if not p.suffix)

    def earlier_run(self) -> bool:
        """Whether an earlier run left its results here. With --no-ssh, other nodes of the same
        job may already have written their own files (pid files, heartbeats): only these count."""
        return any(p.exists() for p in (self.metrics, self.summary, self.checkpoints))


def rank_name(rank: int) -> str:
    return f"rank{rank:05d}"


def _per_rank(paths) -> Iterator[tuple[int, Path]]:
    """(rank, path) for files named rankNNNNN[.suffix], in rank order; others are skipped."""
    found = []
    for path in paths:
        digits = path.name[4:].partition(".")[0]
        if digits.isdigit():
            found.append((int(digits), path))
    yield from sorted(found)


def set_aside(run_dir: RunDir, *, everything: bool = False) -> RunDir | None:
    """Move what the last attempt left that the next one must not read into
    run_dir.next_attempt(): its failure records (a stale one would be reported as the next
    attempt's cause, and would stop a supervisor recording its rank's death), heartbeats and
    pid files (a rank of an earlier, larger world would look silent; its pid may be reused).
    With `everything`, all it wrote (metrics, manifest, trackers' files, incomplete
    checkpoints) but the job log, which every attempt appends to, the recipe, earlier
    attempts, the hostfiles (the next attempt's is written first) and the drills' markers
    (a drill that fired once stays fired): for a start from
    scratch. The folder it made, or None with nothing to move."""
    moved = [run_dir.failures, run_dir.heartbeats, run_dir.ranks]
    if everything:
        stay = {run_dir.job_log, run_dir.recipe, run_dir.attempts, run_dir.hostfiles,
                run_dir.drills}
        moved = [p for p in run_dir.path.iterdir() if p not in stay]
    moved = [p for p in moved if p.exists()]
    if not moved:
        return None
    kept = run_dir.next_attempt()
    kept.path.mkdir(parents=True)
    for path in moved:
        os.replace(path, kept.path / path.name)
    return kept


class RunDirError(ValueError):
    pass


def runs_root(environ=os.environ) -> Path:
    return Path(environ.get("DSFORGE_RUNS") or "runs")


def new_run_dir(given: Path | None, name: str, *, create: bool = True,
                peers_may_join: bool = False) -> RunDir:
    """The --run-dir the user `given`, or a fresh one under runs_root(); it must be empty so no
    earlier run's metrics are mixed in. (With `create`, call `claim` before relying on the
    emptiness: two runs may check at the same moment.)"""
    run_dir = RunDir(given if given is not None
                     else runs_root() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    _check_empty(run_dir, peers_may_join)
    if create:
        _make(run_dir)
    return run_dir


def claim(run_dir: RunDir, *, fresh: bool, peers_may_join: bool = False) -> Lock:
    """Own `run_dir` for this process's lifetime (dsforge/lock.py: a flock beside it, and no
    live process of an earlier job in it). A `fresh` directory is checked again for
    emptiness once owned, so of two runs started together one is refused. With
    `peers_may_join` (--no-ssh node 0) other nodes' processes of this same job may already
    run here (several nodes on one machine), so live job processes are not waited for."""
    try:
        lock = hold_directory(run_dir.path, what=f"dsforge run (run directory {run_dir})",
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


def _check_empty(run_dir: RunDir, peers_may_join: bool = False) -> None:
    if peers_may_join:
        used = run_dir.earlier_run()
    else:
        used = run_dir.path.exists() and any(run_dir.path.iterdir())
    if used:
        raise RunDirError(f"--run-dir {run_dir} is not empty; choose a new directory so no "
                          "earlier run's metrics are mixed in")


def existing_run_dir(given: Path | None, *, resume: bool, create: bool = True) -> RunDir:
    """The run directory to resume (--resume: it must exist) or to join (--no-ssh node ranks
    > 0: node 0's, made here if node 0 has not made it yet)."""
    if given is None:
        raise RunDirError("--resume needs --run-dir: the run directory to continue (the one a run "
                          "names first, runs/NAME-DATE)" if resume else
                          "--no-ssh node ranks > 0 need --run-dir: the directory node 0's run writes")
    run_dir = RunDir(given)
    if resume and not run_dir.path.is_dir():  # refused before anything is made there
        raise RunDirError(f"--resume: {run_dir} does not exist, so there is nothing to resume; give "
                          "the run directory a run wrote (it names it first: 'run directory "
                          "runs/NAME-DATE'), or start anew without --resume")
    if create:
        _make(run_dir)
    return run_dir


def _make(run_dir: RunDir) -> None:
    """Create it and check that it can be written, before any rank starts."""
    try:
        run_dir.path.mkdir(parents=True, exist_ok=True)
        probe = run_dir.path / ".dsforge-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(f"cannot write the run directory {run_dir}: {exc.strerror}; choose a "
                          "writable place with --run-dir, or set DSFORGE_RUNS") from None
