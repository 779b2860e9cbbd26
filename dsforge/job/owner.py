"""Ranks that end themselves when the `dsforge` that started them is gone.

`dsforge run` stops its job on Ctrl-C, SIGTERM, SIGHUP and timeouts by signalling the job's
process group. A SIGKILLed dsforge can do nothing, and DeepSpeed's runner and launcher would
keep training without it. So the job word names its owner (host, PID and the PID's start time,
which tells a reused PID apart), and every rank on the owner's host checks once a second that
the owner still runs; when it is gone, the rank kills its own process group: the runner, the
launcher and every rank of this node. Ranks on other hosts then lose their peers and fail on
the broken connection (or at the step timeout).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

CHECK_EVERY_S = 1.0


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (command) "
    state, start = fields[0], fields[19]
    return None if state in ("Z", "X") else start


def current_owner() -> str:
    """This process as an owner: "host:pid:start"."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def owner_alive(owner: str) -> bool | None:
    """Whether `owner` still runs; None when it is on another host (cannot be known here)."""
    host, pid, start = owner.rsplit(":", 2)
    if host != socket.gethostname():
        return None
    return _start_time(int(pid)) == start


def watch_owner(owner: str, *, every_s: float = CHECK_EVERY_S) -> None:
    """End this process group when `owner` is gone (no-op for "" or another host's owner)."""
    if not owner or owner_alive(owner) is None:
        return

    def watch() -> None:
        while owner_alive(owner):
            time.sleep(every_s)
        print(f"dsforge: the dsforge process that started this job ({owner}) is gone; "
              "ending the job's processes on this node", file=sys.stderr, flush=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="dsforge-owner-watch").start()
