"""Whether a step's numbers can be trusted: the non-finite guard and the loss-spike check.

After every step one all-reduce (SUM) over the world of each rank's share of the loss (the
last pipeline stage's ranks with tensor-parallel rank 0 add their loss, the others zero) gives
every rank the loss's mean over the data-parallel replicas (`StepView`), not finite when any
replica's loss was not. It replaces the all-reduce over the replicas that made that mean, so
the guard adds no collective to a step: the step breakdown's `guard` phase is that all-reduce.
The gradient norm and whether DeepSpeed applied the update are the same on every rank already
(DeepSpeed's own all-reduces make them so, and its ZeRO partitions rely on it), so every rank
takes the same decision (`Guard.judge`) with no further collective; a bad step's report
gathers which ranks' own losses were bad (one more all-reduce, on bad steps only).

No ZeRO stage applies a non-finite update. DeepSpeed 0.19.8 drops it at ZeRO 1-3 in every
precision and at ZeRO 0 in bf16 and fp16 (its overflow check: the update is skipped, the
gradient norm reads inf, `skipped_steps` counts it and the learning-rate schedule does not
advance); fp32 at ZeRO 0 has no such check, and dsforge gives it the same one
(runtime/assemble/engine.py). A non-finite loss is made to give non-finite gradients
(runtime/loop/step.py), so its update is dropped the same way. Then, by `train.on_nonfinite`:
- stop: the first bad step ends the run, before its evaluation and any save (`BadStep.action`);
- skip: the run goes on (the step's data is consumed, the schedule does not advance, as for
  DeepSpeed's fp16 overflows and Megatron-LM's skipped iterations) until more than
  `train.max_consecutive_skips` steps in a row were bad; then it stops. A checkpoint is not
  written right after a bad step (runtime/loop/trainer.py), so a resume never starts inside
  a run of bad steps.
fp16's loss-scale overflows (an update skipped with a finite loss) are not bad steps.

A loss spike is a finite loss above `train.spike_factor` x the median of the last
`train.spike_window` finite losses of this process (checked once that many have been seen):
reported with its data, and with `train.on_spike: stop` the end of the run.

Before a save, every rank checks the weights it holds (`weights_finite`) and one all-reduce
(`ranks_where`) tells all of them which ranks hold a non-finite one: DeepSpeed copies the fp32
master into those weights after each update, so a non-finite master shows there too.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from dsforge.schema import TrainConfig


@dataclass(frozen=True)
class StepView:
    """One step as every rank sees it after the all-reduce."""

    loss: float  # mean over the data-parallel (and context-parallel) replicas
    bad_loss: bool  # that mean is not finite: some replica's loss was not
    bad_norm: bool  # the global gradient norm was not finite (DeepSpeed's overflow sentinel: inf)
    skipped: bool  # DeepSpeed did not apply the update
    grad_norm: float | None = None  # DeepSpeed's global gradient norm (None: not computed)
    # the global batch's score pairs within documents (runtime/loop/data.py score_pairs; 0
    # without document masking)
    score_pairs: float = 0.0


@dataclass(frozen=True)
class BadStep:
    """A step the guard found bad, and what the run does about it."""

    step: int
    kind: str  # "nonfinite" or "spike"
    what: str  # e.g. "non-finite loss and gradient norm"
    action: str  # "stop", "skip" or "report"
    in_a_row: int = 0  # non-finite: the bad steps in a row, this one included


def loss_share(loss: torch.Tensor | None, *, adds_loss: bool,
               device: torch.device) -> torch.Tensor:
    """This rank's part of the step's all-reduce: its mean loss where it adds one to the mean
    (one rank per data-parallel replica), else zero; on the device, with no host sync."""
    if loss is None or not adds_loss:
        return torch.zeros((), dtype=torch.float32, device=device)
    return loss.detach().float().reshape(()).clone()


def reduce_step(share: torch.Tensor, *, writing: bool = False, last_step_s: float = 0.0,
                score_pairs: float = 0.0) -> torch.Tensor:
    """The step's one all-reduce over the world: each rank's loss share, whether its
    background writer has a checkpoint not yet written, how long its previous step took
    and, from the ranks that add a loss share, their microbatches' score pairs within
    documents (`view`, `ranks_writing` and `mean_last_step_s` read them)."""
    reduced = torch.stack([share, share.new_tensor(float(writing)),
                           share.new_tensor(last_step_s), share.new_tensor(score_pairs)])
    torch.distributed.all_reduce(reduced)
    return reduced


def ranks_writing(reduced: torch.Tensor) -> int:
    """How many ranks have not yet written their files of the checkpoint in flight."""
    return int(reduced[1].item())


def mean_last_step_s(reduced: torch.Tensor, world_size: int) -> float:
    """The previous step's time, the mean over the ranks: the same number on every rank."""
    return reduced[2].item() / world_size


