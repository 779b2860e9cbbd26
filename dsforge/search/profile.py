"""Cluster profiles: what the step-time model assumes about a GPU node and its network.

Bandwidths are *achieved* bus bandwidths per GPU for large collectives (what nccl-tests
reports as busbw), not link peaks: NVLink 4 is 900 GB/s bidirectional per H100, NCCL
all-reduce reaches ~360-400 GB/s busbw inside a DGX H100; one 400 Gb/s InfiniBand NIC per
GPU reaches ~40-45 GB/s across nodes. `compute_efficiency` is the share of the dense BF16
peak that large transformer GEMMs reach in practice (published MFUs of well-tuned runs reach
45-58% including everything else; a GEMM-only figure is higher).

A user's cluster differs: every field can be overridden in a small YAML file
(`dsforge plan --search ... --profile my_cluster.yaml`):

    gpu: h100
    gpus_per_node: 8
    intra_node_gbps: 300
    inter_node_gbps: 25      # e.g. 200 Gb/s RoCE per GPU
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dsforge.estimate.hardware import GPU, GPU_KEYS, gpu_by_key
from dsforge.problems import Problem, RecipeError


@dataclass(frozen=True, kw_only=True)
class ClusterProfile:
    gpu: GPU
    gpus_per_node: int = 8
    intra_node_gbps: float = 360.0  # GB/s per GPU, collective bus bandwidth inside a node
    inter_node_gbps: float = 40.0  # GB/s per GPU across nodes
    compute_efficiency: float = 0.6  # achievable share of peak for the model's GEMMs
    memory_margin: float = 0.10  # share of GPU memory kept free for fragmentation/workspace
    dp_overlap: float = 0.5  # share of data-parallel gradient traffic hidden behind backward
    p2p_latency_s: float = 20e-6  # per pipeline send/recv

    @property
    def usable_memory_bytes(self) -> float:
        return self.gpu.memory_bytes * (1.0 - self.memory_margin)


# Per GPU family: (intra-node busbw, inter-node busbw per GPU, compute efficiency) for the
# node it usually comes in (SXM in 8-GPU NVLink nodes with a 400G NIC per GPU; PCIe cards
# over PCIe 4/5 switches).
_DEFAULTS: dict[str, tuple[float, float, float]] = {
    "h100": (360.0, 40.0, 0.60),
    "h200": (360.0, 40.0, 0.62),
    "gh200": (360.0, 40.0, 0.60),
    "h100-nvl": (250.0, 40.0, 0.58),
    "h100-pcie": (40.0, 25.0, 0.55),
    "a100": (230.0, 20.0, 0.60),
    "a100-40gb": (230.0, 20.0, 0.60),
    "l40s": (25.0, 12.0, 0.50),
    "b200": (720.0, 80.0, 0.55),
}


def default_profile(gpu_key: str, gpus_per_node: int = 8) -> ClusterProfile:
    if gpu_key not in GPU_KEYS:
        raise RecipeError([Problem(rule="S1", fields={"--gpu": gpu_key},
                                   message=f"unknown GPU; known: {', '.join(GPU_KEYS)}",
                                   fix="pick one of the known GPUs, or describe yours in --profile")])
    intra, inter, efficiency = _DEFAULTS[gpu_key]
    return ClusterProfile(gpu=gpu_by_key(gpu_key), gpus_per_node=gpus_per_node,
                          intra_node_gbps=intra, inter_node_gbps=inter,
                          compute_efficiency=efficiency)


_FIELDS = {f.name for f in dataclasses.fields(ClusterProfile)} - {"gpu"}


def load_profile(path: Path | None, gpu_key: str | None, gpus_per_node: int | None) -> ClusterProfile:
    """The default profile of the GPU, overridden by the YAML file, then by the command line."""
    from dsforge.recipe.loader import read_yaml

    raw = read_yaml(path) if path else {}
    unknown = sorted(set(raw) - _FIELDS - {"gpu"})
    if unknown:
        raise RecipeError([Problem(rule="S1", fields={f"{path}: {k}": raw[k] for k in unknown},
                                   message="unknown cluster profile field",
                                   fix=f"use only: gpu, {', '.join(sorted(_FIELDS))}")])
    key = gpu_key or raw.get("gpu") or "h100"
    per_node = gpus_per_node or raw.get("gpus_per_node") or 8
    profile = default_profile(str(key), int(per_node))
    overrides = {k: type(getattr(profile, k))(v) for k, v in raw.items() if k in _FIELDS}
    overrides["gpus_per_node"] = int(per_node)
    bad = {k: v for k, v in overrides.items() if v <= 0 or (k.endswith(("margin", "overlap")) and v >= 1)}
    if bad:
        raise RecipeError([Problem(rule="S1", fields=bad, message="out of range",
                                   fix="bandwidths and counts > 0; margin and overlap in [0, 1)")])
    return dataclasses.replace(profile, **overrides)
