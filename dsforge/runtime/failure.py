"""One structured record per failing rank: RUN_DIR/failures/rankNNNNN.json.

A rank that fails writes what happened (rank, step, kind, message, traceback) before it
exits; `dsforge run` prints the first one and `dsforge bench` classifies a cell by it, so
neither has to read meaning into the text a rank printed. Kinds: "exception", "build" (it died
building a DeepSpeed op, a Triton kernel or a torch.compile graph: `what`, `cause` and `fix`
say which, why and what to change, runtime/build_failure.py), "oom" (an out-of-memory error
the rank caught; `memory` holds what it measured), "hang" (its watchdog ended a step that made
no progress), "killed" (ended by a signal without a word; written by its supervisor,
runtime/supervise.py).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsforge.runtime import build_failure, oom

KINDS = ("exception", "build", "oom", "hang", "killed")


@dataclass(frozen=True, kw_only=True)
class Failure:
    rank: int
    step: int
    kind: str
    message: str
    detail: str = ""  # traceback or stacks
    time: float = 0.0
    what: str = ""  # build: what was being built, e.g. "DeepSpeed's fused_adam op"
    cause: str = ""  # build: why, naming the variable involved
    fix: str = ""  # build: what to change
    # oom, bytes: peak (and its source), capacity of the device (CPU: the host's memory over
    # its ranks), allocated and reserved (CUDA), requested (the allocation that failed)
    memory: dict[str, Any] | None = None

    def innermost_call(self) -> str:
        """The last `File "...", line N, in f` of the detail: where the rank was."""
        frames = [line.strip() for line in self.detail.splitlines() if line.strip().startswith("File ")]
        return frames[-1] if frames else "(no stack recorded)"

    def headline(self) -> str:
        """One line: who, when, what happened; a build's cause and fix; an out-of-memory's
        measured figures (the whole exception is in the detail)."""
        when = f"at step {self.step}" if self.step >= 0 else "before its first step"
        if self.kind == "build" and self.what:
            return f"rank {self.rank} failed building {self.what} {when}: {self.cause}. Fix: {self.fix}"
        if self.kind == "oom" and self.memory:
            return f"rank {self.rank} ran out of memory {when}: {oom.measured_text(self.memory)}"
        what = {"hang": "stuck", "oom": "out of memory", "killed": "died"}.get(self.kind, "failed")
        return f"rank {self.rank} {what} {when}: {self.message}"

    @property
    def explained(self) -> bool:
        """Whether the headline says all a user needs (the traceback helps only developers)."""
        return (self.kind == "build" and bool(self.what)) or (self.kind == "oom" and bool(self.memory))


def directory(run_dir: Path) -> Path:
    return Path(run_dir) / "failures"


def record_for(exc: BaseException, *, rank: int, step: int, detail: str) -> Failure:
    """The record of a rank's exception: an out-of-memory with the memory measured now, a
    build with its cause, or any other exception."""
    message = _exception_line(exc)
    if oom.out_of_memory(exc):
        try:
            memory = oom.measure_memory(message)
        except Exception:  # a device in an error state: the record matters more than figures
            memory = None
        return Failure(rank=rank, step=step, kind="oom", message=message, detail=detail,
                       memory=memory)
    try:
        built = build_failure.diagnose(build_failure.evidence(exc), os.environ)
    except Exception:  # reading the frames' objects must never cost the record itself
        built = None
    if built is not None:
        return Failure(rank=rank, step=step, kind="build", message=message, detail=detail,
                       what=built.what, cause=built.cause, fix=built.fix)
    return Failure(rank=rank, step=step, kind="exception", message=message, detail=detail)


def _exception_line(exc: BaseException) -> str:
    return traceback.format_exception_only(exc)[-1].strip()


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
