"""The changes to a recipe that the memory model predicts make it fit a GPU (pure).

After a rank ran out of memory, `dsforge run` names the changes a user makes first, each only
when predicted to fit: activation checkpointing (selective, full), a smaller micro-batch with
the same global batch (more microbatches), a higher ZeRO stage, and combinations of them when
no single one is enough. Every candidate goes through the validator `dsforge run` uses, on the
same world, and is judged by the memory model's most loaded rank (estimate/memory.py). Changes
of tp, pp or the number of GPUs are `dsforge plan --search`'s job.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator

from dsforge.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.problems import RecipeError
from dsforge.recipe.resolve import Resolved, resolve
from dsforge.schema import Recipe, ZeroConfig, divisors

CHECKPOINTING = ("none", "selective", "full")  # least recompute first
SHOWN = 3  # fixes named at most
# The share of the device kept free for what the memory model does not count (also the
# planner's default, cost/profile.py).
HEADROOM = 0.10


@dataclass(frozen=True)
class MemoryFix:
    changes: tuple[tuple[str, object], ...]  # (dotted field, value), as --set takes them
    predicted: float  # bytes on the most loaded rank

    @property
    def levers(self) -> int:
        """Checkpointing, micro-batch (with its grad_accum), ZeRO stage: how many move."""
        return sum(name != "train.grad_accum" for name, _ in self.changes)

    def overrides(self) -> str:
        return " ".join(f"--set {name}={value}" for name, value in self.changes)


def zero_at_stage(zero: ZeroConfig, stage: int) -> ZeroConfig:
    """The recipe's ZeRO options carried to another stage, where that stage allows them."""
    return dataclasses.replace(zero, stage=stage,
                               offload_optimizer=zero.offload_optimizer if stage >= 1 else "none",
                               offload_params=zero.offload_params if stage == 3 else "none",
                               offload_ratio=zero.offload_ratio if stage == 3 else 1.0)


def fit_limit(*, capacity: float, predicted: float, needed: float,
              headroom: float = HEADROOM) -> float:
    """The predicted peak a fix must stay under after an out-of-memory on a device of
    `capacity` bytes: the share the search's fit uses (the rest is for the CUDA context, NCCL
    and fragmentation, cost/profile.py), less what the rank `needed` beyond the prediction
    (memory the model does not count for this job, assumed to stay with any fix)."""
    return capacity * (1.0 - headroom) - max(0.0, needed - predicted)


def estimate(resolved: Resolved, *, fused_loss: bool = False,
             document_mask: bool = False) -> MemoryEstimate:
    """The memory model's most loaded rank for a resolved recipe (`fused_loss`,
    `document_mask`: see estimate_memory)."""
    r = resolved.recipe
    return estimate_memory(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                           fused_loss=fused_loss, document_mask=document_mask)


def memory_fixes(resolved: Resolved, limit: float, *, shown: int = SHOWN,
                 fused_loss: bool = False, document_mask: bool = False) -> list[MemoryFix]:
    """Up to `shown` valid variants predicted at or under `limit` bytes, none holding another
    one's changes: the fewest levers moved first, then the most memory used (the least
    recompute, the fewest extra microbatches)."""
    found = []
    for changes, recipe in _variants(resolved):
        try:
            candidate = resolve(recipe, resolved.topology)
        except RecipeError:
            continue
        predicted = estimate(candidate, fused_loss=fused_loss, document_mask=document_mask).total
        if predicted <= limit:
            found.append(MemoryFix(changes=changes, predicted=predicted))
    found.sort(key=lambda f: (f.levers, -f.predicted))
    kept: list[MemoryFix] = []
    for fix in found:  # fewer levers come first, so a fix's subsets are already kept or not
        if not any(set(k.changes) <= set(fix.changes) for k in kept):
            kept.append(fix)
    return kept[:shown]


def _variants(resolved: Resolved) -> Iterator[tuple[tuple[tuple[str, object], ...], Recipe]]:
    """Every combination of more checkpointing, a smaller micro-batch (a divisor of the
    current one, so the global batch stays) and a higher ZeRO stage, except the recipe itself."""
    recipe, layout = resolved.recipe, resolved.layout
    levels = CHECKPOINTING[CHECKPOINTING.index(recipe.train.activation_checkpointing):]
    micros = sorted(divisors(layout.micro_batch), reverse=True)
    for level, micro, stage in itertools.product(levels, micros, range(recipe.zero.stage, 4)):
        changes = _changes(resolved, level, micro, stage)
        if not changes:
            continue
        try:
            yield changes, _with(recipe, level=level, micro=micro, stage=stage,
                                 global_batch=layout.global_batch)
        except RecipeError:  # a section's own rule refuses the combination
            continue


def _changes(resolved: Resolved, level: str, micro: int, stage: int) -> tuple[tuple[str, object], ...]:
    recipe, layout = resolved.recipe, resolved.layout
    changes: list[tuple[str, object]] = []
    if level != recipe.train.activation_checkpointing:
        changes.append(("train.activation_checkpointing", level))
    if micro != layout.micro_batch:
        accum = layout.global_batch // (micro * layout.dp)
        changes += [("train.micro_batch", micro), ("train.grad_accum", accum)]
    if stage != recipe.zero.stage:
        changes.append(("zero.stage", stage))
    return tuple(changes)


def _with(recipe: Recipe, *, level: str, micro: int, stage: int, global_batch: int) -> Recipe:
    train = dataclasses.replace(recipe.train, activation_checkpointing=level, micro_batch=micro,
                                grad_accum=None, global_batch=global_batch)
    return dataclasses.replace(recipe, train=train, zero=zero_at_stage(recipe.zero, stage))
