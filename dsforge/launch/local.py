"""Run a job's launcher (dsforge's on this machine, launch/node.py; DeepSpeed's runner over a
hostfile; srun), and always end its ranks.

The launcher runs in a new session (its own process group), so every rank it spawns can be
ended by signalling the group: on Ctrl-C or SIGHUP, on a wall-clock timeout, when a stop
request's grace runs out, or when dsforge exits. A SIGKILLed dsforge cannot do it: the
launcher runs under a keeper that the kernel tells of dsforge's death and that then kills the
group (launch/keeper.py), and the ranks' supervisors watch for it too (job/owner.py).
The launcher itself ends all ranks when one of them fails.

SIGTERM and SIGUSR1 (a scheduler's preemption, a time limit's warning) ask the ranks to save a
checkpoint and stop (runtime/guard/preempt.py): dsforge passes the signal to each rank of this host
by pid (RUN_DIR/ranks/rankNNNNN.pid), never to the launcher, which would SIGKILL its ranks 30 s
after a SIGTERM, whatever they are writing. The ranks agree among themselves, so ranks on other
hosts stop too. Only when `stop_grace_s` runs out, or a second signal comes, is the group
stopped at once. Under Slurm the launcher is srun (launch/slurm.py), and the request goes to
srun as SIGUSR1, which srun passes to every task.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from dsforge.job.run_dir import RunDir
from dsforge.job.pids import started_ranks
from dsforge.job.signals import STOP_SIGNALS
from dsforge.launch.keeper import keeper_command
from dsforge.job.owner import current_owner
from dsforge.lock import job_word_of

EXIT_TIMEOUT = 124  # the job ran past --timeout (as coreutils' timeout exits)
# How long ranks get to exit after the group is signalled before it is killed.
GRACE_S = 10.0
# How long ranks get to save a checkpoint and exit after a stop request (`--stop-grace`).
STOP_GRACE_S = 300.0
_RANK_PROGRAM = b"dsforge.runtime.rank"
# Between the two SIGINTs that make srun end its tasks (srun(1): twice within one second).
SRUN_SECOND_INTERRUPT_S = 0.2
# How long a stop request waits for srun's tasks to start before it is sent to srun anyway.
SRUN_START_WAIT_S = 60.0
# How long the output copier may take to drain what the killed job left in the pipe.
READER_JOIN_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(command: list[str], *, timeout_s: float | None = None, env: dict | None = None,
            log_path: Path | None = None, on_line: Callable[[str], None] | None = None,
            run_dir: RunDir | None = None, stop_grace_s: float = STOP_GRACE_S,
            srun_ranks: int = 0, asked: StopAsked | None = None) -> int:
    """Run the launcher to completion; returns its exit code (124 on timeout, 130 on Ctrl-C,
    128 + N when dsforge receives signal N and stops the job at once: 129 for SIGHUP, 143 for
    a second SIGTERM or when the stop grace runs out).

    With `log_path` its output goes there; with `on_line` too, each line is also handed to
    `on_line` as it arrives (the terminal view of `dsforge run`). With `run_dir`, SIGTERM and
    SIGUSR1 ask the job's ranks to save and stop, and SIGUSR2 makes them print their stacks.
    `srun_ranks` > 0: the command is srun starting that many ranks (launch/slurm.py); those
    requests go to srun, which passes them to its tasks wherever they run. `asked` notes the
    first stop dsforge was asked for (a signal, Ctrl-C), whatever the job then ended with; one
    noted before the launcher started (between a restart's attempts) stops this job too."""
    asked = asked or StopAsked()
    if not srun_ranks:  # srun's tasks are Slurm's, outside the group a keeper would end
        command = keeper_command(command)
    out = open(log_path, "ab") if log_path else None
    piped = on_line is not None
    # Caught before the launcher starts, so that no signal finds dsforge with a launcher it
    # has not yet recorded (or with its default action: dead, the job without its owner).
    with StopSignals(asked) as signals:
        proc = subprocess.Popen(command, start_new_session=True, env=env,
                                stdout=subprocess.PIPE if piped else out,
                                stderr=subprocess.STDOUT if piped or out else None)
        reader = _copy_lines(proc.stdout, out, on_line) if piped else None
        try:
            return _watch(proc, signals, timeout_s=timeout_s, run_dir=run_dir,
                          stop_grace_s=stop_grace_s, srun_ranks=srun_ranks)
        except (GraceOver, subprocess.TimeoutExpired, KeyboardInterrupt, Stopped) as ended:
            signals.stopping(at_once=lambda: _kill_group(proc.pid))
            return _stop(proc, ended, asked=asked, srun=bool(srun_ranks))
        finally:
            # Disarmed: a signal from here on ends what is left at once instead of raising
            # out of the clean-up.
            signals.stopping(at_once=lambda: _kill_group(proc.pid))
            _kill_group(proc.pid)  # nothing of the job outlives dsforge
            if reader is not None:
                reader.join(timeout=READER_JOIN_S)
            if out:
                out.close()


def _watch(proc: subprocess.Popen, signals: StopSignals, *, timeout_s: float | None,
           run_dir: RunDir | None, stop_grace_s: float, srun_ranks: int) -> int:
    """The launcher's exit code; a stop request (SIGTERM, SIGUSR1) lets the ranks save and
    stop first. Raises what stops the job at once: a second signal or Ctrl-C, the end of the
    grace, --timeout."""
    started = time.time()
    if run_dir:
        signals.on_usr2 = lambda: signal_ranks(run_dir, proc.pid, signal.SIGUSR2)
    if srun_ranks:
        signals.on_usr2 = lambda: _signal_pid(proc.pid, signal.SIGUSR2)
    try:
        signals.arm()
        return proc.wait(timeout=timeout_s)
    except Stopped as stop:
        if run_dir is None or stop.signum not in STOP_SIGNALS:
            raise
        if srun_ranks:
            return _save_and_stop_srun(proc, run_dir, stop.signum, stop_grace_s,
                                       ranks=srun_ranks, since=started)
        return _save_and_stop(proc, run_dir, stop.signum, stop_grace_s)


def _stop(proc: subprocess.Popen, ended: BaseException, *, asked: StopAsked, srun: bool) -> int:
    """Stop the job at once for what `ended` it (_watch's exceptions), saying why; the exit
    code."""
    if isinstance(ended, GraceOver):
        print(f"dsforge: the ranks did not stop within the grace of {ended.grace_s:.0f}s; "
              "stopping every rank now", file=sys.stderr)
        stop_group(proc, signal.SIGTERM)
        return 128 + ended.signum
    if isinstance(ended, subprocess.TimeoutExpired):
        print(f"dsforge: job exceeded {ended.timeout:.0f}s; stopping every rank", file=sys.stderr)
        stop_group(proc, signal.SIGTERM)
        return EXIT_TIMEOUT
    if isinstance(ended, KeyboardInterrupt):
        asked.note(signal.SIGINT)
        print("dsforge: interrupted; stopping every rank", file=sys.stderr)
        if srun:  # srun reports its tasks on one SIGINT; a second within 1 s ends them
            _signal_group(proc.pid, signal.SIGINT)
            time.sleep(SRUN_SECOND_INTERRUPT_S)
        stop_group(proc, signal.SIGINT)
        return 130
    print(f"dsforge: {signal.Signals(ended.signum).name} received; stopping every rank",
          file=sys.stderr)
    stop_group(proc, signal.SIGTERM)
    return 128 + ended.signum


def _copy_lines(stream, out, on_line: Callable[[str], None]) -> threading.Thread:
    """A thread that copies `stream` to `out` and hands each line to `on_line`; it ends when
    the last process holding the pipe is gone."""

    def copy() -> None:
        for raw in iter(stream.readline, b""):
            if out is not None:
                out.write(raw)
                out.flush()
            # Progress bars redraw with carriage returns: each redraw is a line of its own.
            for piece in raw.decode("utf-8", "replace").rstrip("\r\n").split("\r"):
                if piece:
                    on_line(piece)
        stream.close()

    thread = threading.Thread(target=copy, daemon=True, name="dsforge-job-output")
    thread.start()
    return thread


class StopAsked:
    """The first stop somebody asked dsforge for (a signal's number; None: none), kept across
    a job's attempts (launch/restart.py never restarts a job somebody asked to stop)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def note(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum


class Stopped(Exception):
    """dsforge itself was asked to stop (SIGTERM, SIGUSR1, SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class GraceOver(Exception):
    """The ranks asked to save and stop (after signal `signum`) are still running after
    `grace_s` seconds."""

    def __init__(self, signum: int, grace_s: float):
        super().__init__(signum)
        self.signum, self.grace_s = signum, grace_s


class StopSignals:
    """dsforge's own signals, caught for as long as a job runs so that none ends dsforge by
    its default action (exit 143, the launcher left running without its owner): SIGTERM,
    SIGUSR1 and SIGHUP (what `timeout`, systemd, a scheduler and a dropped ssh session send)
    and Ctrl-C are noted in `asked`; once armed they raise too, Stopped or KeyboardInterrupt,
    where the code is ready for them, and `arm` raises for one noted before; while the job is
    being stopped (`stopping`), one more stops it at once. SIGUSR2 calls `on_usr2`. A signal
    dsforge was started with ignored (nohup's SIGHUP, a background job's SIGINT) stays ignored.
    (Handlers can only be installed from the main thread; elsewhere the defaults stay.)"""

    def __init__(self, asked: StopAsked):
        self.asked, self.armed = asked, False
        self.on_usr2: Callable[[], object] | None = None
        self.at_once: Callable[[], object] | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (*_STOPS, signal.SIGINT, signal.SIGUSR2):
                # A stop signal that dsforge was started with ignored stays ignored, as
                # Python itself leaves an ignored SIGINT: `nohup` ignores SIGHUP so that a
                # dropped session does not stop the job, a shell's background job SIGINT so
                # that the terminal's Ctrl-C does not reach it.
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._caught)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def arm(self) -> None:
        """From now on a signal raises; one noted before (while the launcher started, or
        between a restart's attempts) raises now."""
        self.armed = True
        if self.asked.signum is not None:
            _raise_for(self.asked.signum)

    def disarm(self) -> None:
        """From now on a signal is only noted (where the code must not be interrupted)."""
        self.armed, self.at_once = False, None

    def stopping(self, at_once: Callable[[], object]) -> None:
        """The job is being stopped: a signal now calls `at_once` instead of raising."""
        self.armed, self.at_once = False, at_once

    def _caught(self, signum: int, _frame) -> None:
        if signum == signal.SIGUSR2:
            if self.on_usr2 is not None:
                self.on_usr2()
            return
        self.asked.note(signum)
        if self.armed:
            _raise_for(signum)
        elif self.at_once is not None:
            self.at_once()


_STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


def _save_and_stop(proc: subprocess.Popen, run_dir: RunDir, signum: int, grace_s: float) -> int:
    """Ask every rank of this host to save and stop, and wait up to `grace_s` for the job to
    end (the launcher's exit code). Ranks that start later are asked as their pid files
    appear. A second signal raises Stopped, the end of the grace GraceOver."""
    print(f"dsforge: {signal.Signals(signum).name} received; every rank saves a checkpoint "
          f"after its current step and stops (grace {grace_s:.0f}s; a second signal stops the "
          "job at once)", file=sys.stderr, flush=True)
    asked: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        asked |= signal_ranks(run_dir, proc.pid, signum, skip=asked)
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise GraceOver(signum, grace_s) from None


def _save_and_stop_srun(proc: subprocess.Popen, run_dir: RunDir, signum: int, grace_s: float, *,
                        ranks: int, since: float) -> int:
    """`_save_and_stop` for ranks started by srun: one SIGUSR1 to srun, which passes it to
    every task (SIGTERM would make srun kill them). It is sent once every rank of this job has
    written its pid file (a task that has not yet installed its handlers would die of it), or
    after SRUN_START_WAIT_S when the run directory is not shared and remote files never come."""
    print(f"dsforge: {signal.Signals(signum).name} received; every rank saves a checkpoint "
          f"after its current step and stops (grace {grace_s:.0f}s; a second signal stops the "
          "job at once)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + grace_s
    give_up_waiting = time.monotonic() + SRUN_START_WAIT_S
    sent = False
    while True:
        if not sent and (_ranks_started_since(run_dir, since) >= ranks
                         or time.monotonic() > give_up_waiting):
            _signal_pid(proc.pid, signal.SIGUSR1)
            sent = True
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise GraceOver(signum, grace_s) from None


def _ranks_started_since(run_dir: RunDir, since: float) -> int:
    """Pid files written by this job's ranks (a resumed run's directory holds older ones)."""
    count = 0
    for _, path in run_dir.pid_files():
        try:
            count += path.stat().st_mtime >= since - 1.0  # 1 s: coarse file-system clocks
        except OSError:
            continue
    return count


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def signal_ranks(run_dir: RunDir, pgid: int, sig: int, skip: set[int] = frozenset()) -> set[int]:
    """Send `sig` to every rank of this host that wrote its pid file (launch/diagnose.py) and
    is a rank of this job: in process group `pgid` or with a job word whose owner is this
    process (over a hostfile pdsh starts even this host's ranks through ssh, whose sshd gives
    them a session of their own; the run directory alone would also name the ranks another
    --no-ssh node's dsforge started there), running the rank program, and the child of a
    rank's supervisor (runtime/guard/supervise.py), which would pass the signal on a second
    time. Returns the pids signalled (not those in `skip`)."""
    host, sent, owner = socket.gethostname(), set(), current_owner()
    for where in started_ranks(run_dir).values():
        rank_host, _, pid_text = where.partition(" ")
        if rank_host != host or not pid_text.isdigit() or int(pid_text) in skip:
            continue
        pid = int(pid_text)
        try:
            ours = os.getpgid(pid) == pgid or (job_word_of(pid) or {}).get("owner") == owner
            if not ours or not _is_supervised_rank(pid):
                continue
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        sent.add(pid)
    return sent


def _is_supervised_rank(pid: int) -> bool:
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return all(_RANK_PROGRAM in Path(f"/proc/{p}/cmdline").read_bytes() for p in (pid, parent))
    except (OSError, ValueError, IndexError):
        return False


def stop_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the job's process group, then kill whatever is left after the grace period."""
    _signal_group(proc.pid, sig)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    _kill_group(proc.pid)
    proc.wait()


def _kill_group(pgid: int) -> None:
    _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
