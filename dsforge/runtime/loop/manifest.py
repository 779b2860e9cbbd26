"""What a run ran on: versions, git commit, device, layout, and the implementations its ranks
chose (optimizer, kernels, attention), written next to its metrics."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

from dsforge.versions import package_versions


def git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment_manifest(device: torch.device, layout: dict, implementations: dict) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"versions": package_versions(), "python": platform.python_version(),
            "git_commit": git_commit(), "host": platform.node(),
            "device": {"type": device.type, "name": name,
                       "count_per_node": torch.cuda.device_count() if device.type == "cuda" else None},
            "layout": layout, "implementations": implementations}


def implementations(optimizer, *, kernels: str, kernels_why: str, sdpa_backend: str,
                    experts=None) -> dict:
    """What the engine was built with: DeepSpeed's optimizer wrappers around the torch
    optimizer (outermost first) and how that one steps; the kernels and why; the SDPA backend
    as set (auto: torch chooses per call); an MoE model's experts (translate/experts.py) and why."""
    chain = optimizer_chain(optimizer)
    inner = chain[-1]
    return {"optimizer": [type(o).__name__ for o in chain],
            "optimizer_fused": bool(getattr(inner, "defaults", {}).get("fused")),
            "optimizer_foreach": bool(getattr(inner, "defaults", {}).get("foreach")),
            "kernels": kernels, "kernels_why": kernels_why, "sdpa_backend": sdpa_backend,
            **({"experts": experts.impl, "experts_why": experts.why} if experts else {})}


def optimizer_chain(optimizer) -> list:
    """`optimizer` and what it wraps (DeepSpeed's wrappers keep the next one in `.optimizer`)."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None and \
            all(chain[-1].optimizer is not o for o in chain):
        chain.append(chain[-1].optimizer)
    return chain
