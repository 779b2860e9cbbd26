"""A job's processes end when the `dsforge` that started them is gone, however it went.

`dsforge run` stops its job on Ctrl-C, SIGTERM, SIGHUP and timeouts by signalling the job's
process group. A SIGKILLed dsforge can do nothing, and the launcher (dsforge's, or DeepSpeed's
runner, its launcher and pdsh) would keep the job going without it. Two watchers end it
instead, neither of which needs a write to succeed first (the stderr a message would go to is
the pipe only the dead dsforge read: a print there raises BrokenPipeError):

- On dsforge's host, the keeper (launch/keeper.py) between dsforge and the launcher: the
  kernel signals it the moment its parent dies (`die_with_parent`), and it kills the job's
  process group at once, whatever stage the job is at (starting, training, saving).
- Every rank's supervisor (runtime/guard/supervise.py, a small process that never imports
  torch, so neither a stopped rank nor a rank blocked in a collective holds it up) checks
  every CHECK_EVERY_S that its owner still runs (`owner_gone`): on the owner's host by its PID
  and the PID's start time (which tells a reused PID apart), which the job word names; on
  every host by the pipe its output goes to, whose reader is gone once the job's processes on
  dsforge's host are (dsforge's own pipe, or over pdsh the ssh session that dies with them).
  When the owner is gone, it kills its own process group: the launcher and every rank of its
  node. So the ranks on other hosts end within a check of their pipe closing, without waiting
  for a collective to time out.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import stat
import threading
import time

CHECK_EVERY_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat_line = f.read()
    except OSError:
        return None
    fields = stat_line[stat_line.rindex(")") + 2:].split()  # after "pid (command) "
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


def output_orphaned(fd: int = 1) -> bool:
    """Whether `fd` is a pipe or socket nobody reads any more (asked of the kernel, never by
    writing). A file or a terminal is never orphaned."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR (a pipe without readers) and POLLHUP are always reported
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def owner_gone(owner: str) -> bool:
    return owner_alive(owner) is False or output_orphaned()


def watch_owner(owner: str, *, every_s: float = CHECK_EVERY_S) -> None:
    """A thread that kills this process group once `owner` is gone (nothing for "": a job
    nobody owns, started by a plain `deepspeed` command)."""
    if not owner:
        return

    def watch() -> None:
        while not owner_gone(owner):
            time.sleep(every_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="dsforge-owner-watch").start()


def die_with_parent(signum: int, parent: int) -> bool:
    """Have the kernel send this process `signum` when `parent` (its parent now) exits; False
    when `parent` is gone already, so the signal will never come. (Without prctl, not Linux,
    the other watchers remain.)"""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass
    return os.getppid() == parent
