"""Start a job's ranks on this machine through DeepSpeed's launcher, and always end them.

The launcher runs in a new session (its own process group), so every rank it spawns can be
ended by signalling the group: on Ctrl-C, SIGTERM or SIGHUP, on a wall-clock timeout, or when
dsforge exits. A SIGKILLed dsforge cannot do it: the ranks then end the group themselves
(launch/owner.py). DeepSpeed's launcher itself ends all ranks when one of them fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

# How long ranks get to exit after SIGINT/SIGTERM before the group is killed.
GRACE_S = 10.0
# How long the output copier may take to drain what the killed job left in the pipe.
READER_JOIN_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(command: list[str], *, timeout_s: float | None = None, env: dict | None = None,
            log_path: Path | None = None, on_line: Callable[[str], None] | None = None) -> int:
    """Run the launcher to completion; returns its exit code (124 on timeout, 130 on Ctrl-C,
    128 + N when dsforge receives signal N: 143 for SIGTERM, 129 for SIGHUP).

    With `log_path` its output goes there; with `on_line` too, each line is also handed to
    `on_line` as it arrives (the terminal view of `dsforge run`)."""
    out = open(log_path, "ab") if log_path else None
    piped = on_line is not None
    proc = subprocess.Popen(command, start_new_session=True, env=env,
                            stdout=subprocess.PIPE if piped else out,
                            stderr=subprocess.STDOUT if piped or out else None)
    reader = _copy_lines(proc.stdout, out, on_line) if piped else None
    try:
        with _stop_on_signals():
            return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"dsforge: job exceeded {timeout_s:.0f}s; stopping every rank", file=sys.stderr)
        stop_group(proc, signal.SIGTERM)
        return 124
    except KeyboardInterrupt:
        print("dsforge: interrupted; stopping every rank", file=sys.stderr)
        stop_group(proc, signal.SIGINT)
        return 130
    except Stopped as stop:
        print(f"dsforge: {signal.Signals(stop.signum).name} received; stopping every rank",
              file=sys.stderr)
        stop_group(proc, signal.SIGTERM)
        return 128 + stop.signum
    finally:
        _kill_group(proc.pid)  # nothing of the job outlives dsforge
        if reader is not None:
            reader.join(timeout=READER_JOIN_S)
        if out:
            out.close()


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


class Stopped(Exception):
    """dsforge itself was asked to stop (SIGTERM, SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM and SIGHUP stop the job as Ctrl-C does: they are what `timeout`, systemd, a
    scheduler's preemption and a dropped ssh session send. (Handlers can only be installed
    from the main thread; elsewhere the defaults stay.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
