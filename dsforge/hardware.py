"""Accelerators dsforge knows: memory and dense BF16 peak FLOP/s.

Peaks are the vendors' dense (no sparsity) BF16 tensor-core figures; they are the MFU
denominator (docs/flops.md). A device that is not in the table has no peak: MFU is then
reported as not available rather than computed against a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.units import MiB


@dataclass(frozen=True, kw_only=True)
class GPU:
    key: str  # the name used in recipes (`cluster.gpu`)
    name: str
    memory_bytes: int  # total device memory as the driver reports it
    peak_bf16_flops: float  # dense, per GPU, FLOP/s
    memory_bandwidth: float  # HBM/GDDR bytes/s, the vendor's figure (the optimizer step is bound by it)
    # Lower-case substrings of torch.cuda.get_device_name() that identify this GPU. All must match.
    match: tuple[str, ...]
    capability: tuple[int, int]  # CUDA compute capability (what float8 GEMMs need: sm 8.9+)
    # Bytes/s one way between the GPU and host memory, nominal (a checkpoint's snapshot crosses
    # it: estimate/save_cost.py): PCIe 5.0 x16 64e9, 4.0 x16 32e9, GH200's NVLink-C2C 450e9.
    host_link_bandwidth: float = 64e9


# Ordered most specific first: "H100 PCIe" and "H100 NVL" must be tried before plain "H100".
GPUS: tuple[GPU, ...] = (
    GPU(key="h100-pcie", name="NVIDIA H100 PCIe", memory_bytes=81559 * MiB,
        memory_bandwidth=2.0e12, peak_bf16_flops=756e12, match=("h100", "pcie"), capability=(9, 0)),
    GPU(key="h100-nvl", name="NVIDIA H100 NVL", memory_bytes=95830 * MiB,
        memory_bandwidth=3.9e12, peak_bf16_flops=835e12, match=("h100", "nvl"), capability=(9, 0)),
    GPU(key="h100", name="NVIDIA H100 SXM", memory_bytes=81559 * MiB,
        memory_bandwidth=3.35e12, peak_bf16_flops=989e12, match=("h100",), capability=(9, 0)),
    # Grace Hopper: before "h200", whose substring its name contains. 96 GB HBM3 variant.
    GPU(key="gh200", name="NVIDIA GH200", memory_bytes=97871 * MiB,
        memory_bandwidth=4.0e12, peak_bf16_flops=989e12, match=("gh200",), capability=(9, 0),
        host_link_bandwidth=450e9),
    GPU(key="h200", name="NVIDIA H200", memory_bytes=143771 * MiB,
        memory_bandwidth=4.8e12, peak_bf16_flops=989e12, match=("h200",), capability=(9, 0)),
    GPU(key="a100-40gb", name="NVIDIA A100 40GB", memory_bytes=40960 * MiB,
        memory_bandwidth=1.555e12, peak_bf16_flops=312e12, match=("a100", "40gb"), capability=(8, 0),
        host_link_bandwidth=32e9),
    GPU(key="a100", name="NVIDIA A100 80GB", memory_bytes=81920 * MiB,
        memory_bandwidth=2.039e12, peak_bf16_flops=312e12, match=("a100",), capability=(8, 0),
        host_link_bandwidth=32e9),
    GPU(key="l40s", name="NVIDIA L40S", memory_bytes=46068 * MiB,
        memory_bandwidth=0.864e12, peak_bf16_flops=362e12, match=("l40s",), capability=(8, 9),
        host_link_bandwidth=32e9),
    GPU(key="b200", name="NVIDIA B200", memory_bytes=183359 * MiB,
        memory_bandwidth=8.0e12, peak_bf16_flops=2250e12, match=("b200",), capability=(10, 0)),
)

GPU_KEYS: tuple[str, ...] = tuple(g.key for g in GPUS)


def gpu_by_key(key: str) -> GPU:
    for gpu in GPUS:
        if gpu.key == key:
            return gpu
    raise KeyError(key)


def gpu_for_device_name(device_name: str) -> GPU | None:
    """The table entry for a torch device name, most specific first; None when unknown."""
    lowered = device_name.lower()
    for gpu in GPUS:
        if all(part in lowered for part in gpu.match):
            return gpu
    return None
