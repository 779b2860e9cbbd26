"""Start a job's ranks on this machine through DeepSpeed's launcher, and always end them.

The launcher runs in a new session (its own process group), so every rank it spawns can be
ended by signalling the group: on Ctrl-C, on a wall-clock timeout, or when dsforge exits.
DeepSpeed's launcher itself ends all ranks when one of them fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# How long ranks get to exit after SIGINT/SIGTERM before the group is killed.
GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(command: list[str], *, timeout_s: float | None = None, env: dict | None = None,
            log_path: Path | None = None) -> int:
    """Run the launcher to completion; returns its exit code (124 on timeout, 130 on Ctrl-C)."""
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(command, start_new_session=True, env=env,
                            stdout=out or None, stderr=subprocess.STDOUT if out else None)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"dsforge: job exceeded {timeout_s:.0f}s; stopping every rank", file=sys.stderr)
        stop_group(proc, signal.SIGTERM)
        return 124
    except KeyboardInterrupt:
        print("dsforge: interrupted; stopping every rank", file=sys.stderr)
        stop_group(proc, signal.SIGINT)
        return 130
    finally:
        _kill_group(proc.pid)  # nothing of the job outlives dsforge
        if out:
            out.close()


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
