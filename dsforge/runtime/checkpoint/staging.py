"""A rank's checkpoint state copied into host memory (the snapshot), in the training thread or
a background writer's.

The state a checkpoint holds (fp32 masters and Adam's moments) changes only at the optimizer
step, so a background save need not stop training to copy it: the writer copies it while the
next step's forward and backward run, and `StepGate` holds that step's optimizer (a pre-hook on
the torch optimizer that DeepSpeed steps) until the copy is done. A snapshot's copies on a GPU
run on a stream of their own, after an event recorded where the state's last update was
queued, into pinned buffers kept from one save to the next (`Staging`).

Where the host cannot hold a rank's whole state beside the job (`train.checkpoint_staging_gb`,
`staging_budget`), the state goes through one buffer of that size in parts (`Staging.parts`),
each written before the next is copied: the optimizer step then waits until the last part is
copied, so for the writes of all the parts before it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import torch

from dsforge.host_memory import memory_available
from dsforge.runtime.guard.watchdog import waiting_for

# Parts smaller than this would make a save a stream of small writes; a host that cannot spare
# it per rank is short of memory for the job itself.
MIN_PART_BYTES = 64 * 2**20


class Staging:
    """Host buffers a rank's snapshots are copied into, kept from one save to the next (the
    state's pieces have the same shapes every time): pinned for GPU tensors, so the copies run
    at the host link's speed and no save pays for allocating (pinning) them again. Whoever holds
    it writes a snapshot before the next is copied in (runtime/loop/checkpointer.py: at most one
    save in flight). `budget_bytes`: the most it may hold (None: a whole snapshot)."""

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = None

    def holds(self, nbytes: int) -> bool:
        """Whether a snapshot of `nbytes` is copied whole (`copy_all`), not in `parts`."""
        return self.budget_bytes is None or nbytes <= self.budget_bytes

    def parts(self, tensors: dict[str, torch.Tensor], ready: "torch.cuda.Event | None",
              on_copied: Callable[[], None]) -> Iterator[torch.Tensor]:
        """`tensors`' elements end to end, as fp32 host tensors of at most `budget_bytes`, in
        one buffer: each part is copied once the one before has been used (written).
        `on_copied()` is called once the last element is copied, before its part is given."""
        flats = [t.detach().reshape(-1) for t in tensors.values()]
        total = sum(f.numel() for f in flats)
        size = max(1, min(total, self.budget_bytes // 4))
        buffer = self._buffer("parts", size, pinned=any(f.is_cuda for f in flats))
        filled = copied = 0
        for flat in flats:
            start = 0
            while start < flat.numel():
                count = min(size - filled, flat.numel() - start)
                self._copy_into(buffer[filled:filled + count], flat[start:start + count], ready)
                ready = None  # waited for once, before the first copy
                filled, start, copied = filled + count, start + count, copied + count
                if filled == size or copied == total:
                    self._wait_for_copies()
                    if copied == total:
                        on_copied()
                    yield buffer[:filled]
                    filled = 0
        if total == 0:
            on_copied()

    def copy_all(self, tensors: dict[str, torch.Tensor],
                 ready: "torch.cuda.Event | None") -> dict[str, torch.Tensor]:
        """fp32 host copies of `tensors` that nothing else holds (on a CPU too: the optimizer
        updates its tensors in place), complete when this returns. `ready`: the event the
        copies of GPU tensors wait for (`ready_event`)."""
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        if device is None:
            return {key: self._copy(key, t) for key, t in tensors.items()}
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            copies = {key: self._copy(key, t) for key, t in tensors.items()}
        self._stream.synchronize()
        return copies

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        buffer = self._buffer(key, flat.numel(), pinned=flat.is_cuda)
        return buffer.copy_(flat, non_blocking=flat.is_cuda)

    def _buffer(self, key: str, numel: int, *, pinned: bool) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != numel:
            buffer = torch.empty(numel, dtype=torch.float32, device="cpu", pin_memory=pinned)
            self._buffers[key] = buffer
        return buffer

    def _copy_into(self, out: torch.Tensor, flat: torch.Tensor,
                   ready: "torch.cuda.Event | None") -> None:
        if not flat.is_cuda:
            out.copy_(flat)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(flat.device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            out.copy_(flat, non_blocking=True)

    def _wait_for_copies(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


def staging_budget(staging_bytes: int | None, *, local_ranks: int) -> int:
    """Bytes a rank's save may hold staged: `train.checkpoint_staging_gb`'s (`staging_bytes`),
    or for auto (None) half the host memory free now shared by the host's `local_ranks` (no
    limit where that is unknown). Taken at the first save: the job's memory is in use then."""
    if staging_bytes is not None:
        return staging_bytes
    available = memory_available()
    if available is None:
        return 2**62
    return max(MIN_PART_BYTES, available // 2 // max(1, local_ranks))


def ready_event(tensors: dict[str, torch.Tensor]) -> "torch.cuda.Event | None":
    """On a GPU, an event recorded on the training thread's stream now: the state's last update
    is queued before it."""
    device = next((t.device for t in tensors.values() if t.is_cuda), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class StepGate:
    """Holds `optimizer`'s next step until `open()` (the snapshot of `steps_done` steps is
    copied). The training thread makes it and `close()`s it once open; the writer opens it,
    whatever happens."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps_done: int, *,
                 progress: Callable[[], int] | None = None):
        self.copied = threading.Event()
        self.waited_s = 0.0  # how long the optimizer step waited for the copy
        self._what = f"its checkpoint writer to copy the state of step {steps_done}"
        self._progress = progress  # the save's bytes on disk: staged in parts, the wait moves
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, *_) -> None:
        if not self.copied.is_set():
            started = time.monotonic()
            with waiting_for(self._what, self._progress):
                self.copied.wait()
            self.waited_s += time.monotonic() - started

    def open(self) -> None:
        self.copied.set()

    def close(self) -> None:
        self._hook.remove()
