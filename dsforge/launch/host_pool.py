"""The hosts a multi-node job runs on across its restarts, and the failing ones it leaves out.

`dsforge run --hostfile H --max-restarts N` starts the job on the hostfile's hosts (after
--include/--exclude). When an attempt fails, the host that caused it is the host of the rank
that failed first (job/who_failed.py; the host from the hostfile's order of hosts and slots,
as DeepSpeed numbers the ranks: `gethostname` would name one machine for loopback hosts), or a
host that fails the preflight before a restart. A host that has caused `--exclude-after K`
failures is left out: a spare host with the same slots (`#spare host slots=N` lines) takes its
place, at its position, so every rank keeps its number and the resume stays exact. Without such
a spare the job goes on without the host (`on_fewer_hosts`): the recipe is resolved again for
the smaller world, data parallelism shrinking and gradient accumulation rising to keep the
global batch (refused with the layout rules' reason where tp, pp, cp, ep or the batch cannot
follow), and the ranks resume through the layout-free state (the losses continue, no longer
bitwise: other microbatches sum the same samples).

The default K: 1 for a failure that says the host itself is gone (a device error, a rank lost
without a word, a failed preflight), 2 for the others (a hang, a killed or stopped rank, a
failed collective: often the job's, not the host's, and the "same failure twice" rule of
launch/restart.py would end the job on the second anyway: the host is left out first).

DeepSpeed is handed a hostfile of the hosts in use only (RUN_DIR/hostfiles/attemptN), its
spares as the comments it skips. Under Slurm (launch/starts.SrunStarts) the hosts are the
allocation's nodes and the spares its last `--spare-nodes`; a job the nodes left cannot hold
ends for a requeue without them (`AllocationShort`, launch/restart.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from dsforge.job.failure import Failure
from dsforge.job.hosts import HOSTS_ENV, encode, host_of_rank
from dsforge.problems import Problem, RecipeError
from dsforge.recipe import Resolved, resolve, topology_for
from dsforge.recipe.hostfile import Hostfile

# Failures that say the host itself is gone: left out after the first.
HOST_GONE = ("device",)
WITHOUT_A_WORD = "without a record"  # who_failed's message for a rank lost with its host
PREFLIGHT = "preflight"


class CannotLeaveOut(Exception):
    """A host must be left out and the job cannot go on without it (no host would be left,
    or --include/--exclude chose slots); the message says why."""


class AllocationShort(Exception):
    """Under Slurm: the allocation's nodes left cannot hold the job (no spare node, and no
    node left or a layout that cannot shrink). The job ends for a requeue without `hosts`, the
    nodes it left out; the message says why."""

    def __init__(self, hosts: list[str], why: str):
        super().__init__(why)
        self.hosts = hosts


class HostsFailed(Exception):
    """Hosts in use failed the preflight before a restart (`refused` says how)."""

    def __init__(self, hosts: list[str], refused: Exception):
        super().__init__(", ".join(hosts))
        self.hosts, self.refused = hosts, refused


@dataclass
class HostPool:
    hostfile: Hostfile  # the hosts in use now, in rank order, and the spares left
    exclude_after: int | None = None  # --exclude-after; None: by kind (module docstring)
    slots_chosen: bool = False  # --include/--exclude name slots: no spare can have the same
    in_allocation: bool = False  # Slurm's nodes: a job they cannot hold asks for a requeue
    failures: dict[str, list[str]] = field(default_factory=dict)  # host -> kinds it caused
    left_out: list[dict] = field(default_factory=list)

    def host_of(self, rank: int) -> str | None:
        """The host of `rank`: DeepSpeed numbers ranks host by host, in hostfile order."""
        return host_of_rank(encode(self.hostfile.hosts), rank)

    def blame(self, cause: Failure) -> str | None:
        """Count `cause` against its rank's host; that host when it is to be left out now."""
        host = cause.host or self.host_of(cause.rank)
        if host is None:
            return None
        kind = "gone" if cause.kind in HOST_GONE or WITHOUT_A_WORD in cause.message else cause.kind
        return host if self._count(host, kind) else None

    def blame_preflight(self, host: str) -> bool:
        """A host in use that failed the preflight before a restart: whether to leave it out."""
        return self._count(host, PREFLIGHT)

    def _count(self, host: str, kind: str) -> bool:
        kinds = self.failures.setdefault(host, [])
        kinds.append(kind)
        if self.exclude_after is not None:
            return len(kinds) >= self.exclude_after
        return any(k in ("gone", PREFLIGHT) for k in kinds) or len(kinds) >= 2

    def why(self, host: str) -> str:
        """What `host` caused, in words: the reason it is left out."""
        words = {"gone": "a rank lost with its host or device", PREFLIGHT: "a failed preflight"}
        kinds = self.failures.get(host, [])
        return (f"{len(kinds)} failure{'s' if len(kinds) > 1 else ''} there: "
                + ", ".join(words.get(k, f"a {k} failure") for k in kinds))

    def leave_out(self, host: str, why: str, attempt: int) -> str | None:
        """`host` replaced by the first spare with its slots, at its position (the spare's
        name), or without one dropped (None: the world shrinks). CannotLeaveOut when no host
        would be left, or --include/--exclude chose slots."""
        slots = dict(self.hostfile.hosts)[host]
        if self.slots_chosen:
            raise CannotLeaveOut(f"{host} is left out ({why}), and --include/--exclude chose "
                                 "slots of the hosts, which neither a spare's nor fewer hosts "
                                 "can match")
        spare = next((s for s in self.hostfile.spares if s[1] == slots), None)
        if spare is None and len(self.hostfile.hosts) == 1:
            raise CannotLeaveOut(f"{host} is left out ({why}), and no host is left to run the "
                                 "job (no spare host has its slots)")
        if spare is None:
            hosts = tuple((h, n) for h, n in self.hostfile.hosts if h != host)
        else:
            hosts = tuple(spare if h == host else (h, n) for h, n in self.hostfile.hosts)
        spares = tuple(s for s in self.hostfile.spares if s != spare)
        source = self.hostfile.source + ("" if spare else f" without {host}")
        self.hostfile = Hostfile(hosts=hosts, spares=spares, source=source)
        self.left_out.append({"host": host, "why": why, "attempt": attempt,
                              "replaced_by": spare[0] if spare else None,
                              "hosts_after": list(self.hostfile.hostnames)})
        return spare[0] if spare else None

    def short(self, host: str, why: str) -> AllocationShort:
        """`host` must be left out and the nodes left cannot hold the job (`why`): the
        requeue without every host left out so far."""
        hosts = [e["host"] for e in self.left_out]
        return AllocationShort([*hosts, *([host] if host not in hosts else [])], why)

    def write(self, directory: Path, attempt: int) -> str:
        """The hostfile DeepSpeed gets for `attempt`: the hosts in use, the spares left."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"attempt{attempt}"
        path.write_text(self.hostfile.text())
        return str(path)


def hosts_env(hostfile: Hostfile) -> dict[str, str]:
    """The hosts in use, in rank order, for the ranks (job/hosts.py)."""
    return {HOSTS_ENV: encode(hostfile.hosts)}


def failing_hosts(problems: list[Problem], hostfile: Hostfile) -> list[str]:
    """The hosts in use that the preflight's errors name (`host` fields)."""
    named = {p.fields.get("host") for p in problems if p.severity == "error"}
    return [host for host in hostfile.hostnames if host in named]


