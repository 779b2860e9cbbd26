"""The layouts a search considers, each checked by the same validator `dsforge run` uses.

Axes: tp (powers of two up to the node size and the head count), pp (divisors of the layer
count), vpp (divisors of the layers per pipeline rank, up to MAX_VPP), ep (MoE: divisors of
the expert count), dp (the rest), ZeRO stage 0-3, micro-batch (powers of two), activation
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
from typing import Iterator

from dsforge.problems import RecipeError
from dsforge.recipe.resolve import Resolved, Topology, resolve
from dsforge.schema import ClusterConfig, Recipe, divisors

MICRO_BATCHES = (1, 2, 4, 8, 16)
MAX_VPP = 8
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Space:
    gpus: int
    gpus_per_node: int
    global_batch: int  # target, sequences per optimizer step
    gpu: str | None = None  # a key of dsforge.hardware.GPUS

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


def model_parallel_shapes(recipe: Recipe, space: Space) -> Iterator[tuple[int, int, int, int]]:
    """(tp, pp, vpp, ep) that can divide this model and world; the validator has the last word."""
    m = recipe.model
    for tp in _powers_of_two_up_to(min(space.gpus_per_node, m.num_attention_heads)):
        for pp in divisors(m.num_layers):
            if space.gpus % (tp * pp):
                continue
            dp = space.gpus // (tp * pp)
            vpps = [v for v in divisors(m.num_layers // pp) if v <= MAX_VPP] if pp > 1 else [1]
            eps = [e for e in divisors(m.moe.num_experts) if dp % e == 0] if m.moe else [1]
            for vpp, ep in itertools.product(vpps, eps):
                yield tp, pp, vpp, ep


def _global_batch(target: int, per_microbatch_step: int) -> int:
    steps = max(1, round(target / per_microbatch_step))
    return steps * per_microbatch_step


def candidate_recipes(base: Recipe, space: Space) -> Iterator[Recipe]:
    cluster = space.cluster()
    for tp, pp, vpp, ep in model_parallel_shapes(base, space):
        dp = space.gpus // (tp * pp)
        for sp, stage, micro, checkpointing in itertools.product(
                (False, True) if tp > 1 else (False,), range(4), MICRO_BATCHES, CHECKPOINTING):
            try:
                yield dataclasses.replace(
                    base,
                    parallel=dataclasses.replace(base.parallel, tp=tp, pp=pp, vpp=vpp, ep=ep, dp=-1,
                                                 etp=None, cp=1, sequence_parallel=sp),
                    zero=dataclasses.replace(base.zero, stage=stage, offload_optimizer="none",
                                             offload_params="none", offload_ratio=1.0),
                    train=dataclasses.replace(
                        base.train, micro_batch=micro, grad_accum=None,
                        global_batch=_global_batch(space.global_batch, micro * dp),
                        activation_checkpointing=checkpointing),
                    cluster=cluster)
            except RecipeError:  # a section's own rule (e.g. schema-level) refuses it
                continue


def enumerate_candidates(base: Recipe, space: Space) -> tuple[list[Candidate], int]:
    """Every valid candidate, and how many were considered in all."""
    topology = space.topology()
    valid, considered = [], 0
    for recipe in candidate_recipes(base, space):
        considered += 1
        try:
            resolved = resolve(recipe, topology)  # the full validator, as `dsforge run` uses it
        except RecipeError:
            continue
        valid.append(Candidate(resolved=resolved,
                               exact_batch=resolved.layout.global_batch == space.global_batch))
    return valid, considered
