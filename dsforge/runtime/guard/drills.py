"""Drills that make the training itself go bad, for the tests and for checking what a cluster's
runs do when it does (DSFORGE_INJECT_FAULT=KIND:RANK:STEP, parsed by faults.py):

- nan: RANK's model output in step STEP is multiplied by NaN: on the last pipeline stage its
  loss, elsewhere the activations it sends on (so the loss of the stages after it);
- nan-from: the same in every step from STEP on (a run that has diverged for good);
- spike: RANK's loss in step STEP is multiplied by SPIKE_FACTOR (RANK must hold the last
  pipeline stage: elsewhere the output is activations);
- nan-weights: after step STEP's update, one of RANK's weights becomes NaN, before the
  checkpoint of that step is saved.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # runtime/rank.py imports this module before torch (the owner watch first)
    import torch

KINDS = ("nan", "nan-from", "spike", "nan-weights")
SPIKE_FACTOR = 10.0


class NumericDrill:
    def __init__(self, fault: tuple[str, int, int] | None, rank: int):
        self.kind, self.step = (fault[0], fault[2]) if fault and fault[0] in KINDS \
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
