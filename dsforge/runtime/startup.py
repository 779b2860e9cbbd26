"""Where a rank's start-up goes: wall seconds from `dsforge run` to the first step, by phase.

A 7B rank took ~55 s to reach its first step on an H200, longer than five of its steps;
without a breakdown nobody can tell the imports from the weights' draw. Each phase is named
after the work that ends it, and what it imports on the way counts in it (megatron-core and
DeepSpeed load lazily, in `distributed`):

  launch       `dsforge run` started -> this rank's Python runs (the launcher, the interpreter)
  setup        the recipe resolved, torch imported, the device chosen
  data         the data sources opened (index files built or read)
  distributed  the process group, Megatron-Core's parallel state
  model        the model chunks built
  weights      their weights drawn, or read from model.init_from
  engine       DeepSpeed's engine
  resume       the checkpoint read (a resumed run only)
  compile      model.compile: layers only: torch's own compile seconds, which it spends inside
               the first step (the trainer adds this phase after that step)

`launch` compares this host's clock with the one `dsforge run` ran on; it is left out when
that clock is ahead (another host's clock, skewed). The reporting rank's phases (the rank
that writes metrics.jsonl) go to summary.json `startup_s` and one line on the terminal
(docs/breakdown.md).
"""

from __future__ import annotations

import time
from typing import Callable


class StartupClock:
    def __init__(self, launched_at: float | None = None, now: Callable[[], float] = time.time):
        self._now = now
        self._last = now()
        self.phases: dict[str, float] = {}
        if launched_at is not None and launched_at <= self._last:
            self.phases["launch"] = self._last - launched_at

    def mark(self, phase: str) -> None:
        """`phase` ended now: the time since the last mark is its."""
        now = self._now()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases.items())
        return f"ready for the first step after {sum(self.phases.values()):.1f} s ({parts})"
