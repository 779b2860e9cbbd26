"""Each rank process is two: a small supervisor and the rank it forks.

Only a process's parent learns how it ended. The launcher (dsforge's or DeepSpeed's) is the
rank's parent and logs one exit code for the whole node, so a rank killed from outside
(SIGKILL, the kernel's out-of-memory killer, a segfault in a kernel) would die without a word
while its peers report "connection reset". The supervisor forks before torch is imported
(cheap: no threads, no engines), waits for the rank, and records how it ended when the rank
wrote no failure record of its own (job/failure.py): kind "killed" for a signal, "exited" for
an error code, "stopped" when it was stopped from outside and never continued, stamped with the
moment it stopped (its peers then waited for it until their watchdogs gave up). It ends the
same way, so the launcher sees the same exit status. Signals sent to it (SIGINT, SIGHUP;
SIGTERM and SIGUSR1, which ask the rank to save a checkpoint and stop,
runtime/guard/preempt.py; SIGUSR2 for stacks) are passed on, so whoever signals the process it
started reaches the rank; the rank dies with its supervisor (PR_SET_PDEATHSIG). Under srun they
are not passed on: Slurm signals every process of a task (srun's forwarding and `scancel
--signal` go through its process tracking), so the rank has them already, and a second stop
request would end it at once.

The supervisor also watches the job's owner (job/owner.py): it never imports torch and only
waits, so it notices a dead `dsforge run` even while its rank is stopped, or blocked in a
collective, and kills the node's part of the job.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

from dsforge.job import failure
from dsforge.job.owner import die_with_parent, watch_owner
from dsforge.job.run_dir import RunDir

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STOP_REQUESTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
# Signals that end a rank as a failure of its own. SIGINT, SIGTERM and SIGHUP are requests to
# stop: the launcher sends SIGTERM to every rank of a node once one of them failed,
# and dsforge stops jobs with them; recording those would hide the rank that failed first.
FAILURES = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE,
            signal.SIGILL)


def run_supervised(run: Callable[[], None], *, run_dir: RunDir, rank: int,
                   forward: bool = True, owner: str = "") -> None:
    """Run `run` (which never returns) in a forked child and end as it ends. `forward`:
    pass FORWARDED signals on to the child; else only survive them (the child gets its own).
    `owner`: the job word's; the node's part of the job ends when it is gone."""
    supervisor = os.getpid()
    child = os.fork()
    if child == 0:
        if not die_with_parent(signal.SIGKILL, supervisor):
            os._exit(1)  # the supervisor died before the rank could be tied to it
        run()
        os._exit(0)
    watch_owner(owner)  # a thread, started after the fork
    state = _Child(child)
    for sig in FORWARDED:
        signal.signal(sig, (lambda signum, _frame: state.forward(signum)) if forward
                      else (lambda _signum, _frame: None))
    status = state.wait()
    ended_by = state.ended_by or (os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
    if state.stop is not None and ended_by is not None:  # a signal ended it while stopped
        _record_stop(run_dir, rank, state.stop, ended_by=ended_by)
    if state.ended_by is not None:  # stopped from outside, then asked to stop: ended for it
        _end_like(state.ended_by)
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) in FAILURES and state.stop is None:
            _record_kill(run_dir, rank, os.WTERMSIG(status))
        _end_like(os.WTERMSIG(status))
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        _record_exit(run_dir, rank, code)
    os._exit(code)


class _Child:
    """The rank process as its supervisor sees it: running, or stopped from outside (SIGSTOP,
    SIGTSTP). A stop request to a stopped rank cannot be a request to save (the rank would
    wake, find its peers gone and report their failure as its own), so the rank is ended at
    once and its supervisor ends by the requested signal, after recording that the rank was
    stopped: the job's report names it as the first failure, not the peers that waited for it."""

    def __init__(self, pid: int):
        self.pid, self.ended_by = pid, None
        self.stop: tuple[int, float] | None = None  # (signal, unix time) while stopped

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def forward(self, signum: int) -> None:
        try:
            if self.stopped and signum in STOP_REQUESTS:
                self.ended_by = signum
                os.kill(self.pid, signal.SIGKILL)
                return
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        while True:
            try:
                _, status = os.waitpid(self.pid, os.WUNTRACED | os.WCONTINUED)
            except InterruptedError:  # a forwarded signal arrived
                continue
            if os.WIFSTOPPED(status):  # the first stop counts (it is when its peers began waiting)
                self.stop = self.stop or (os.WSTOPSIG(status), time.time())
                continue
            if os.WIFCONTINUED(status):
                self.stop = None
                continue
            return status


def _record_kill(run_dir: RunDir, rank: int, signum: int) -> None:
    name = signal.Signals(signum).name
    hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if signum == signal.SIGKILL else ""
    _record_ending(run_dir, rank, "killed", f"killed by {name}{hint}")


def _record_ending(run_dir: RunDir, rank: int, kind: str, message: str) -> None:
    """A record of how the rank ended, unless it wrote its own before (then that one is
    right)."""
    if any(f.rank == rank for f in failure.read_all(run_dir)):
        return
    from dsforge.job.heartbeat import read_all

    beat = read_all(run_dir).get(rank)
    failure.write(run_dir, failure.Failure(rank=rank, step=beat[0] if beat else -1, kind=kind,
                                           message=message))


def _record_exit(run_dir: RunDir, rank: int, code: int) -> None:
    """A rank that exited with an error code but wrote no record (something in it called
    exit: a library's exit(), an os._exit, a SystemExit that got past dsforge's handler): its
    peers then lose it in their next collective and would be taken for the cause."""
    _record_ending(run_dir, rank, "exited", f"with code {code} without a failure record of its "
                                            "own (something inside the rank ended the process)")


def _record_stop(run_dir: RunDir, rank: int, stop: tuple[int, float], *, ended_by: int) -> None:
    """A rank that ended while stopped from outside (SIGSTOP, SIGTSTP) did nothing since: its
    peers waited for it in their next collective until their watchdogs ended them. The record
    carries the moment it stopped, before any of theirs (job/failure.py puts it first)."""
    if any(f.rank == rank for f in failure.read_all(run_dir)):
        return  # it recorded a failure of its own before it was stopped
    from dsforge.job.heartbeat import read_all

    beat = read_all(run_dir).get(rank)
    signum, since = stop
    failure.write(run_dir, failure.Failure(
        rank=rank, step=beat[0] if beat else -1, kind="stopped", time=since,
        message=(f"{signal.Signals(signum).name} from outside, never continued (its peers waited "
                 f"for it); ended by {signal.Signals(ended_by).name} "
                 f"{max(0.0, time.time() - since):.0f}s later")))


def _end_like(signum: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if signum != signal.SIGKILL:  # SIGKILL's action cannot be set, and is already the default
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # the signal was ignored or blocked
