"""One structured record per failing rank: RUN_DIR/failures/rankNNNNN.json.

A rank that fails writes what happened (rank, step, kind, message, traceback) before it exits;
`dsforge run` prints the first one and `dsforge bench` classifies a cell by it, so neither has
to read meaning into the text a rank printed. Kinds: "exception", "build" (it died building a
DeepSpeed op, a Triton kernel or a torch.compile graph: `what`, `cause` and `fix` say which, why
and what to change, runtime/guard/build_failure.py), "oom" (an out-of-memory error the rank
caught; `memory` holds what it measured), "collective" (a collective or the connection to its
peers failed: an NCCL or gloo error, a lost peer, the rendezvous store), "device" (a CUDA error
other than out-of-memory: an illegal access, an ECC error, a lost GPU), "hang" (its watchdog
ended a step that made no progress), "killed" (ended by a signal without a word) and "stopped"
(stopped from outside, SIGSTOP or SIGTSTP, and ended while stopped; `time` is when it stopped),
both written by its supervisor, runtime/guard/supervise.py; "nonfinite": the ranks stopped
together because the training went bad (a non-finite loss or gradient, a loss spike with
train.on_spike: stop, non-finite weights before a save), written once, by rank 0, with the
report as its detail.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from dsforge.files import write_atomic
from dsforge.job.hosts import HOSTS_ENV, host_of_rank
from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text
from dsforge.units import format_bytes

KINDS = ("exception", "build", "oom", "collective", "device", "hang", "killed", "stopped",
         "exited", "nonfinite")
# Ended without a word of their own (from outside, or an exit its supervisor saw): the likely
# cause of what their peers then recorded.
FROM_OUTSIDE = ("killed", "stopped", "exited")


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
    # the rank's host, as the launcher placed it (job/hosts.py; a hostfile's or a Slurm
    # allocation's): filled in by `write` where the job has more than one host
    host: str | None = None

    def innermost_call(self) -> str:
        """The last `File "...", line N, in f` of the detail: where the rank was."""
        frames = [line.strip() for line in self.detail.splitlines() if line.strip().startswith("File ")]
        return frames[-1] if frames else "(no stack recorded)"

    def headline(self) -> str:
        """One line: who, when, what happened; a build's cause and fix; an out-of-memory's
        measured figures (the whole exception is in the detail)."""
        when = f"at {step_text(self.step)}" if self.step >= 0 else "before its first step"
        if self.kind == "build" and self.what:
            return f"rank {self.rank} failed building {self.what} {when}: {self.cause}. Fix: {self.fix}"
        if self.kind == "oom" and self.memory:
            return f"rank {self.rank} ran out of memory {when}: {measured_text(self.memory)}"
        if self.kind == "nonfinite":
            return f"the training stopped {when}: {self.message}"
        what = {"hang": "stuck", "oom": "out of memory", "killed": "died", "exited": "exited",
                "stopped": "was stopped", "collective": "lost its peers",
                "device": "had a device error"}.get(self.kind, "failed")
        on = f" on {self.host}" if self.host else ""
        return f"rank {self.rank} {what} {when}{on}: {self.message}"

    @property
    def explained(self) -> bool:
        """Whether the headline says all a user needs (the traceback helps only developers)."""
        return (self.kind == "build" and bool(self.what)) or \
            (self.kind == "oom" and bool(self.memory)) or self.kind == "nonfinite"


def write(run_dir: RunDir, failure: Failure) -> None:
    """Best effort and atomic: a failing rank must still exit if its disk is full. The host is
    the rank's place in the job's hosts (HOSTS_ENV), never gethostname: loopback test hosts
    share one."""
    host = failure.host or host_of_rank(os.environ.get(HOSTS_ENV, ""), failure.rank)
    try:
        path = run_dir.failure(failure.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(failure) | {"time": failure.time or time.time(),
                                                          "host": host}))
    except OSError:
        pass


def read_all(run_dir: RunDir) -> list[Failure]:
    """Every complete record, the likely cause first: ranks killed or stopped from outside
    (their peers then fail on the broken connection or wait for them until their watchdogs
    end them, before the kill or the stop is recorded), then the rest, earliest first."""
    failures = []
    for _, path in run_dir.failure_files():
        try:
            failures.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(failures, key=lambda f: (f.kind not in FROM_OUTSIDE, f.time))


def first(run_dir: RunDir) -> Failure | None:
    """The likely cause (see read_all)."""
    failures = read_all(run_dir)
    return failures[0] if failures else None


def needed_bytes(memory: dict[str, Any]) -> int:
    """What the rank needed when it failed: its peak, or what it held plus what it asked for."""
    held = memory.get("allocated", memory["peak"]) + (memory.get("requested") or 0)
    return max(memory["peak"], held)


def measured_text(memory: dict[str, Any]) -> str:
    """e.g. "measured peak 137.2 GiB (cuda max_memory_allocated, 138.9 GiB reserved) of
    139.8 GiB (NVIDIA H200); 2.0 GiB more requested"."""
    reserved = f", {format_bytes(memory['reserved'])} reserved" if memory.get("reserved") else ""
    requested = f"; {format_bytes(memory['requested'])} more requested" if memory.get("requested") else ""
    return (f"measured peak {format_bytes(memory['peak'])} ({memory['source']}{reserved}) of "
            f"{format_bytes(memory['capacity'])} ({memory['device']}){requested}")
