"""`dsforge run --max-restarts N` through its launcher on 2 CPU ranks: a rank SIGKILLed
mid-run comes back and the run ends 0 with the uninterrupted run's losses; a second loss with
the budget used up ends with that failure's report and a summary that keeps both; an exception
is not retried; a failed collective (the collective drill) is, and trains on to the same losses;
nothing of any attempt is left running. (The policy itself: tests/unit/test_restart.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dsforge.job.metrics_file import read_metrics
from dsforge.job.run_dir import RunDir
from tests.conftest import REPO
from tests.distributed.test_run import _job_processes, dsforge

TINY = str(REPO / "recipes" / "tiny.yaml")
RUN = ["--set", "train.steps=40", "--set", "train.checkpoint_every=2", "--step-timeout", "60"]
TIMEOUT_S = 420


def losses(run_dir: RunDir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir.metrics)[0]}


def _beat(run_dir: RunDir, rank: int) -> int:
    try:
        return int(run_dir.heartbeat(rank).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def kill_rank_at(run_dir: RunDir, rank: int, step: int, *, after_restarts: int,
                  deadline: float) -> int:
    """SIGKILL `rank` (its pid file) once the attempt after `after_restarts` restarts has it
    past `step`; the pid killed."""
    while time.monotonic() < deadline:
        if run_dir.attempt(after_restarts).path.exists() or after_restarts == 0:
            if not (run_dir.attempt(after_restarts + 1).path.exists()) and \
                    _beat(run_dir, rank) >= step and run_dir.pid_file(rank).exists():
                pid = int(run_dir.pid_file(rank).read_text().split()[1])
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} never passed step {step}")


def run_killing(run_dir: RunDir, kills: list[tuple[int, int]], max_restarts: int,
                extra: tuple[str, ...] = (), env: dict | None = None):
    """`dsforge run` with restarts while a thread SIGKILLs (rank, past step) once per attempt;
    its exit code and stderr. `extra`: more options (a hostfile), `env`: more variables."""
    deadline = time.monotonic() + TIMEOUT_S
    proc = subprocess.Popen([sys.executable, "-m", "dsforge", "run", TINY, *RUN, *extra,
                             "--run-dir", str(run_dir), "--max-restarts", str(max_restarts)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    killed, errors = [], []

    def killer():
        try:
            for attempt, (rank, step) in enumerate(kills):
                killed.append(kill_rank_at(run_dir, rank, step, after_restarts=attempt,
                                            deadline=deadline))
        except AssertionError as exc:
            errors.append(exc)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    thread.join(timeout=5)
    assert not errors and len(killed) == len(kills), f"{errors}\n{stderr[-3000:]}"
    return proc.returncode, stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    reference = RunDir(tmp_path_factory.mktemp("reference") / "run")
    done = dsforge("run", TINY, *RUN, "--run-dir", str(reference), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(reference)


@pytest.mark.parametrize("saving, where", [
    ([], "from the checkpoint after step"),
    (["--set", "train.checkpoint_every=0"], "from the start"),  # no checkpoint to resume
])
def test_a_killed_rank_comes_back_and_trains_on_exactly(uninterrupted, tmp_path, saving, where):
    run_dir = RunDir(tmp_path / "run")
    code, stderr = run_killing(run_dir, [(1, 4)], max_restarts=2, extra=tuple(saving))
    assert code == 0, stderr[-4000:]
    assert f"dsforge: restarting (1 of 2) {where}" in stderr
    assert "finished after 1 restart" in stderr
    assert losses(run_dir) == uninterrupted  # bit for bit
    assert len(read_metrics(run_dir.metrics)[0]) == len(uninterrupted)  # every step once
    summary = json.loads(run_dir.summary.read_text())
    assert summary["restarts"] == 1
    cause = summary["restart_causes"][0]
    assert (cause["kind"], cause["attempt"]) == ("killed", 1) and "SIGKILL" in cause["message"]
    assert json.loads(run_dir.attempt(1).failure(1).read_text())["kind"] == "killed"
    assert not _job_processes(run_dir.path)


def test_a_used_up_budget_ends_with_the_last_failures_report(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    code, stderr = run_killing(run_dir, [(1, 4), (0, 12)], max_restarts=1)
    assert code != 0, stderr[-4000:]
    assert "restarting (1 of 1)" in stderr
    assert "not restarted: --max-restarts 1 is used up" in stderr
    report = stderr[stderr.rindex("dsforge: job failed"):]
    assert "first failure: rank 0 died" in report and "SIGKILL" in report
    summary = json.loads(run_dir.summary.read_text())  # the launcher's: no rank finished
    assert summary["restarts"] == 1 and summary["restart_causes"][0]["kind"] == "killed"
    final = summary["failure"]
    assert (final["attempt"], final["kind"], final["exit_code"]) == (2, "killed", code)
    assert final["cause"].startswith("rank 0 died at step") and "used up" in final["not_restarted"]
    assert not _job_processes(run_dir.path)
    # Continued by hand: the last attempt's records move aside, so its report is its own.
    done = dsforge("run", TINY, *RUN, "--run-dir", str(run_dir.path), "--resume",
                   timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(run_dir.attempt(2).failure(0).read_text())["kind"] == "killed"
    assert not run_dir.failures.exists() and sorted(losses(run_dir)) == list(range(40))


def test_an_exception_is_not_retried(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    done = dsforge("run", TINY, *RUN, "--run-dir", str(run_dir), "--max-restarts", "3",
                   env={"DSFORGE_INJECT_FAULT": "raise:1:3"}, timeout=TIMEOUT_S)
    assert done.returncode != 0
    assert "injected fault on rank 1 at step 4" in done.stderr
    assert "dsforge: not restarted: an exception repeats" in done.stderr, done.stderr[-3000:]
    assert "restarting" not in done.stderr and not run_dir.attempts.exists()
    assert not _job_processes(run_dir.path)


def test_a_failed_collective_is_retried_and_trains_on_exactly(uninterrupted, tmp_path):
    """The collective drill (once per run directory, as a link that flapped): its record's kind
    is retried, and the restart resumes from the last checkpoint to the uninterrupted losses."""
    run_dir = RunDir(tmp_path / "run")
    done = dsforge("run", TINY, *RUN, "--run-dir", str(run_dir), "--max-restarts", "1",
                   env={"DSFORGE_INJECT_FAULT": "collective:1:5"}, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "restarting (1 of 1) from the checkpoint after step" in done.stderr, done.stderr[-3000:]
    cause = json.loads(run_dir.summary.read_text())["restart_causes"][0]
    assert cause["kind"] == "collective" and "collective drill" in cause["message"], cause
    assert losses(run_dir) == uninterrupted
    assert not _job_processes(run_dir.path)
