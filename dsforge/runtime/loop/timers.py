"""The engines' own timers, pointed at dsforge's StepClock (runtime/loop/breakdown.py).

Megatron-Core's schedules call `config.timers(name).start()/.stop()` around each microbatch's
`forward-compute` and `backward-compute`, each pipeline send and receive, and the whole
`forward-backward`; DeepSpeed's ZeRO-1/2 optimizer calls `self.timers(name)` around the
all-gather of the updated parameters (`optimizer_allgather`). PhaseTimers answers both
interfaces with clock marks, so neither synchronises the device.

The pipeline bubble of a rank is 1 - (forward + backward compute) / forward-backward, the share
of its schedule spent waiting on its neighbours (compare with (p-1)/(v*m + p-1), the
theoretical share of the step).
"""

from __future__ import annotations

import statistics
from typing import Callable

from dsforge.runtime.loop.breakdown import OTHER, Reading, StepClock

# Inclusive spans the bubble needs, by Megatron's timer names.
SCHEDULE, FORWARD, BACKWARD = "forward-backward", "forward-compute", "backward-compute"


def schedule_phase(name: str) -> str | None:
    """The phase of one of Megatron's schedule timers; None: not marked."""
    if name == FORWARD:
        return "forward"
    if name == BACKWARD:
        return "backward"
    if "send" in name or "recv" in name:  # forward-recv, backward-send-forward-recv, ...
        return "pipeline_wait"
    # The schedule's own time outside the phases above is not a phase of its own.
    return OTHER if name == SCHEDULE else None


def optimizer_phase(name: str) -> str | None:
    """The phase of one of DeepSpeed's ZeRO-1/2 optimizer timers; None: not marked."""
    return "dp_comm" if name == "optimizer_allgather" else None


class _Timer:
    def __init__(self, clock: StepClock, phase: str | None, span: str | None):
        self.clock, self.phase, self.span = clock, phase, span

    def start(self, barrier: bool = False) -> None:
        if self.phase is not None:
            self.clock.enter(self.phase, span=self.span)

    def stop(self, barrier: bool = False) -> None:
        if self.phase is not None:
            self.clock.exit(span=self.span)


class PhaseTimers:
    """Callable like Megatron's and DeepSpeed's timers: `timers(name, log_level=...)` ->
    start()/stop(); `phase_of(name)` says which phase a timer marks (None: ignored)."""

    def __init__(self, clock: StepClock, phase_of: Callable[[str], str | None]):
        self.clock, self.phase_of = clock, phase_of
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str, log_level: int = 0) -> _Timer:
        if name not in self._timers:
            span = name if name in (SCHEDULE, FORWARD, BACKWARD) else None
            self._timers[name] = _Timer(self.clock, self.phase_of(name), span)
        return self._timers[name]

    def log(self, *args, **kwargs) -> None:
        """DeepSpeed asks its timers to log after each optimizer step; the clock reports."""


def bubble_share(reading: Reading) -> float | None:
    """The share of the rank's schedule spent waiting; None for a step without a schedule."""
    schedule = reading.spans.get(SCHEDULE, 0.0)
    if schedule <= 0:
        return None
    compute = reading.spans.get(FORWARD, 0.0) + reading.spans.get(BACKWARD, 0.0)
    return max(0.0, 1.0 - compute / schedule)


def median_bubble(readings: list[Reading]) -> float | None:
    shares = [s for s in map(bubble_share, readings) if s is not None]
    return statistics.median(shares) if shares else None
