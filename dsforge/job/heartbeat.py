"""Per-rank heartbeats: the step each rank is on, so a stalled job can say who stalled where.

Each rank records the step it starts (`beat`, a memory write on the training loop's hot
path); a background thread rewrites RUN_DIR/heartbeats/rankNNNNN (`step unix_time`) when the
step changed, at most every WRITE_EVERY_S, so the file is at most that much behind. Writing
the file on every step cost ~1 ms per step (write + rename), measurable against tiny steps
(benchmarks/overhead). `summarize` reads them all (the launcher prints it when a job fails or
hangs).
"""

from __future__ import annotations

import os
import threading
import time

from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text

WRITE_EVERY_S = 0.25


class Heartbeat:
    def __init__(self, run_dir: RunDir, rank: int, write_every_s: float = WRITE_EVERY_S):
        self.path = run_dir.heartbeat(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._beat: tuple[int, float] | None = None  # (step, unix time it started)
        self._written: tuple[int, float] | None = None
        self._every = write_every_s
        self._lock = threading.Lock()  # flush() may also be called from the training thread
        threading.Thread(target=self._write_loop, daemon=True, name="dsforge-heartbeat").start()

    def beat(self, step: int) -> None:
        self._beat = (step, time.time())  # one tuple store: atomic for the writer thread

    def flush(self) -> None:
        with self._lock:
            beat = self._beat
            if beat is None or beat == self._written:
                return
            partial = self.path.with_name(self.path.name + ".partial")
            try:
                partial.write_text(f"{beat[0]} {beat[1]:.3f}\n")
                os.replace(partial, self.path)
            except OSError:
                return  # best effort (a full disk): training goes on, the next beat retries
            self._written = beat

    def _write_loop(self) -> None:
        while True:
            time.sleep(self._every)
            self.flush()


def read_all(run_dir: RunDir) -> dict[int, tuple[int, float]]:
    """rank -> (step, seconds since its last beat). A file that cannot be read (set aside by
    a restart between the listing and the read) or does not parse is left out: its reader
    is recording how a rank ended, which must not fail on it."""
    now, beats = time.time(), {}
    for rank, path in run_dir.heartbeat_files():
        try:
            step, stamp = path.read_text().split()
            beats[rank] = (int(step), now - float(stamp))
        except (OSError, ValueError):
            continue
    return beats


def summarize(run_dir: RunDir) -> str:
    beats = read_all(run_dir)
    if not beats:
        return "no rank reported progress"
    newest = max(step for step, _ in beats.values())
    lines = [f"  rank {rank}: {step_text(step)}, last progress {age:.0f}s ago"
             + ("  <- behind" if step < newest else "")
             for rank, (step, age) in sorted(beats.items())]
    return "last progress per rank:\n" + "\n".join(lines)
