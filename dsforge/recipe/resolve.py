"""Resolve a recipe against a world: the topology, then the concrete layout.

`topology_for` decides the world size from every source that names one (--world-size, a
hostfile, the recipe's cluster section, an explicit parallel.dp) and reports a conflict
instead of picking one (rule Y4). `resolve` turns a validated recipe into a new Recipe with
dp and the batch arithmetic filled in, plus the Layout every downstream step uses. Nothing is
mutated; nothing is silently corrected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsforge.launch.hostfile import Hostfile
from dsforge.problems import Problem, RecipeError, errors
from dsforge.recipe.schema import Recipe


@dataclass(frozen=True, kw_only=True)
class Topology:
    world_size: int
    node_slots: tuple[int, ...] | None = None  # ranks per node in rank order; None = unknown
    source: str = ""

    def node_of(self, rank: int) -> int | None:
        if self.node_slots is None:
            return None
        first = 0
        for node, slots in enumerate(self.node_slots):
            if rank < first + slots:
                return node
            first += slots
        raise ValueError(f"rank {rank} is outside a world of {sum(self.node_slots)}")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The concrete parallel layout and batch arithmetic of a resolved recipe."""

    world_size: int
    dp: int
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    etp: int
    edp: int  # expert data parallel: world / (etp * ep * pp)
    sequence_parallel: bool
    micro_batch: int
    grad_accum: int  # microbatches per optimizer step (= per pipeline flush)
    global_batch: int
    schedule: str  # none | 1f1b | interleaved

    @property
    def num_microbatches(self) -> int:
        return self.grad_accum


@dataclass(frozen=True, kw_only=True)
class Resolved:
    recipe: Recipe  # parallel.dp and the train batch sizes are concrete
    layout: Layout
    topology: Topology
    warnings: tuple[Problem, ...] = ()


def topology_for(recipe: Recipe, *, world_size: int | None = None,
                 hostfile: Hostfile | None = None) -> tuple[Topology | None, list[Problem]]:
    """The world this recipe runs in, from every source that names one; conflicts are errors."""
    sources: list[tuple[str, int]] = []
    if world_size is not None:
        sources.append(("--world-size", world_size))
    if hostfile is not None:
        sources.append((f"hostfile {hostfile.source} (total slots)", hostfile.total_slots))
    if recipe.cluster is not None:
        sources.append(("cluster.nodes x cluster.gpus_per_node", recipe.cluster.world_size))
    p = recipe.parallel
    if p.dp != -1:
        sources.append(("parallel.dp x tp x pp x cp", p.dp * p.tp * p.pp * p.cp))
    if not sources:
        return None, [Problem(rule="Y4", message="the world size is not known",
                              fix="pass --world-size N or --hostfile FILE, add a cluster: "
                                  "section, or set parallel.dp explicitly")]
    (first_name, first_size), problems = sources[0], []
    for name, size in sources[1:]:
        if size != first_size:
            problems.append(Problem(rule="Y4", fields={first_name: first_size, name: size},
                                    message="these sources disagree on the world size",
                                    fix="make them name the same number of GPUs"))
    if first_size < 1:
        problems.append(Problem(rule="Y4", fields={first_name: first_size},
                                message="the world size must be >= 1", fix="use 1 or more GPUs"))
    if problems:
        return None, problems
    return Topology(world_size=first_size, node_slots=_node_slots(recipe, hostfile),
                    source=first_name), []


def _node_slots(recipe: Recipe, hostfile: Hostfile | None) -> tuple[int, ...] | None:
    if hostfile is not None:
        return hostfile.node_slots
    if recipe.cluster is not None:
        return (recipe.cluster.gpus_per_node,) * recipe.cluster.nodes
    return None


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
    """global = micro x grad_accum x dp from the values given; None when they do not fit
    (rules B1/B2 report why). Any two fix the third; alone, micro_batch defaults to 1."""
    t = recipe.train
    given, micro, accum = t.global_batch, t.micro_batch, t.grad_accum
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


def resolve(recipe: Recipe, topology: Topology) -> Resolved:
    """The concrete recipe and layout; raises RecipeError if the recipe does not validate."""
    from dsforge.recipe.validate import validate

    problems = validate(recipe, topology)
    if errors(problems):
        raise RecipeError(problems)
    p, world = recipe.parallel, topology.world_size
    dp = data_parallel_size(recipe, world)
    batch = batch_sizes(recipe, dp)
    concrete = dataclasses.replace(
        recipe,
        parallel=dataclasses.replace(p, dp=dp, etp=p.expert_tp),
        train=dataclasses.replace(recipe.train, global_batch=batch.global_batch,
                                  micro_batch=batch.micro_batch, grad_accum=batch.grad_accum),
    )
    layout = Layout(world_size=world, dp=dp, tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep,
                    etp=p.expert_tp, edp=world // (p.expert_tp * p.ep * p.pp),
                    sequence_parallel=p.sequence_parallel, micro_batch=batch.micro_batch,
                    grad_accum=batch.grad_accum, global_batch=batch.global_batch,
                    schedule=recipe.schedule)
    return Resolved(recipe=concrete, layout=layout, topology=topology, warnings=tuple(problems))