def on_fewer_hosts(resolved: Resolved, hostfile: Hostfile) -> Resolved:
    """The job resolved again for `hostfile`'s smaller world: dp follows the world, grad_accum
    the kept global batch (with micro_batch), cluster.nodes the hosts. RecipeError with the
    layout rules' reasons where the layout cannot shrink."""
    recipe = resolved.recipe
    cluster = recipe.cluster and dataclasses.replace(recipe.cluster, nodes=len(hostfile.hosts))
    smaller = dataclasses.replace(
        recipe, cluster=cluster, parallel=dataclasses.replace(recipe.parallel, dp=-1),
        train=dataclasses.replace(recipe.train, grad_accum=None))
    topology, problems = topology_for(smaller, hostfile=hostfile)
    if problems:
        raise RecipeError(problems)
    return resolve(smaller, topology)


def layout_change(before: Resolved, after: Resolved) -> str:
    """What fewer hosts change, in words: `dp 2 -> 1, grad_accum 2 -> 4`."""
    old, new = before.layout, after.layout
    changes = [f"{name} {getattr(old, name)} -> {getattr(new, name)}"
               for name in ("world_size", "dp", "edp", "grad_accum")
               if getattr(old, name) != getattr(new, name)]
    return ", ".join(changes) + f" (global batch {new.global_batch} kept)"


def host_loss(resolved: Resolved) -> dict | None:
    """What losing one host without a spare does to the job (`dsforge plan`): the layout it
    goes on with on the hosts left (the last one lost), or why it cannot; None on one host."""
    slots = resolved.topology.node_slots
    if not slots or len(slots) < 2:
        return None
    left = Hostfile(hosts=tuple((f"host{i}", n) for i, n in enumerate(slots[:-1])),
                    source="the hosts left")
    try:
        after = on_fewer_hosts(resolved, left)
    except RecipeError as exc:
        return {"continues": False, "why": "; ".join(str(p) for p in exc.problems)}
    return {"continues": True, "world_size": after.layout.world_size,
            "change": layout_change(resolved, after)}
