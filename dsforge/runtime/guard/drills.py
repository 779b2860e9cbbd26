"""The drills of DSFORGE_INJECT_FAULT=KIND:RANK:STEP, for the tests and for checking what a
cluster's runs do when a rank fails or stops, or the training itself goes bad.

A rank that fails or stops:
- raise | hang | exit | oom | build act when RANK starts STEP: oom raises torch's
  out-of-memory error, as a GPU's allocator does; build runs the first part of DeepSpeed's JIT
  build of its CUDA FusedAdam op (its architecture flags, from TORCH_CUDA_ARCH_LIST or the
  GPUs), which fails as on a GPU where that list is one DeepSpeed cannot read, and does
  nothing where the build would get past it;
- save-exit kills RANK while it saves the checkpoint of STEP, after writing its files;
  save-hang makes RANK's save of STEP (its writer, or the training thread where it writes)
  hang there instead, for the watchdog to end;
- collective | device raise what a failed collective or a failed GPU raises when RANK starts
  STEP, once per run directory (a marker under RUN_DIR/drills), as a link that flapped or a
  one-off ECC error would: a restart (--max-restarts) gets past them. collective raises
  torch's DistBackendError, as NCCL does on the rank whose communicator failed (a one-GPU
  world has no peer to lose); device on a GPU rank makes a real device-side assert (an index
  out of bounds), which leaves the process's CUDA context unusable, and on a CPU rank raises
  torch's AcceleratorError with CUDA's message;
- host-down:HOST:STEP (HOST a host of the hostfile, not a rank): the ranks on HOST mark it
  failed (RUN_DIR/drills, job/hosts.py: the launcher's preflight then reports it unreachable)
  and SIGKILL themselves when they start STEP; a restart leaves the host out
  (launch/host_pool.py). Keyed by host, so the drill does not follow a rank to a spare;
- preemption: stop sends SIGTERM to the `dsforge run` that started the job (to the rank itself
  without one on this host) when RANK starts STEP, stop-save the same while RANK saves the
  checkpoint of STEP; stop-eval sends SIGUSR1 to RANK's supervisor only (a `kill` of the
  process a launcher started) before RANK's first validation batch after STEP.

Training that goes bad (`NumericDrill`):
- nan: RANK's model output in step STEP is multiplied by NaN: on the last pipeline stage its
  loss, elsewhere the activations it sends on (so the loss of the stages after it);
- nan-from: the same in every step from STEP on (a run that has diverged for good);
- spike: RANK's loss in step STEP is multiplied by SPIKE_FACTOR (RANK must hold the last
  pipeline stage: elsewhere the output is activations);
- nan-weights: after step STEP's update, one of RANK's weights becomes NaN, before the
  checkpoint of that step is saved.

STEP is the step's index, from 0, as metrics.jsonl counts.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import TYPE_CHECKING

from dsforge.job.hosts import HOSTS_ENV, down_marker, host_of_rank
from dsforge.job.owner import owner_alive
from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text
from dsforge.runtime.guard.preempt import StopRequest

if TYPE_CHECKING:  # runtime/rank.py imports this module before torch (its stop request first)
    import torch

NUMERIC_KINDS = ("nan", "nan-from", "spike", "nan-weights")
SPIKE_FACTOR = 10.0

FAULT_ENV = "DSFORGE_INJECT_FAULT"
PASSING_KINDS = ("collective", "device")  # what a restart gets past (launch/restart.py RETRIED)
WATCHDOG_SETTLE_S = 1.0  # the device drill waits for NCCL's watchdog to retire finished work
FAULT_KINDS = ("raise", "hang", "exit", "oom", "build", "save-exit", "save-hang", "stop",
               "stop-eval", "stop-save", "host-down", *PASSING_KINDS, *NUMERIC_KINDS)
_STEP_FAULTS = ("raise", "hang", "exit", "oom", "build")  # act when a step starts


def parse_fault(spec: str | None) -> tuple[str, int | str, int] | None:
    """(kind, rank, step); host-down's second field is a host name."""
    if not spec:
        return None
    kind, who, step = spec.split(":")
    if kind not in FAULT_KINDS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: KIND must be one of {', '.join(FAULT_KINDS)}")
    return kind, who if kind == "host-down" else int(who), int(step)


def host_down(fault, rank: int, step: int, run_dir: RunDir) -> None:
    """The host-down drill, when `rank` starts `step` on the drill's host."""
    if fault is None or fault[0] != "host-down" or fault[2] != step:
        return
    if host_of_rank(os.environ.get(HOSTS_ENV, ""), rank) != fault[1]:
        return
    marker = down_marker(run_dir, fault[1])
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)


