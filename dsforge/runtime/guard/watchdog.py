"""A rank's watchdog: ends the rank when a step makes no progress for `timeout_s`.

A hung collective never returns, so the check runs on its own thread. Before exiting it
records a "hang" failure with every thread's Python stack (job/failure.py), tells the
user which rank and step, and gives its peers a moment to do the same.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading
import time
import traceback

from dsforge.job import failure
from dsforge.job.console import RankConsole
from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text

# The other ranks are usually stuck too (waiting for this one): give their watchdogs time to
# record their stacks before this exit makes the launcher kill them.
DUMP_GRACE_S = 3.0
EXIT_CODE = 3


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
            if expired:
                self._end(step)

    def _end(self, step: int) -> None:
        message = (f"{step_text(step)} made no progress for {self.timeout_s:.0f}s (a hung collective?)")
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
