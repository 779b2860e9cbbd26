"""A rank's background writer: one thread that saves one checkpoint at a time while training
goes on (`train.checkpoint_async`).

The training thread hands it a job (copy a snapshot into host memory, then write its files) and
goes on; `busy()` says whether the job still runs, `succeeded()` whether it ended well,
`wait()` waits for it and raises what it raised, as the training thread's own error (a full
disk is then the rank's failure, reported like any other). At most one job is in flight:
`submit` waits for the one before. A thread rather than a process: the copies and the file
writes run outside the GIL, so the training thread's Python goes on beside them; what a
background save costs the steps beside it is measured in benchmarks/checkpoints. The thread is
a daemon: a rank that ends without waiting (it failed) leaves the checkpoint unpublished, so
invisible.
"""

from __future__ import annotations

import os
import threading
from typing import Callable


class BackgroundWriter:
    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), name="dsforge-writer",
                                        daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def succeeded(self) -> bool:
        """The job handed over last has ended without an error (or there was none)."""
        return not self.busy() and self._error is None

    def wait(self) -> None:
        """Until the job in flight is done; raises what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self, job: Callable[[], None]) -> None:
        _lowest_priority()
        try:
            job()
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc


def _lowest_priority() -> None:
    """The writer thread at nice 19 (Linux sets it per thread): where training computes on the
    CPU cores, a write at the same priority took a core from every step it ran beside (2x their
    time on 2 cores, benchmarks/checkpoints); at the lowest it takes what training leaves, and
    the next save waits for it if it must."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux: the writer keeps the process's priority
        pass
