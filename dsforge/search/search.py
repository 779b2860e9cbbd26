"""`dsforge plan --search`: the three-step procedure over every valid layout.

  1. fit:        estimated peak memory per GPU <= GPU memory x (1 - profile.memory_margin)
  2. batch:      the global batch equals the target (else the nearest achievable, said so)
  3. throughput: ranked by the predicted step time (cost.py), fastest first

Each ranked candidate carries its memory estimate, step-time breakdown, tokens/s and MFU,
and the reason it beat the next one (explain.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.recipe.resolve import Resolved
from dsforge.recipe.schema import Recipe
from dsforge.search.cost import StepTime, step_time
from dsforge.search.explain import with_reasons
from dsforge.search.profile import ClusterProfile
from dsforge.search.space import Candidate, Space, enumerate_candidates


@dataclass(frozen=True)
class Ranked:
    resolved: Resolved
    memory: MemoryEstimate
    time: StepTime
    tokens_per_s: float
    mfu: float
    exact_batch: bool
    reason: str = ""  # why it beat the next candidate

    def layout_row(self) -> dict:
        """The layout choices that tell candidates apart (JSON output, tables, reasons)."""
        lay, recipe = self.resolved.layout, self.resolved.recipe
        return {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "dp": lay.dp,
                "zero": recipe.zero.stage, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
                "global_batch": lay.global_batch, "checkpointing": recipe.train.activation_checkpointing,
                "sequence_parallel": lay.sequence_parallel, "schedule": lay.schedule}

    def shape(self) -> str:
        """One line, e.g. `tp2 pp8 vpp5 dp2 ZeRO-1 mb1 ckpt none` (vpp and ep shown when > 1)."""
        x = self.layout_row()
        vpp = f" vpp{x['vpp']}" if x["vpp"] > 1 else ""
        ep = f" ep{x['ep']}" if x["ep"] > 1 else ""
        return (f"tp{x['tp']} pp{x['pp']}{vpp}{ep} dp{x['dp']} ZeRO-{x['zero']} "
                f"mb{x['micro_batch']} ckpt {x['checkpointing']}")

    def to_dict(self) -> dict:
        """The candidate in `plan --search --json` and on the explorer page."""
        return {"layout": self.layout_row(), "memory_bytes": self.memory.to_dict(),
                "memory_worst_pipeline_rank": self.memory.pipeline_rank,
                "step_time_s": self.time.to_dict(), "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s / self.resolved.layout.world_size,
                "mfu": self.mfu, "exact_batch": self.exact_batch, "why_above_next": self.reason}


@dataclass
class SearchResult:
    space: Space
    profile: ClusterProfile
    considered: int  # layouts generated
    valid: int  # passed the recipe validator
    fit: int  # ... and fit in memory
    batch_exact: bool  # whether the ranked ones reach the target global batch exactly
    ranked: list[Ranked] = field(default_factory=list)
    seconds: float = 0.0
    nearest_memory: Ranked | None = None  # the smallest-memory layout when nothing fits


def evaluate(candidate: Candidate, profile: ClusterProfile) -> Ranked:
    resolved = candidate.resolved
    recipe, layout = resolved.recipe, resolved.layout
    memory = estimate_memory(model=recipe.model, train=recipe.train, zero=recipe.zero, layout=layout)
    predicted = step_time(resolved, profile)
    tokens_per_s = layout.global_batch * recipe.train.seq_len / predicted.total
    model_flops = flops_per_token(recipe.model, recipe.train.seq_len).model
    mfu = tokens_per_s * model_flops / (layout.world_size * profile.gpu.peak_bf16_flops)
    return Ranked(resolved=resolved, memory=memory, time=predicted, tokens_per_s=tokens_per_s,
                  mfu=mfu, exact_batch=candidate.exact_batch)


def search(base: Recipe, space: Space, profile: ClusterProfile) -> SearchResult:
    started = time.perf_counter()
    candidates, considered = enumerate_candidates(base, space)
    evaluated = [evaluate(c, profile) for c in candidates]
    fitting = [r for r in evaluated if r.memory.total <= profile.usable_memory_bytes]
    exact = [r for r in fitting if r.exact_batch]
    chosen = exact or _nearest_batch(fitting, space.global_batch)
    chosen.sort(key=lambda r: (r.time.total, r.memory.total))
    result = SearchResult(space=space, profile=profile, considered=considered, valid=len(candidates),
                          fit=len(fitting), batch_exact=bool(exact), ranked=with_reasons(chosen))
    if not fitting and evaluated:
        result.nearest_memory = min(evaluated, key=lambda r: r.memory.total)
    result.seconds = time.perf_counter() - started
    return result


def _nearest_batch(rows: list[Ranked], target: int) -> list[Ranked]:
    if not rows:
        return []
    best = min(abs(r.resolved.layout.global_batch - target) for r in rows)
    return [r for r in rows if abs(r.resolved.layout.global_batch - target) == best]
