"""The arithmetic of a layout: the world a recipe runs in, its dp, and its batch sizes.

Pure functions shared by `validate` (which reports when they do not come out whole) and
`resolve` (which fills them in), so neither module has to import the other's helpers.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass

from dsforge.schema import Recipe


@dataclass(frozen=True, kw_only=True)
class Topology:
    world_size: int
    node_slots: tuple[int, ...] | None = None  # ranks per node in rank order; None = unknown
    source: str = ""  # the recipe field or option the world size came from

    @functools.cached_property
    def _node_ends(self) -> list[int]:
        """For each node, the first rank of the next one (a plain dict write: frozen allows it)."""
        return list(itertools.accumulate(self.node_slots))

    @functools.cached_property
    def _spanning(self) -> dict[int, int]:
        """groups_spanning_nodes' answers by group size (a plain dict write: frozen allows it)."""
        return {}

    def groups_spanning_nodes(self, size: int) -> int | None:
        """How many groups of `size` consecutive ranks (ranks g*size .. g*size+size-1, as
        Megatron's tensor-parallel groups) have a node boundary inside them; None when the
        nodes are unknown. Computed once per size: a search asks it for every candidate."""
        if self.node_slots is None:
            return None
        if size not in self._spanning:
            boundaries = itertools.accumulate(self.node_slots[:-1])
            self._spanning[size] = len({boundary // size for boundary in boundaries if boundary % size})
        return self._spanning[size]

    def node_of(self, rank: int) -> int | None:
        if self.node_slots is None:
            return None
        ends = self._node_ends
        if not 0 <= rank < ends[-1]:
            raise ValueError(f"rank {rank} is outside a world of {ends[-1]}")
        return bisect.bisect_right(ends, rank)


def data_parallel_size(recipe: Recipe, world_size: int) -> int | None:
    """dp for this world, or None when the world does not divide (rules P1/P2 report it)."""
    p = recipe.parallel
    model_parallel = p.tp * p.pp * p.cp
    if p.dp != -1:
        return p.dp if p.dp * model_parallel == world_size else None
    return world_size // model_parallel if world_size % model_parallel == 0 else None


@dataclass(frozen=True)
class BatchSizes:
    global_batch: int
    micro_batch: int
    grad_accum: int


def batch_sizes(recipe: Recipe, dp: int) -> BatchSizes | None:
    """global = micro x grad_accum x dp from the values the recipe gives; None when they do
    not fit (rules B1/B2 report why)."""
    t = recipe.train
    return derive_batch(t.global_batch, t.micro_batch, t.grad_accum, dp)


def derive_batch(global_batch: int | None, micro_batch: int | None, grad_accum: int | None,
                 dp: int) -> BatchSizes | None:
    """Any two of global/micro/grad_accum fix the third; alone, micro_batch defaults to 1."""
    given, micro, accum = global_batch, micro_batch, grad_accum
    if given is not None and accum is not None and micro is None:
        micro, remainder = divmod(given, accum * dp)
        return BatchSizes(given, micro, accum) if micro and not remainder else None
    micro = micro or 1
    if given is None:
        return BatchSizes(micro * (accum or 1) * dp, micro, accum or 1)
    accum_needed, remainder = divmod(given, micro * dp)
    if remainder or not accum_needed or accum not in (None, accum_needed):
        return None
    return BatchSizes(given, micro, accum_needed)
