"""The layouts a search considers, each checked by the same validator `dsforge run` uses
(after prune.py's cheap conditions, which drop only layouts that validator refuses).

Axes: tp (powers of two up to the node size and the head count), cp (context parallelism:
powers of two, from CP_MIN_SEQ_LEN tokens a sequence), pp (divisors of the layer count), vpp
(divisors of the layers per pipeline rank, up to MAX_VPP), ep (MoE: divisors of the expert
count), dp (the rest), ZeRO stage 0-3, micro-batch (powers of two), activation
checkpointing none/selective/full, and sequence parallelism with tp >= 2. Which ZeRO stage may
go with a pipeline (rule Z2: ZeRO-2 and ZeRO-3 yes, fp16 no) is the validator's call, not
repeated here: ZeRO-2 and ZeRO-3 with pp > 1 are enumerated and pay their per-microbatch
collectives in the step-time model (cost.py), so they rank first only where nothing cheaper fits. Optimizer and
parameter offload are left out: they trade step time for memory in ways the step-time model
does not cover.

The global batch is the target's when micro x dp divides it; otherwise the nearest
achievable one, marked inexact (the search's step 2 keeps exact ones when there are any).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

from dsforge.problems import RecipeError
from dsforge.recipe.resolve import Resolved, Topology, resolve
from dsforge.schema import ClusterConfig, Recipe, divisors
from dsforge.search.prune import shape_refusal, variant_refusal

MICRO_BATCHES = (1, 2, 4, 8, 16)
MAX_VPP = 8
# Context parallelism is searched from this sequence length up. Below it the split saves
# activations a layout rarely needs and costs its all-to-alls and shorter GEMMs (Megatron's
# and the Ultra-Scale Playbook's advice: cp for long sequences); searching it at 4,096 tokens
# doubled the search's layouts without one ranking first. A recipe may still set cp anywhere.
CP_MIN_SEQ_LEN = 8192
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Space:
    gpus: int
    gpus_per_node: int
    global_batch: int  # target, sequences per optimizer step
    gpu: str | None = None  # a key of dsforge.hardware.GPUS
    cp_min_seq_len: int = CP_MIN_SEQ_LEN  # the cp axis exists from this sequence length up

    @property
    def node_slots(self) -> tuple[int, ...] | None:
        """GPUs per node in rank order; None when the GPUs do not fill whole nodes."""
        if self.gpus <= self.gpus_per_node:
            return (self.gpus,)
        nodes, rest = divmod(self.gpus, self.gpus_per_node)
        return None if rest else (self.gpus_per_node,) * nodes

    def topology(self) -> Topology:
        return Topology(world_size=self.gpus, node_slots=self.node_slots, source="--gpus")

    def cluster(self) -> ClusterConfig | None:
        slots = self.node_slots
        return ClusterConfig(nodes=len(slots), gpus_per_node=slots[0], gpu=self.gpu) if slots else None


@dataclass(frozen=True)
class Candidate:
    resolved: Resolved
    exact_batch: bool


def _powers_of_two_up_to(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def model_parallel_shapes(recipe: Recipe, space: Space) -> Iterator[tuple[int, int, int, int, int]]:
    """(tp, cp, pp, vpp, ep) that can divide this model and world; the validator has the last
    word."""
    m = recipe.model
    for tp in _powers_of_two_up_to(min(space.gpus_per_node, m.num_attention_heads)):
        for pp in divisors(m.num_layers):
            if space.gpus % (tp * pp):
                continue
            cps = (_powers_of_two_up_to(space.gpus // (tp * pp))
                   if recipe.train.seq_len >= space.cp_min_seq_len else [1])
            vpps = [v for v in divisors(m.num_layers // pp) if v <= MAX_VPP] if pp > 1 else [1]
            for cp in (c for c in cps if space.gpus % (tp * pp * c) == 0):
                dp = space.gpus // (tp * pp * cp)
                eps = [e for e in divisors(m.moe.num_experts) if dp % e == 0] if m.moe else [1]
                for vpp, ep in itertools.product(vpps, eps):
                    yield tp, cp, pp, vpp, ep


def _global_batch(target: int, per_microbatch_step: int) -> int:
    steps = max(1, round(target / per_microbatch_step))
    return steps * per_microbatch_step


class Variant(NamedTuple):
    """One point of the space: a model-parallel shape and the choices varied inside it."""
    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    dp: int
    sequence_parallel: bool
    stage: int
    micro_batch: int
    checkpointing: str
    global_batch: int

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)


def variants(base: Recipe, space: Space) -> Iterator[Variant]:
    """Every point of the space, in the order the search lists them."""
    for tp, cp, pp, vpp, ep in model_parallel_shapes(base, space):
        dp = space.gpus // (tp * pp * cp)
        for sp, stage, micro, checkpointing in itertools.product(
                (False, True) if tp > 1 else (False,), range(4), MICRO_BATCHES, CHECKPOINTING):
            yield Variant(tp, cp, pp, vpp, ep, dp, sp, stage, micro, checkpointing,
                          _global_batch(space.global_batch, micro * dp))


class Sections:
    """The recipe sections variants are made of, each built (and checked by its own section's
    rules) once: thousands of variants share a few dozen sections. None: a section's own rule
    refuses it, and the variant is not a candidate (nor counted as considered)."""

    def __init__(self, base: Recipe):
        self.base = base
        self._built: dict[tuple, Any] = {}

    def _once(self, key: tuple, build: Callable[[], Any]) -> Any:
        if key not in self._built:
            try:
                self._built[key] = build()
            except RecipeError:
                self._built[key] = None
        return self._built[key]

    def of(self, v: Variant) -> dict[str, Any] | None:
        """parallel, zero and train for this variant; None when one of them is refused."""
        b = self.base
        parts = {
            "parallel": self._once(("parallel", v.tp, v.cp, v.pp, v.vpp, v.ep, v.sequence_parallel),
                                   lambda: dataclasses.replace(
                                       b.parallel, tp=v.tp, pp=v.pp, vpp=v.vpp, ep=v.ep, dp=-1,
                                       etp=None, cp=v.cp, sequence_parallel=v.sequence_parallel)),
            "zero": self._once(("zero", v.stage), lambda: dataclasses.replace(
                b.zero, stage=v.stage, offload_optimizer="none", offload_params="none",
                offload_ratio=1.0)),
            "train": self._once(("train", v.micro_batch, v.global_batch, v.checkpointing),
                                lambda: dataclasses.replace(
                                    b.train, micro_batch=v.micro_batch, grad_accum=None,
                                    global_batch=v.global_batch,
                                    activation_checkpointing=v.checkpointing)),
        }
        return None if None in parts.values() else parts


def candidate_recipes(base: Recipe, space: Space) -> Iterator[Recipe]:
    """The recipe of every variant whose sections pass their own rules (the considered ones)."""
    sections, cluster = Sections(base), space.cluster()
    for v in variants(base, space):
        parts = sections.of(v)
        if parts is not None:
            # Recipe's own rule reads only its name, which the base recipe has passed.
            yield dataclasses.replace(base, **parts, cluster=cluster)


def enumerate_candidates(base: Recipe, space: Space) -> tuple[list[Candidate], int]:
    """Every valid candidate, and how many were considered in all.

    Cheap necessary conditions first (prune.py: rules that refuse a variant whatever the rest
    of the recipe says, asked once per shape where they read only the shape); the full
    validator, as `dsforge run` uses it, decides what they let through."""
    topology, cluster = space.topology(), space.cluster()
    sections, shape_refused = Sections(base), {}
    m, precision, seq_len = base.model, base.train.precision, base.train.seq_len
    valid, considered = [], 0
    for v in variants(base, space):
        parts = sections.of(v)
        if parts is None:
            continue
        considered += 1
        shape = (v.tp, v.cp, v.pp, v.sequence_parallel)
        if shape not in shape_refused:
            shape_refused[shape] = shape_refusal(m, precision, seq_len, tp=v.tp, cp=v.cp, pp=v.pp,
                                                 sp=v.sequence_parallel)
        if shape_refused[shape] or variant_refusal(m, pp=v.pp, vpp=v.vpp, ep=v.ep, stage=v.stage,
                                                   microbatches=v.microbatches):
            continue
        valid += _validated(dataclasses.replace(base, **parts, cluster=cluster), topology, space)
    return valid, considered


def exhaustive_candidates(base: Recipe, space: Space) -> tuple[list[Candidate], int]:
    """What enumerate_candidates finds, by the full validator alone on every considered
    recipe: the reference its cheap conditions are tested against."""
    topology, valid, considered = space.topology(), [], 0
    for recipe in candidate_recipes(base, space):
        considered += 1
        valid += _validated(recipe, topology, space)
    return valid, considered


def _validated(recipe: Recipe, topology: Topology, space: Space) -> list[Candidate]:
    """[the candidate] when the full validator accepts the recipe, else []."""
    try:
        resolved = resolve(recipe, topology)  # the full validator, as `dsforge run` uses it
    except RecipeError:
        return []
    return [Candidate(resolved=resolved, exact_batch=resolved.layout.global_batch == space.global_batch)]
