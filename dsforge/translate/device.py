"""The devices translation knows: the configs differ between CPU and CUDA ranks.

deepspeed_config.py and megatron.py take `device` ("cpu" | "cuda") and set the CPU-only
settings themselves, so `dsforge plan` shows exactly what a run on that device uses.
"""

from __future__ import annotations

DEVICES = ("cpu", "cuda")


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
