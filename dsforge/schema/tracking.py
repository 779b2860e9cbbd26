"""The `tracking:` and `cluster:` sections (docs/recipe.md#tracking, #cluster)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Literal

from dsforge.hardware import GPU_KEYS
from dsforge.problems import Checks, did_you_mean
from dsforge.schema.limits import MAX_WORLD, require_at_most, require_positive
from dsforge.schema.parsing import profile_steps


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Where metrics go besides RUN_DIR/metrics.jsonl (docs/recipe.md#tracking)."""
    tensorboard: bool = False  # event files under RUN_DIR/tensorboard
    wandb: bool = False  # Weights & Biases (files under RUN_DIR/wandb)
    wandb_project: str = "dsforge"
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"  # offline: no network call at all
    # "A:B": a torch profiler trace of training steps A to B (0-based, as metrics.jsonl counts
    # them) of rank 0, under RUN_DIR/profile. None = no trace.
    profile: str | None = None

    def __post_init__(self) -> None:
        c = Checks()
        c.require(self.profile is None or profile_steps(self.profile) is not None, "R4",
                  {"tracking.profile": self.profile},
                  "not a step range: give the first and last step to trace as A:B with "
                  "0 <= A <= B (0-based, as metrics.jsonl counts steps)",
                  'e.g. tracking.profile: "3:5"; null for no trace')
        c.raise_if_any()

    @property
    def profile_range(self) -> tuple[int, int] | None:
        return None if self.profile is None else profile_steps(self.profile)


# A node's mean time between failures that end a job. Llama 3 (Meta, 2024): 419 unexpected
# interruptions in 54 days on 16,384 GPUs, 2,048 nodes of 8: 2,048 x 54 x 24 / 419 = 6,335
# node-hours (../shared/reference/performance-anchors.md, docs/checkpoints.md).
DEFAULT_NODE_MTBF_HOURS = 6335.0
# GB/s one node writes its checkpoint files at (fsynced): 0.45-0.58 measured on the development
# machine's local disk (benchmarks/checkpoints/README.md); a run's summary.json says what yours
# wrote (`checkpoints.*.write_gbps`).
DEFAULT_CHECKPOINT_WRITE_GBPS = 0.5


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    nodes: int = 1
    gpus_per_node: int
    gpu: str | None = None  # a key of dsforge.hardware.GPUS
    # What `dsforge plan` prices a checkpoint with (estimate/save_cost.py): the rate a node writes
    # to the checkpoint directory, and how long a node runs between failures that end a job.
    checkpoint_write_gbps: float = DEFAULT_CHECKPOINT_WRITE_GBPS
    node_mtbf_hours: float = DEFAULT_NODE_MTBF_HOURS

    def __post_init__(self) -> None:
        c = Checks()
        require_positive(c, "C1", "cluster", nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        require_at_most(c, "C1", "cluster", MAX_WORLD, nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        require_positive(c, "C3", "cluster", checkpoint_write_gbps=self.checkpoint_write_gbps,
                         node_mtbf_hours=self.node_mtbf_hours)
        if self.gpu is not None:
            c.require(self.gpu in GPU_KEYS, "C2", {"cluster.gpu": self.gpu}, "unknown GPU",
                      f"use one of {', '.join(GPU_KEYS)}.{did_you_mean(self.gpu, GPU_KEYS)}")
        c.raise_if_any()

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
