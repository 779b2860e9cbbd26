"""When a run saves: every `train.checkpoint_every` steps and after the last, or, with `auto`,
at the interval that loses least to saves and failures (Young/Daly, estimate/save_cost.py),
chosen once the run has measured MEASURED_STEPS steps after its timing warmup. Until then an
auto run makes no periodic save (its last step is saved all the same).

Every rank must choose the same interval (a save is collective): the step time it uses is the
mean over the ranks, which each step's all-reduce carries (runtime/guard/health.py), so every
rank reads the same numbers and computes the same interval.
"""

from __future__ import annotations

import statistics
from typing import Callable

from dsforge.estimate.save_cost import save_cost
from dsforge.recipe import Resolved

MEASURED_STEPS = 3


class SaveInterval:
    def __init__(self, resolved: Resolved, *, device: str, first_timed_step: int,
                 say: Callable[[str], None] | None):
        """`first_timed_step`: the first step whose time counts (after the warmup). `say`:
        where the chosen interval is said (rank 0), or None."""
        every = resolved.recipe.train.checkpoint_every
        self.auto = every == "auto"
        self.every = 0 if self.auto else every  # 0: no periodic save (yet, for auto)
        self.resolved, self.device = resolved, device
        self.first_timed_step, self.say = first_timed_step, say
        self.last_step_s = 0.0  # this rank's last step, carried by the next step's all-reduce
        self._times: list[float] = []

    def due(self, step: int) -> bool:
        """Whether the checkpoint after step `step` (0-based) is saved."""
        last = step + 1 == self.resolved.recipe.train.steps
        if self.auto:
            return last or bool(self.every) and (step + 1) % self.every == 0
        return bool(self.every) and ((step + 1) % self.every == 0 or last)

    def measured(self, step: int, step_s: float) -> None:
        """Step `step`'s time, the mean over the ranks; an auto run chooses its interval once
        it has MEASURED_STEPS of them."""
        if not self.auto or self.every or step < self.first_timed_step:
            return
        self._times.append(step_s)
        if len(self._times) < MEASURED_STEPS:
            return
        median = statistics.median(self._times)
        cost = save_cost(self.resolved, device=self.device, step_s=median)
        self.every = cost.interval_steps
        if self.say is not None:
            self.say(f"dsforge: checkpoint every {self.every:,} steps (train.checkpoint_every "
                     f"auto: {median:.3g} s a step, a save's stall at most "
                     f"{cost.stall_s:.2g} s and its write {cost.write_s:.2g} s, a job MTBF of "
                     f"{cost.job_mtbf_s / 3600:,.0f} h; docs/checkpoints.md)")