def view(reduced: torch.Tensor, *, replicas: int, grad_norm, applied: bool,
         cp: int = 1) -> StepView:
    """The step as every rank sees it: the reduced loss (the host waits for the device here)
    over the `replicas` that added to it, DeepSpeed's global gradient norm (a tensor, a float
    or None) and was_step_applied(). The `cp` context-parallel ranks of a replica each count
    its whole sequences' score pairs."""
    loss_sum, pairs = reduced[[0, 3]].tolist()  # the host waits for the device here
    loss = loss_sum / replicas
    norm = None if grad_norm is None else float(grad_norm)
    return StepView(loss=loss, bad_loss=not math.isfinite(loss),
                    bad_norm=norm is not None and not math.isfinite(norm), skipped=not applied,
                    grad_norm=norm, score_pairs=pairs / cp)


def mean_over_replicas(loss: torch.Tensor) -> float:
    """The mean of a loss over the data-parallel replicas and the context-parallel shards
    (each the mean over as many tokens; a validation loss): one host sync."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(loss, group=group)
    return loss.item() / torch.distributed.get_world_size(group)


def ranks_where(flag: bool, device: torch.device) -> list[int]:
    """Every rank whose `flag` is true: one all-reduce over the world of a vector with a place
    per rank (a collective: every rank calls it; on bad steps and before saves only)."""
    flags = torch.zeros(torch.distributed.get_world_size(), dtype=torch.float32, device=device)
    if flag:
        flags[torch.distributed.get_rank()] = 1
    torch.distributed.all_reduce(flags)
    return [rank for rank, value in enumerate(flags.tolist()) if value > 0]


def finite(loss: torch.Tensor | None) -> bool:
    """Whether this rank's loss is finite (a rank without one has nothing wrong)."""
    return loss is None or bool(torch.isfinite(loss.detach()).all())


def weights_finite(module: torch.nn.Module) -> bool:
    """Whether every weight this rank holds is finite: under ZeRO-3 its partition
    (`ds_tensor`; the full tensor exists only inside a forward or backward). One host sync."""
    tensors = [getattr(p, "ds_tensor", p).detach() for p in module.parameters()]
    checks = [torch.isfinite(t).all() for t in tensors if t.numel()]
    return not checks or bool(torch.stack(checks).all())


class Guard:
    """The decisions about each step, the same on every rank (they see the same StepView)."""

    def __init__(self, train: TrainConfig):
        self.skip = train.on_nonfinite == "skip"
        self.max_in_a_row = train.max_consecutive_skips
        self.fp16 = train.precision == "fp16"
        self.spike_factor, self.spike_stops = train.spike_factor, train.on_spike == "stop"
        self.recent: deque[float] = deque(maxlen=train.spike_window)
        self.in_a_row = 0  # bad steps in a row, up to the last one judged

    def judge(self, step: int, seen: StepView) -> BadStep | None:
        """None for a good step; else what was bad and what the run does about it."""
        what = self._nonfinite(seen)
        if what:
            self.in_a_row += 1
            # An update that was applied anyway cannot be taken back: stop, whatever the recipe.
            dropped = seen.skipped
            action = "skip" if self.skip and dropped and self.in_a_row <= self.max_in_a_row \
                else "stop"
            if not dropped:
                what += "; DeepSpeed applied its update"
            elif self.skip and action == "stop":
                what += (f", {self.in_a_row} steps in a row: more than "
                         f"train.max_consecutive_skips ({self.max_in_a_row})")
            return BadStep(step=step, kind="nonfinite", what=what, action=action,
                           in_a_row=self.in_a_row)
        self.in_a_row = 0
        return self._spike(step, seen.loss)

    def _nonfinite(self, seen: StepView) -> str:
        """What was not finite ('' for nothing). Under fp16 a skipped update with a finite loss
        is the loss scaler's overflow, which it handles by itself."""
        bad_grads = (seen.bad_norm or seen.skipped) and not self.fp16
        parts = (["loss"] if seen.bad_loss else []) + (["gradient norm"] if bad_grads else [])
        return "non-finite " + " and ".join(parts) if parts else ""

    def _spike(self, step: int, loss: float) -> BadStep | None:
        if not self.spike_factor or not math.isfinite(loss):
            return None
        full = len(self.recent) == self.recent.maxlen
        median = statistics.median(self.recent) if full else None
        self.recent.append(loss)
        if median is None or median <= 0 or loss <= self.spike_factor * median:
            return None
        return BadStep(step=step, kind="spike",
                       what=(f"loss spike: {loss:.4f} is {loss / median:.1f}x the median "
                             f"{median:.4f} of the last {self.recent.maxlen} steps"),
                       action="stop" if self.spike_stops else "report")
