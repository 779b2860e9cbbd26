"""One structured record per failing rank: RUN_DIR/failures/rankNNNNN.json.

A rank that fails writes what happened (rank, step, kind, message, traceback) before it
exits; `dsforge run` prints the first one and `dsforge bench` classifies a cell by it, so
neither has to read meaning into the text a rank printed. Kinds: "exception", "oom" (an
out-of-memory error the rank caught), "hang" (its watchdog ended a step that made no
progress), "killed" (ended by a signal without a word; written by its supervisor,
runtime/supervise.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("exception", "oom", "hang", "killed")


@dataclass(frozen=True, kw_only=True)
class Failure:
    rank: int
    step: int
    kind: str
    message: str
    detail: str = ""  # traceback or stacks
    time: float = 0.0

    def innermost_call(self) -> str:
        """The last `File "...", line N, in f` of the detail: where the rank was."""
        frames = [line.strip() for line in self.detail.splitlines() if line.strip().startswith("File ")]
        return frames[-1] if frames else "(no stack recorded)"

    def headline(self) -> str:
        what = {"hang": "stuck", "oom": "out of memory", "killed": "died"}.get(self.kind, "failed")
        return f"rank {self.rank} {what} at step {self.step}: {self.message}"


def directory(run_dir: Path) -> Path:
    return Path(run_dir) / "failures"


def kind_of(exc: BaseException) -> str:
    import torch

    return "oom" if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) else "exception"


def write(run_dir: Path, failure: Failure) -> None:
    """Best effort and atomic: a failing rank must still exit if its disk is full."""
    try:
        folder = directory(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{failure.rank:05d}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(failure) | {"time": failure.time or time.time()}))
        os.replace(partial, path)
    except OSError:
        pass


def read_all(run_dir: Path) -> list[Failure]:
    """Every complete record, the likely cause first: ranks killed from outside (their peers
    then fail on the broken connection, possibly before the kill is recorded), then the
    rest, earliest first."""
    failures = []
    for path in sorted(directory(run_dir).glob("rank*.json")):
        try:
            failures.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(failures, key=lambda f: (f.kind != "killed", f.time))


def first(run_dir: Path) -> Failure | None:
    """The likely cause (see read_all)."""
    failures = read_all(run_dir)
    return failures[0] if failures else None
