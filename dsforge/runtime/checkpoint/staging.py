"""A rank's checkpoint state copied into host memory (the snapshot), in the training thread or
a background writer's.

The state a checkpoint holds (fp32 masters and Adam's moments) changes only at the optimizer
step, so a background save need not stop training to copy it: the writer copies it while the
next step's forward and backward run, and `StepGate` holds that step's optimizer (a pre-hook on
the torch optimizer that DeepSpeed steps) until the copy is done. A snapshot's copies on a GPU
run on a stream of their own, after an event recorded where the state's last update was
queued, into pinned buffers kept from one save to the next (`Staging`).
"""

from __future__ import annotations

import threading
import time

import torch


class Staging:
    """Host buffers a rank's snapshots are copied into, kept from one save to the next (the
    state's pieces have the same shapes every time): pinned for GPU tensors, so the copies run
    at the host link's speed and no save pays for allocating (pinning) them again. Whoever holds
    it writes a snapshot before the next is copied in (runtime/loop/checkpointer.py: at most one
    save in flight)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = None

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
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != flat.numel():
            buffer = torch.empty(flat.shape, dtype=torch.float32, device="cpu",
                                 pin_memory=flat.is_cuda)
            self._buffers[key] = buffer
        return buffer.copy_(flat, non_blocking=flat.is_cuda)


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
    """Holds `optimizer`'s next step until `open()` (the snapshot is copied). The training
    thread makes it and `close()`s it once open; the writer opens it, whatever happens."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.copied = threading.Event()
        self.waited_s = 0.0  # how long the optimizer step waited for the copy
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, *_) -> None:
        if not self.copied.is_set():
            started = time.monotonic()
            self.copied.wait()
            self.waited_s += time.monotonic() - started

    def open(self) -> None:
        self.copied.set()

    def close(self) -> None:
        self._hook.remove()
