"""Per-rank heartbeats: the step each rank is on, so a stalled job can say who stalled where.

Each rank rewrites RUN_DIR/heartbeats/rankNNNNN (`step unix_time`) when it starts a step;
`summarize` reads them all (the launcher prints it when a job fails or hangs).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def directory(run_dir: Path) -> Path:
    return run_dir / "heartbeats"


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int):
        self.path = directory(run_dir) / f"rank{rank:05d}"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def beat(self, step: int) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(f"{step} {time.time():.3f}\n")
        os.replace(partial, self.path)


def read_all(run_dir: Path) -> dict[int, tuple[int, float]]:
    """rank -> (step, seconds since its last beat)."""
    now, beats = time.time(), {}
    for path in sorted(directory(run_dir).glob("rank[0-9]*")):
        if path.name.endswith(".partial"):
            continue
        step, stamp = path.read_text().split()
        beats[int(path.name[4:])] = (int(step), now - float(stamp))
    return beats


def summarize(run_dir: Path) -> str:
    beats = read_all(run_dir)
    if not beats:
        return "no rank reported progress"
    newest = max(step for step, _ in beats.values())
    lines = [f"  rank {rank}: step {step}, last progress {age:.0f}s ago"
             + ("  <- behind" if step < newest else "")
             for rank, (step, age) in sorted(beats.items())]
    return "last progress per rank:\n" + "\n".join(lines)
