"""What a checkpoint costs (docs/checkpoints.md, "What a save costs"): the bytes each rank and
each host writes and holds staged in host memory, the time training stops for a save, the time
its files take to reach the disk, and the interval between saves that loses the least time to
saves and failures together.

A checkpoint is the layout-free state (runtime/checkpoint/layout_free.py): 12 bytes a
parameter, the fp32 master weights and Adam's two moments, each element written by the one
rank that holds it (ZeRO 1-3 partition it over the data-parallel ranks, expert-data-parallel
for experts; at ZeRO-0 data-parallel rank 0 writes it), plus a few kB of RNG and counters. A
save first copies the rank's part into host memory (the snapshot), then writes it: training
waits for both without `train.checkpoint_async`; with it, at most for the snapshot (the copy
runs beside the next step's forward and backward, runtime/checkpoint/staging.py), and where
`train.checkpoint_staging_gb` makes it stage in parts, for the writes of all parts but the
last.

The interval is Young's (1974), refined by Daly (2006): about sqrt(2 x MTBF x C), C the time a
save stops training, MTBF the job's mean time between failures (a node's over the job's
nodes). A save every tau seconds loses C / tau of the time to saving and, per failure, the
tau / 2 trained since the last save on average (plus the restart itself, which is not counted
here); their sum is least at that tau. A background save cannot come more often than one
write takes (at most one is in flight).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dsforge.estimate.memory import stage_params
from dsforge.hardware import gpu_by_key
from dsforge.recipe.resolve import Resolved
from dsforge.schema.tracking import DEFAULT_CHECKPOINT_WRITE_GBPS, DEFAULT_NODE_MTBF_HOURS

STATE_BYTES_PER_PARAM = 12  # fp32 master weights, exp_avg, exp_avg_sq

# Host memory copies a CPU rank's snapshot at: 6.1-6.8 GB/s measured (benchmarks/checkpoints/
# README.md); a GPU's copy goes over its host link (hardware.py) at about 80% of the nominal
# rate with pinned buffers (an assumption until measured on a GPU: benchmarks/gpu).
CPU_COPY_BYTES_PER_S = 6.0e9
HOST_LINK_EFFICIENCY = 0.8
UNKNOWN_GPU_HOST_LINK = 32e9  # PCIe 4.0 x16, nominal, one direction: a GPU not named in the recipe


@dataclass(frozen=True, kw_only=True)
class SaveCost:
    total_bytes: float  # one checkpoint, all ranks
    rank_bytes: float  # the rank that writes the most
    host_bytes: float  # the host whose ranks write the most (what its memory holds staged)
    # Staged in parts of this many bytes a rank (a set train.checkpoint_staging_gb below the
    # rank's state); None: whole (auto counts on the host holding it, as FIT4 checks).
    part_bytes: float | None
    snapshot_s: float  # the copy into host memory (the slowest rank)
    write_s: float  # the files on disk (the busiest host at checkpoint_write_gbps)
    # Training stopped per save: the snapshot, or snapshot + write without async. In the
    # background the copy runs beside the next step's forward and backward: at most this.
    stall_s: float
    asynchronous: bool
    write_gbps: float
    node_mtbf_hours: float
    job_mtbf_s: float
    interval_s: float  # Young/Daly, and never shorter than a background write
    interval_steps: int | None  # at `step_s`, when a step time is known
    step_s: float | None
    lost_to_saves: float  # fractions of the run's time at that interval
    lost_to_failures: float

    def to_dict(self) -> dict:
        return asdict(self)


def rank_state_bytes(resolved: Resolved) -> list[float]:
    """Bytes of layout-free state each rank writes (and stages), by global rank."""
    lay, model = resolved.layout, resolved.recipe.model
    zero0 = resolved.recipe.zero.stage == 0
    out = []
    for rank in range(lay.world_size):
        stage, first, first_expert = _coordinates(lay, rank)
        params = stage_params(model, lay, stage)
        if zero0:
            elements = params.dense * first + params.expert * first_expert
        else:
            elements = params.dense / lay.dp_cp + params.expert / lay.edp
        out.append(STATE_BYTES_PER_PARAM * elements)
    return out


def _coordinates(lay, rank: int) -> tuple[int, bool, bool]:
    """Rank `rank`'s pipeline stage, and whether it is data-parallel rank 0 (over dp x cp) of
    the dense weights and expert-data-parallel rank 0 of the experts, in Megatron-Core's rank
    order tp-cp-ep-dp-pp (translate/megatron.py RANK_ORDER; tests/unit/test_save_cost.py
    checks it against Megatron's RankGenerator): tp varies fastest, then cp, dp, and pp; the
    experts' ranks are etp, then ep, then expert-dp, within the same stage."""
    per_stage = lay.world_size // lay.pp
    within = rank % per_stage
    return rank // per_stage, within < lay.tp, within < lay.etp * lay.ep


def host_state_bytes(resolved: Resolved, per_rank: list[float] | None = None) -> list[float]:
    """Bytes each host's ranks write (and hold staged) per save, in the hostfile's order; one
    host when the world's nodes are unknown. `per_rank`: rank_state_bytes, when already known."""
    per_rank = rank_state_bytes(resolved) if per_rank is None else per_rank
    slots = resolved.topology.node_slots or (resolved.layout.world_size,)
    hosts, start = [], 0
    for count in slots:
        hosts.append(sum(per_rank[start:start + count]))
        start += count
    return hosts


def save_cost(resolved: Resolved, *, device: str, step_s: float | None) -> SaveCost:
    """The checkpoint's cost for `resolved` on `device` ("cpu" | "cuda"), with a step time
    `step_s` (seconds; None: unknown, the interval is then in seconds only)."""
    recipe = resolved.recipe
    per_rank = rank_state_bytes(resolved)
    per_host = host_state_bytes(resolved, per_rank)
    cluster = recipe.cluster
    write_gbps = cluster.checkpoint_write_gbps if cluster else DEFAULT_CHECKPOINT_WRITE_GBPS
    mtbf_hours = cluster.node_mtbf_hours if cluster else DEFAULT_NODE_MTBF_HOURS
    snapshot_s = max(per_rank) / _copy_bytes_per_s(resolved, device)
    write_s = max(per_host) / (write_gbps * 1e9)
    asynchronous = recipe.train.checkpoint_async
    staged = recipe.train.staging_bytes
    part_bytes = staged if staged is not None and staged < max(per_rank) else None
    stall_s = snapshot_s + _held_for_parts_s(resolved, max(per_rank), part_bytes, write_gbps) \
        if asynchronous else snapshot_s + write_s
    job_mtbf_s = mtbf_hours * 3600 / len(per_host)
    interval_s = max(math.sqrt(2 * job_mtbf_s * stall_s), write_s if asynchronous else 0.0)
    # Whole steps, rounded up: never sooner than the write allows (the optimum is flat).
    interval_steps = max(1, math.ceil(interval_s / step_s)) if step_s else None
    if interval_steps is not None:
        interval_s = interval_steps * step_s
    return SaveCost(total_bytes=sum(per_rank), rank_bytes=max(per_rank), host_bytes=max(per_host),
                    part_bytes=part_bytes, snapshot_s=snapshot_s, write_s=write_s,
                    stall_s=stall_s,
                    asynchronous=asynchronous, write_gbps=write_gbps,
                    node_mtbf_hours=mtbf_hours, job_mtbf_s=job_mtbf_s,
                    interval_s=interval_s, interval_steps=interval_steps, step_s=step_s,
                    lost_to_saves=stall_s / (interval_s + stall_s),
                    lost_to_failures=interval_s / 2 / job_mtbf_s)


def _held_for_parts_s(resolved: Resolved, rank_bytes: float, part_bytes: float | None,
                      write_gbps: float) -> float:
    """How long the optimizer step after a background save waits for the writes of the parts
    before the last, at the rank's share of its host's write rate: at most (the forward and
    backward that run beside the first writes are not subtracted)."""
    if part_bytes is None:
        return 0.0
    ranks_per_host = max(resolved.topology.node_slots or (resolved.layout.world_size,))
    return (rank_bytes - part_bytes) / (write_gbps * 1e9 / ranks_per_host)


def _copy_bytes_per_s(resolved: Resolved, device: str) -> float:
    if device != "cuda":
        return CPU_COPY_BYTES_PER_S
    cluster = resolved.recipe.cluster
    known = cluster is not None and cluster.gpu is not None
    link = gpu_by_key(cluster.gpu).host_link_bandwidth if known else UNKNOWN_GPU_HOST_LINK
    return link * HOST_LINK_EFFICIENCY
