"""The rank supervisor (runtime/guard/supervise.py): it ends as its rank ends, and records a rank
that a signal killed as a failure only when the signal was not a request to stop, and a rank
that exited with an error code without a record of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dsforge.job import failure
from dsforge.job.run_dir import RunDir

SCRIPT = """
import os, signal, sys, time
from dsforge.job.run_dir import RunDir
from dsforge.runtime.guard.supervise import run_supervised
how = sys.argv[2]
def rank():
    if how == "exit3":
        os._exit(3)
    if how == "recorded":  # a rank that says why it fails, as runtime/rank.py does
        from dsforge.job import failure
        failure.write(RunDir(sys.argv[1]), failure.Failure(rank=7, step=2, kind="exception",
                                                           message="RuntimeError: boom"))
        os._exit(1)
    os.kill(os.getpid(), getattr(signal, how))
    time.sleep(5)
run_supervised(rank, run_dir=RunDir(sys.argv[1]), rank=7)
"""


@pytest.mark.parametrize("how, code, recorded", [
    ("exit3", 3, True),  # an exit without a record of its own: its peers would be blamed
    ("recorded", 1, True),
    ("SIGKILL", -signal.SIGKILL, True),
    ("SIGSEGV", -signal.SIGSEGV, True),
    ("SIGTERM", -signal.SIGTERM, False),  # the launcher stopping the node's ranks
])
def test_supervisor_ends_like_its_rank(tmp_path, how, code, recorded):
    run_dir = RunDir(tmp_path)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(run_dir), how], timeout=60)
    assert done.returncode == code
    records = failure.read_all(run_dir)
    assert bool(records) == recorded
    if how == "recorded":  # its own record, not a second one
        assert [(r.rank, r.kind) for r in records] == [(7, "exception")]
    elif how == "exit3":  # its own kind: a restart does not retry it
        assert (records[0].rank, records[0].kind) == (7, "exited")
        assert "with code 3 without a failure record" in records[0].message
    elif recorded:
        assert records[0].rank == 7 and records[0].kind == "killed"
        assert f"killed by {how}" in records[0].message


# Issue 25 item 3: a rank stopped from outside (SIGSTOP) in a pp2 x vpp2 x dp2 job. It says
# nothing; its peers wait for it until their watchdogs record hangs and exit, and DeepSpeed's
# launcher then SIGTERMs every rank process (supervisors and ranks). The stopped rank must be
# the first failure, not the ranks that waited for it.
STOPPABLE = """
import os, socket, sys, time
from dsforge.job.pids import write_pid
from dsforge.job.run_dir import RunDir
from dsforge.runtime.guard.supervise import run_supervised
run_dir = RunDir(sys.argv[1])
def rank():
    write_pid(run_dir, 2, socket.gethostname(), os.getpid())  # as runtime/rank.py does
    time.sleep(60)
run_supervised(rank, run_dir=run_dir, rank=2)
"""


def _state(pid: int) -> str:
    """The process's state letter in /proc/PID/stat ('T': stopped), '' once it is gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _stopped_rank(run_dir: RunDir):
    """A supervised rank 2, stopped; heartbeats of a pp2 job's four ranks all at step 18."""
    from dsforge.job.pids import started_ranks

    supervisor = subprocess.Popen([sys.executable, "-c", STOPPABLE, str(run_dir)])
    deadline = time.monotonic() + 30
    while len(started_ranks(run_dir).get(2, "").split()) < 2:  # written, not renamed
        assert supervisor.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    rank = int(started_ranks(run_dir)[2].split()[1])
    beats = run_dir.heartbeats
    beats.mkdir(exist_ok=True)
    for peer in range(4):  # in a pipeline every rank starts the step the stopped one is on
        run_dir.heartbeat(peer).write_text(f"18 {time.time() - 0.5:.3f}\n")
    os.kill(rank, signal.SIGSTOP)
    while _state(rank) != "T":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)  # the supervisor sees the stop (waitpid WUNTRACED)
    return supervisor, rank


def _hangs(run_dir: RunDir, ranks):
    """What the peers' watchdogs record, after the stop (runtime/guard/watchdog.py)."""
    for peer in ranks:
        failure.write(run_dir, failure.Failure(
            rank=peer, step=18, kind="hang", detail='  File "p2p_communication.py", line 392\n',
            message="step 18 made no progress for 15s (a hung collective?)"))


@pytest.mark.parametrize("end", ["launcher SIGTERM", "SIGKILL"])
def test_a_stopped_rank_is_the_first_failure_not_the_peers_that_waited(tmp_path, end):
    """`end`: the launcher SIGTERMs the rank and its supervisor (the supervisor ends
    the stopped rank); or the stopped rank gets SIGKILL (Slurm's end of a task)."""
    from dsforge.launch.diagnose import failure_report

    run_dir = RunDir(tmp_path)
    supervisor, rank = _stopped_rank(run_dir)
    try:
        _hangs(run_dir, (3, 0, 1))
        if end == "SIGKILL":
            os.kill(rank, signal.SIGKILL)
            expected = -signal.SIGKILL
        else:
            os.kill(rank, signal.SIGTERM)  # pending: a stopped process does not act on it
            supervisor.send_signal(signal.SIGTERM)
            expected = -signal.SIGTERM
        assert supervisor.wait(timeout=20) == expected
    finally:
        _end(supervisor, rank)
    assert _state(rank) == ""
    first = failure.first(run_dir)
    assert (first.rank, first.kind, first.step) == (2, "stopped", 18)
    report = failure_report(run_dir, 3)
    ended = "SIGKILL" if end == "SIGKILL" else "SIGTERM"
    assert ("  first failure: rank 2 was stopped at step 19: SIGSTOP from outside, never "
            f"continued (its peers waited for it); ended by {ended} ") in report, report
    assert "killed by SIGKILL (out of memory?" not in report


def _end(supervisor, rank: int) -> None:
    """Whatever a test left running, ended by its saved pids."""
    for pid in (rank, supervisor.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    supervisor.wait()


def test_a_stopped_rank_that_was_continued_is_not_a_stop(tmp_path):
    run_dir = RunDir(tmp_path)
    supervisor, rank = _stopped_rank(run_dir)
    try:
        os.kill(rank, signal.SIGCONT)
        time.sleep(0.3)
        supervisor.send_signal(signal.SIGTERM)  # passed on: the rank ends by it, no record
        assert supervisor.wait(timeout=20) == -signal.SIGTERM
    finally:
        _end(supervisor, rank)
    assert failure.read_all(run_dir) == []
