"""Stopping a job early with a checkpoint: on a signal (preemption) or before a time limit.

The first SIGTERM or SIGUSR1 a rank receives only sets a flag (`StopRequest`); a second one
ends the rank as SIGTERM always did (the default action: it dies, and its supervisor reports
nothing, as for any stop request). At the end of every step the ranks agree whether to stop
(`Stopper.agree`: one all-reduce MAX over the world of [signal number, out of time]): a rank
that stopped alone would leave its peers waiting in their next collective. When they agree,
each rank saves the normal checkpoint (runtime/checkpoint/save_load.py publishes `latest` only once it is
complete), reports `stopped` and exits 0; `dsforge run` then exits EXIT_RESUMABLE.

A signal during a step, an evaluation or a save therefore takes effect after that step's
evaluation and periodic save are done; the step's checkpoint is written once.

`train.time_limit`: the ranks stop at the first step boundary where another step (with its
evaluation when one is due) plus a save might not end before the limit (`TimeBudget`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass

from dsforge.job.signals import STOP_SIGNALS, TIME_LIMIT


class StopRequest:
    """The first stop signal this process received (None: none yet). `install` in the main
    thread; a second stop signal kills the process with that signal's default action."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
            signal.siginterrupt(sig, False)  # restart system calls the signal interrupts

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        sys.stderr.flush()
        os.kill(os.getpid(), signum)


class TimeBudget:
    """Whether another step and a save still fit before `limit_s` after `started_at` (unix
    time; the start of the job). The estimates, in seconds:

    - a step: the longest of the last STEP_WINDOW steps, plus the last evaluation's time when
      the next step evaluates (before any evaluation: eval_iters x the step estimate);
    - a save: the longest save of this job; before the first one, FIRST_SAVE_GUESS_S (a
      periodic save, train.checkpoint_every, measures it early);
    the reserve is SAFETY x (step + save) + MARGIN_S.
    """

    STEP_WINDOW = 20
    FIRST_SAVE_GUESS_S = 60.0
    SAFETY = 1.5
    MARGIN_S = 5.0

    def __init__(self, limit_s: float, started_at: float, *, eval_iters: int = 0,
                 clock=time.time):
        self.deadline = started_at + limit_s
        self.eval_iters, self.clock = eval_iters, clock
        self.steps: deque[float] = deque(maxlen=self.STEP_WINDOW)
        self.eval_s: float | None = None
        self.save_s: float | None = None

    def note(self, kind: str, seconds: float) -> None:
        if kind == "step":
            self.steps.append(seconds)
        elif kind == "eval":
            self.eval_s = seconds
        elif kind == "save":
            self.save_s = max(seconds, self.save_s or 0.0)

    def reserve_s(self, next_evaluates: bool) -> float:
        step = max(self.steps, default=0.0)
        if next_evaluates:
            step += self.eval_s if self.eval_s is not None else self.eval_iters * step
        save = self.save_s if self.save_s is not None else self.FIRST_SAVE_GUESS_S
        return self.SAFETY * (step + save) + self.MARGIN_S

    def out_of_time(self, next_evaluates: bool) -> bool:
        return self.clock() + self.reserve_s(next_evaluates) >= self.deadline


@dataclass(frozen=True)
class Stopped:
    """Why and after how many steps the ranks stopped (with the checkpoint of that step)."""

    steps_done: int
    reason: str  # a signal's name, or TIME_LIMIT
    # False when the last step was bad (runtime/guard/health.py): no checkpoint after it, so a
    # resume continues from `latest`, an earlier one
    saved: bool = True

    def describe(self) -> str:
        return f"stopped after step {self.steps_done} ({self.reason})"


class Stopper:
    """The per-step decision of train_loop: stop now (with a checkpoint) or go on."""

    def __init__(self, request: StopRequest | None = None, budget: TimeBudget | None = None,
                 *, device=None):
        self.request, self.budget, self.device = request, budget, device

    def note(self, kind: str, seconds: float) -> None:
        if self.budget is not None:
            self.budget.note(kind, seconds)

    def local(self, next_evaluates: bool) -> tuple[int, int]:
        """(the signal number received or 0, 1 if out of time) on this rank."""
        signum = self.request.signum if self.request is not None else None
        late = self.budget is not None and self.budget.out_of_time(next_evaluates)
        return signum or 0, int(late)

    def agree(self, steps_done: int, next_evaluates: bool) -> Stopped | None:
        """Every rank's answer, the same on all: one all-reduce MAX over the world."""
        import torch

        flags = torch.tensor(self.local(next_evaluates), dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        signum, late = flags.tolist()
        if signum:
            return Stopped(steps_done, signal.Signals(signum).name)
        return Stopped(steps_done, TIME_LIMIT) if late else None