def passing_fault(fault, rank: int, step: int, run_dir: RunDir, device: "torch.device") -> None:
    """The collective and device drills, when `rank` starts `step`: once per run directory."""
    if fault is None or fault[0] not in PASSING_KINDS or (fault[1], fault[2]) != (rank, step):
        return
    marker = run_dir.drills / f"{fault[0]}-{rank}-{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()  # before the failure: the rank may not get further
    import torch

    where = f"on rank {rank} at {step_text(step)}"
    if fault[0] == "collective":
        raise torch.distributed.DistBackendError(
            f"injected: NCCL communicator was aborted {where} (collective drill)")
    why = "a CPU rank has no device to fail"
    if device.type == "cuda":
        # NCCL's watchdog wakes every ~100 ms and aborts the process if work it still tracks
        # meets the error; the last step's collectives are retired first, so the error
        # reaches this thread and its record, as an error inside a step's kernels would
        # (a real one may also be found by the watchdog first: recorded as killed, SIGABRT).
        torch.cuda.synchronize(device)
        time.sleep(WATCHDOG_SETTLE_S)
        torch.zeros(1, device=device)[torch.ones(1, dtype=torch.long, device=device)]
        torch.cuda.synchronize(device)  # the assert surfaces here, as CUDA's error
        why = "the device-side assert it made did not surface"
    raise torch.AcceleratorError(f"CUDA error: injected {where} (device drill: {why})")


def inject_fault(fault: tuple[str, int, int] | None, rank: int, step: int) -> None:
    if fault is None or fault[0] not in _STEP_FAULTS or (fault[1], fault[2]) != (rank, step):
        return
    if fault[0] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at {step_text(step)}")
    if fault[0] == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out of memory on rank {rank} at {step_text(step)}")
    if fault[0] == "build":
        _arch_flags_as_deepspeed_builds_them()
        return
    if fault[0] == "exit":
        os._exit(7)
    while True:  # hang: the watchdog (or the job timeout) has to end it
        time.sleep(1)


def _arch_flags_as_deepspeed_builds_them() -> None:
    """DeepSpeed's CUDA FusedAdam builder in its JIT mode computes the nvcc architecture flags
    (op_builder/builder.py compute_capability_args), which rewrites TORCH_CUDA_ARCH_LIST;
    jit_load restores it afterwards, and so does this."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    try:
        builder.compute_capability_args()
    finally:
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        if saved is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def save_fault(fault, owner: str = "", request: StopRequest | None = None):
    if fault is None or fault[0] not in ("save-exit", "save-hang", "stop-save"):
        return None

    def while_saving(rank: int, steps_done: int) -> None:
        if (rank, steps_done) != (fault[1], fault[2]):
            return
        if fault[0] == "save-exit":
            os._exit(9)
        if fault[0] == "save-hang":
            while True:  # the watchdog ends the rank when the training thread waits for it
                time.sleep(1)
        signal_the_job(owner, request)

    return while_saving


class StopDrill:
    """The stop and stop-eval drills: one signal at the chosen moment."""

    def __init__(self, fault, rank: int, owner: str, request: StopRequest):
        self.armed = fault is not None and fault[0] in ("stop", "stop-eval") and fault[1] == rank
        self.fault, self.owner, self.request = fault, owner, request
        self.last_step: int | None = None

    def before(self, step: int) -> None:
        """Called when a step starts and before each of its validation batches (with the
        step's index again: a second call for one step is a validation batch)."""
        repeat, self.last_step = step == self.last_step, step
        if not self.armed or step < self.fault[2]:
            return
        if self.fault[0] == "stop" and step == self.fault[2]:
            self.armed = False
            signal_the_job(self.owner, self.request)
        elif self.fault[0] == "stop-eval" and repeat:  # the first validation batch from STEP on
            self.armed = False
            os.kill(os.getppid(), signal.SIGUSR1)  # the supervisor passes it on to this rank


def signal_the_job(owner: str, request: StopRequest | None = None, wait_s: float = 30.0) -> None:
    """SIGTERM to the `dsforge run` that started this job when it runs on this host (the path
    a scheduler's signal takes), else to this rank itself; then wait up to `wait_s` until the
    request reaches this rank, so the drill stops the job where it is meant to."""
    pid = int(owner.rsplit(":", 2)[1]) if owner and owner_alive(owner) else os.getpid()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while request is not None and request.signum is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs in this (the main) thread between sleeps


class NumericDrill:
    def __init__(self, fault: tuple[str, int, int] | None, rank: int):
        self.kind, self.step = (fault[0], fault[2]) if fault and fault[0] in NUMERIC_KINDS \
            and fault[1] == rank else (None, -1)
        self.factor: float | None = None
        self._armed_for = -1

    def attach(self, chunks: list["torch.nn.Module"]) -> None:
        """Hook the rank's last model chunk (the one whose output is the loss on the last
        pipeline stage)."""
        if self.kind in ("nan", "nan-from", "spike"):
            chunks[-1].register_forward_hook(self._scale_output)

    def before_step(self, step: int) -> None:
        """Called when a step starts, and again before each of its validation batches: only the
        first call of a step arms it, so evaluations stay clean."""
        if step == self._armed_for:
            self.factor = None
            return
        self._armed_for = step
        hit = step == self.step or (self.kind == "nan-from" and step >= self.step)
        self.factor = None if not hit or self.kind == "nan-weights" else \
            (SPIKE_FACTOR if self.kind == "spike" else math.nan)

    def after_step(self, step: int, module: "torch.nn.Module") -> None:
        import torch

        self.factor = None
        if self.kind == "nan-weights" and step == self.step:
            weight = next(p for p in module.parameters() if getattr(p, "ds_tensor", p).numel())
            with torch.no_grad():
                getattr(weight, "ds_tensor", weight).fill_(math.nan)

    def _scale_output(self, _module, _inputs, output):
        return None if self.factor is None else output * self.factor
