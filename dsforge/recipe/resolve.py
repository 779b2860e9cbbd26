"""Resolve a recipe against a world: the topology, then the concrete layout.

`resolve_file` is the whole path from a recipe file (and hostfile) to a Resolved, raising
every problem at once. `topology_for` decides the world size from every source that names
one (--world-size, a hostfile, the recipe's cluster section, an explicit parallel.dp) and
reports a conflict instead of picking one (rule Y4). `resolve` turns a validated recipe into
a new Recipe with dp and the batch arithmetic filled in, plus the Layout every downstream
step uses. Nothing is mutated; nothing is silently corrected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dsforge.problems import Problem, RecipeError, errors
from dsforge.recipe.hostfile import Hostfile, active_hosts, read_hostfile
from dsforge.recipe.layout import Topology, batch_sizes, data_parallel_size
from dsforge.recipe.loader import load_recipe
from dsforge.recipe.validate import validate
from dsforge.schema import MAX_WORLD, Recipe


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

    @property
    def dp_cp(self) -> int:
        """The data-parallel size DeepSpeed sees: the replicas times the context-parallel
        ranks (each holds a shard of the same sequences), the group ZeRO partitions over and
        the dense gradients reduce over (runtime/assemble/engine.py MegatronMPU)."""
        return self.dp * self.cp

    @property
    def expert_shards(self) -> int:
        """The ranks ZeRO partitions an expert's states over: with ep > 1 the expert-data-
        parallel group (runtime/assemble/moe_glue.py registers Megatron's with DeepSpeed); at
        ep 1 Megatron marks the experts allreduce, so they are dense parameters to DeepSpeed,
        partitioned over dp x cp like the rest (at etp < tp every tensor-parallel rank holds a
        whole copy, its gradient summed over tp by runtime/assemble/grads.py)."""
        return self.edp if self.ep > 1 else self.dp_cp


@dataclass(frozen=True, kw_only=True)
class Resolved:
    recipe: Recipe  # parallel.dp and the train batch sizes are concrete
    layout: Layout
    topology: Topology
    warnings: tuple[Problem, ...] = ()


def topology_for(recipe: Recipe, *, world_size: int | None = None,
                 hostfile: Hostfile | None = None,
                 world_size_from: str = "--world-size") -> tuple[Topology | None, list[Problem]]:
    """The world this recipe runs in, from every source that names one; conflicts are errors.
    `world_size_from`: where the user gave `world_size` (a study's `world_size:`, not a flag)."""
    sources: list[tuple[str, int]] = []
    if world_size is not None:
        sources.append((world_size_from, world_size))
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
    elif first_size > MAX_WORLD:
        problems.append(Problem(rule="Y4", fields={first_name: first_size},
                                message=f"the world size must be at most {MAX_WORLD:,} GPUs "
                                        "(dsforge's limit, far beyond real clusters)",
                                fix="check the number of GPUs"))
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


def resolve(recipe: Recipe, topology: Topology) -> Resolved:
    """The concrete recipe and layout; raises RecipeError if the recipe does not validate."""
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


def resolve_file(path: str | Path, overrides: Iterable[str] = (), *, world_size: int | None = None,
                 hostfile: str | Path | None = None, include: str = "",
                 exclude: str = "", world_size_from: str = "--world-size") -> Resolved:
    """Load the recipe at `path` (with `section.field=value` overrides), place it in the world
    given by `world_size`, the hostfile (narrowed by DeepSpeed's --include/--exclude) or the
    recipe itself, validate and resolve it. Raises RecipeError with every problem found;
    hostfile and recipe problems are reported together, since either can be fixed first."""
    problems: list[Problem] = []
    hosts = recipe = None
    try:
        hosts = active_hosts(read_hostfile(hostfile), include, exclude) if hostfile else None
    except RecipeError as exc:
        problems.extend(exc.problems)
    try:
        recipe = load_recipe(path, overrides)
    except RecipeError as exc:
        problems.extend(exc.problems)
    if problems:
        raise RecipeError(problems)
    topology, problems = topology_for(recipe, world_size=world_size, hostfile=hosts,
                                      world_size_from=world_size_from)
    if problems:
        raise RecipeError(problems)
    return resolve(recipe, topology)
