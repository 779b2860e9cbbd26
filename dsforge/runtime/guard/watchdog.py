"""A rank's watchdog: ends the rank when a step makes no progress for `timeout_s`.

A hung collective never returns, so the check runs on its own thread. Before exiting it
records a "hang" failure with every thread's Python stack (job/failure.py), tells the
user which rank and step, and gives its peers a moment to do the same. Where the training
thread knowingly waits for something other than a collective (its checkpoint writer, the
disk), it says so with `waiting_for`, and the report names that instead of guessing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable

from dsforge.job import failure
from dsforge.job.console import RankConsole
from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text

# The other ranks are usually stuck too (waiting for this one): give their watchdogs time to
# record their stacks before this exit makes the launcher kill them.
DUMP_GRACE_S = 3.0
EXIT_CODE = 3

_waiting: "_Wait | None" = None  # what the training thread says it waits for (`waiting_for`)


class _Wait:
    def __init__(self, what: str, progress: Callable[[], int] | None):
        self.what, self.progress = what, progress
        self.seen = _read(progress)

    def moved(self) -> bool:
        """Whether its progress changed since it was last asked (or the wait began)."""
        now = _read(self.progress)
        moved, self.seen = now is not None and now != self.seen, now
        return moved


def _read(progress: Callable[[], int] | None) -> int | None:
    try:
        return None if progress is None else progress()
    except OSError:  # a file of the checkpoint it counts went away meanwhile
        return None


@contextlib.contextmanager
def waiting_for(what: str, progress: Callable[[], int] | None = None):
    """The training thread waits for `what` (words that follow "waiting for") in this block:
    a hang inside it is reported as that wait, not as a hung collective. `progress`: a count
    that grows while the wait is not hung (bytes on disk); while it grows, the step's deadline
    moves on (a large checkpoint written slowly is not a hang)."""
    global _waiting
    outer, _waiting = _waiting, _Wait(what, progress)
    try:
        yield
    finally:
        _waiting = outer


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, *, run_dir: RunDir, console: RankConsole):
        self.timeout_s, self.rank, self.run_dir, self.console = timeout_s, rank, run_dir, console
        self.step, self.deadline = -1, None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="dsforge-watchdog").start()

    def arm(self, step: int) -> None:
        with self._lock:
            self.step, self.deadline = step, time.monotonic() + self.timeout_s

    def disarm(self) -> None:
        with self._lock:
            self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                expired = self.deadline is not None and time.monotonic() > self.deadline
                step = self.step
            waiting = _waiting
            if expired and waiting is not None and waiting.moved():
                with self._lock:  # slow, not stuck: another timeout_s from now
                    self.deadline = time.monotonic() + self.timeout_s
            elif expired:
                self._end(step)

    def _end(self, step: int) -> None:
        waiting = _waiting
        cause = "a hung collective?" if waiting is None else f"waiting for {waiting.what}"
        message = f"{step_text(step)} made no progress for {self.timeout_s:.0f}s ({cause})"
        stacks = _all_stacks()
        failure.write(self.run_dir, failure.Failure(rank=self.rank, step=step, kind="hang",
                                                    message=message, detail=_main_stack()))
        self.console.say(f"dsforge: rank {self.rank} stuck: {message}")
        print(f"dsforge: rank {self.rank} stuck at {step_text(step)}. Python stacks:\n{stacks}",
              file=sys.stderr, flush=True)
        time.sleep(DUMP_GRACE_S)
        os._exit(EXIT_CODE)


def _main_stack() -> str:
    """Where the training thread is stuck, innermost call last (like a traceback)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


def _all_stacks() -> str:
    """Every thread's Python stack as text (faulthandler writes only to a real file)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.seek(0)
        return out.read()
