"""Measure the pipeline bubble: how much of each stage's schedule time is spent waiting.

Megatron-Core's schedules report `forward-compute`, `backward-compute` and the whole
`forward-backward` through `config.timers`. ScheduleTimers totals them per step; the measured
bubble of a rank is 1 - (forward + backward compute) / forward-backward, the share of its
schedule spent waiting on its neighbours (compare with (p-1)/(v*m + p-1), the theoretical
share of the step). On a GPU each timer synchronises the device, so they are only installed
when a run is measured (`dsforge bench`), never in plain training.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch


class _Timer:
    def __init__(self, owner: "ScheduleTimers", name: str):
        self.owner, self.name, self.started = owner, name, None

    def start(self, barrier: bool = False) -> None:
        self.owner.sync()
        self.started = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        self.owner.sync()
        self.owner.totals[self.name] += time.perf_counter() - self.started


class ScheduleTimers:
    """Callable like Megatron's Timers: `timers(name, log_level=...)` -> start()/stop()."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self._timers: dict[str, _Timer] = {}
        self.bubble_per_step: list[float] = []

    def __call__(self, name: str, log_level: int = 0) -> _Timer:
        if name not in self._timers:
            self._timers[name] = _Timer(self, name)
        return self._timers[name]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def end_step(self) -> None:
        schedule = self.totals.get("forward-backward", 0.0)
        compute = self.totals.get("forward-compute", 0.0) + self.totals.get("backward-compute", 0.0)
        if schedule > 0:
            self.bubble_per_step.append(max(0.0, 1.0 - compute / schedule))
        self.totals.clear()

    def median_bubble(self, skip: int) -> float | None:
        measured = self.bubble_per_step[skip:] or self.bubble_per_step
        return statistics.median(measured) if measured else None
