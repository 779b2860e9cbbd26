"""What a run ran on: versions, git commit, device, layout (written next to its metrics)."""

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


def environment_manifest(device: torch.device, layout: dict) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"versions": package_versions(), "python": platform.python_version(),
            "git_commit": git_commit(), "host": platform.node(),
            "device": {"type": device.type, "name": name,
                       "count_per_node": torch.cuda.device_count() if device.type == "cuda" else None},
            "layout": layout}
