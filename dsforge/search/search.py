"""`dsforge plan --search`: the three-step procedure over every valid layout.

  1. fit:        estimated peak memory per GPU <= GPU memory x (1 - profile.memory_margin)
  2. batch:      the global batch equals the target (else the nearest achievable, said so)
  3. throughput: ranked by the predicted step time (cost.py), fastest first, except that
                 layouts within the model's error of the fastest tie, and ties go to the
                 simpler layout (`rank`, docs/search.md "Ties")

Each ranked candidate carries its memory estimate, step-time breakdown and band, tokens/s and
MFU, and the reason it beat the next one (explain.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

from dsforge.cost.profile import ClusterProfile
from dsforge.cost.step_time import StepTime, step_time
from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.memory import MemoryEstimate
from dsforge.recipe.resolve import Resolved
from dsforge.schema import ModelConfig, Recipe
from dsforge.search.explain import with_reasons
from dsforge.search.space import Candidate, Space, enumerate_candidates
from dsforge.translate.kernels import predicted_memory


@dataclass(frozen=True)
class Ranked:
    resolved: Resolved
    memory: MemoryEstimate
    time: StepTime
    tokens_per_s: float
    mfu: float
    exact_batch: bool
    error: float = 0.0  # relative band of the predicted step time (profile.prediction_error)
    tied: bool = False  # its layout's fastest variant, with a band overlapping the fastest one's
    reason: str = ""  # why it beat the next candidate

    @property
    def band(self) -> tuple[float, float]:
        """Where the measured step time lies for the median published run: t (1 -+ error)."""
        return self.time.total * (1 - self.error), self.time.total * (1 + self.error)

    def parallel_layout(self) -> tuple[int, int, int, int, int, int]:
        """(tp, cp, pp, vpp, ep, dp): what a tie is decided on; the ZeRO stage, micro-batch,
        checkpointing and sequence parallelism are variants of one layout."""
        lay = self.resolved.layout
        return lay.tp, lay.cp, lay.pp, lay.vpp, lay.ep, lay.dp

    def parallel_dimensions(self) -> tuple[str, ...]:
        """The model-parallel dimensions in use: tp, cp, pp, interleaving (vpp), ep. Data
        parallelism is not counted: every layout replicates over what is left, and it adds
        no collective to the critical path of a layer or a schedule to the step."""
        lay = self.resolved.layout
        used = (("tp", lay.tp), ("cp", lay.cp), ("pp", lay.pp), ("vpp", lay.vpp), ("ep", lay.ep))
        return tuple(name for name, size in used if size > 1)

    def layout_row(self) -> dict:
        """The layout choices that tell candidates apart (JSON output, tables, reasons)."""
        lay, recipe = self.resolved.layout, self.resolved.recipe
        return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "dp": lay.dp,
                "zero": recipe.zero.stage, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
                "global_batch": lay.global_batch, "checkpointing": recipe.train.activation_checkpointing,
                "sequence_parallel": lay.sequence_parallel, "schedule": lay.schedule}

    def shape(self) -> str:
        """One line, e.g. `tp2 pp8 vpp5 dp2 ZeRO-1 mb1 ckpt none` (shape_of)."""
        return shape_of(self.layout_row())

    def to_dict(self) -> dict:
        """The candidate in `plan --search --json` and on the explorer page."""
        return {"layout": self.layout_row(), "memory_bytes": self.memory.to_dict(),
                "memory_worst_pipeline_rank": self.memory.pipeline_rank,
                "step_time_s": self.time.to_dict(), "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s / self.resolved.layout.world_size,
                "step_time_band_s": list(self.band), "tied_with_fastest": self.tied,
                "mfu": self.mfu, "exact_batch": self.exact_batch, "why_above_next": self.reason}


def shape_of(x: dict) -> str:
    """A layout row (Ranked.layout_row, `plan --search --json`'s "layout") in one line, e.g.
    `tp2 pp8 vpp5 dp2 ZeRO-1 mb1 ckpt none` (cp, vpp and ep shown when > 1)."""
    cp = f" cp{x['cp']}" if x["cp"] > 1 else ""
    vpp = f" vpp{x['vpp']}" if x["vpp"] > 1 else ""
    ep = f" ep{x['ep']}" if x["ep"] > 1 else ""
    return (f"tp{x['tp']}{cp} pp{x['pp']}{vpp}{ep} dp{x['dp']} ZeRO-{x['zero']} "
            f"mb{x['micro_batch']} ckpt {x['checkpointing']}")


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


def candidate_memory(candidate: Candidate) -> MemoryEstimate:
    return predicted_memory(candidate.resolved, device="cuda")


def evaluate(candidate: Candidate, profile: ClusterProfile, memory: MemoryEstimate | None = None) -> Ranked:
    """The candidate's memory (`memory` when already estimated), step time, throughput and MFU."""
    resolved = candidate.resolved
    recipe, layout = resolved.recipe, resolved.layout
    memory = candidate_memory(candidate) if memory is None else memory
    predicted = step_time(resolved, profile)
    tokens_per_s = layout.global_batch * recipe.train.seq_len / predicted.total
    model_flops = _model_flops(recipe.model, recipe.train.seq_len)
    mfu = tokens_per_s * model_flops / (layout.world_size * profile.gpu.peak_bf16_flops)
    return Ranked(resolved=resolved, memory=memory, time=predicted, tokens_per_s=tokens_per_s,
                  mfu=mfu, exact_batch=candidate.exact_batch, error=profile.prediction_error)


@functools.lru_cache(maxsize=64)
def _model_flops(model: ModelConfig, seq_len: int) -> float:
    # The same for every candidate of a search: counting the model's parameters once, not
    # once per candidate, was a third of a search's time.
    return flops_per_token(model, seq_len).model


def search(base: Recipe, space: Space, profile: ClusterProfile) -> SearchResult:
    started = time.perf_counter()
    candidates, considered = enumerate_candidates(base, space)
    # Every valid candidate's memory (the fit); the step time only for those that fit, the
    # ones ranked, and for the smallest when none does.
    memories = [candidate_memory(c) for c in candidates]
    fitting = [evaluate(c, profile, m) for c, m in zip(candidates, memories)
               if m.total <= profile.usable_memory_bytes]
    exact = [r for r in fitting if r.exact_batch]
    chosen = exact or _nearest_batch(fitting, space.global_batch)
    result = SearchResult(space=space, profile=profile, considered=considered, valid=len(candidates),
                          fit=len(fitting), batch_exact=bool(exact), ranked=with_reasons(rank(chosen)))
    if not fitting and candidates:
        smallest = min(range(len(candidates)), key=lambda i: memories[i].total)
        result.nearest_memory = evaluate(candidates[smallest], profile, memories[smallest])
    result.seconds = time.perf_counter() - started
    return result


def _predicted_order(r: Ranked) -> tuple:
    # Faster first, then less memory; the layout's text settles exact equality, so the order
    # never depends on the order the space enumerates in.
    return r.time.total, r.memory.total, r.shape(), r.resolved.layout.sequence_parallel


def tie_key(r: Ranked) -> tuple:
    """How tied layouts are ordered: fewer model-parallel dimensions, then a shallower
    pipeline (pp, then vpp), then a smaller tensor x context x expert degree (their per-layer
    collectives), then more memory headroom (less memory on the same GPU), then the prediction."""
    lay = r.resolved.layout
    return (len(r.parallel_dimensions()), lay.pp, lay.vpp, lay.tp * lay.cp * lay.ep, r.memory.total,
            _predicted_order(r))


def rank(rows: list[Ranked]) -> list[Ranked]:
    """The candidates in the order shown: first the tied layouts, then the rest, fastest first.

    A layout (tp, cp, pp, vpp, ep, dp) ties when the band of its fastest variant overlaps the band
    of the fastest candidate: the published comparison cannot tell them apart. Each tied layout
    is listed once, by its fastest variant, in `tie_key` order; its other variants (ZeRO stage,
    micro-batch, checkpointing, sequence parallelism) follow with everything else by predicted
    time, since ordering those by headroom would trade up to the band's width in step time for
    memory the layout does not need."""
    by_time = sorted(rows, key=_predicted_order)
    if not by_time:
        return []
    fastest_high = by_time[0].band[1]
    fastest_variant: dict[tuple, Ranked] = {}
    for r in by_time:
        fastest_variant.setdefault(r.parallel_layout(), r)
    tied = sorted((r for r in fastest_variant.values() if r.band[0] <= fastest_high), key=tie_key)
    tied_ids = {id(r) for r in tied}
    rest = [r for r in by_time if id(r) not in tied_ids]
    return [dataclasses.replace(r, tied=True) for r in tied] + rest


def _nearest_batch(rows: list[Ranked], target: int) -> list[Ranked]:
    if not rows:
        return []
    best = min(abs(r.resolved.layout.global_batch - target) for r in rows)
    return [r for r in rows if abs(r.resolved.layout.global_batch - target) == best]
