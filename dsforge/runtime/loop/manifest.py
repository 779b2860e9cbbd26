"""What a run ran on: versions, the source tree (git commit, and whether and how it differed
from that commit), the machine and device (a GPU's UUID and driver, so two runs on "an H200"
can be told apart), layout, and the implementations its ranks chose (optimizer, kernels,
attention), written next to its metrics."""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch

from dsforge.versions import package_version, package_versions


REPO = Path(__file__).resolve().parents[3]  # dsforge's checkout, where it runs from one
UNTRACKED_BYTES = 1 << 20  # untracked files up to this size are hashed whole


def _git(*args: str) -> bytes | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit() -> str | None:
    out = _git("rev-parse", "HEAD")
    return out.decode().strip() or None if out is not None else None


def git_tree() -> dict:
    """The commit and whether the tree differs from it: `dirty`, and `diff_sha256`, a hash of
    the tracked changes (`git diff HEAD`) and of every untracked, not ignored file's name and
    bytes (its size only over UNTRACKED_BYTES: data or checkpoints, not code), so two runs
    from the same dirty tree show the same hash. All None outside a checkout (an installed
    wheel)."""
    commit = git_commit()
    diff = _git("diff", "HEAD", "--binary") if commit else None
    untracked = _git("ls-files", "-z", "-o", "--exclude-standard") if commit else None
    if diff is None or untracked is None:
        return {"git_commit": commit, "git_dirty": None, "git_diff_sha256": None}
    digest = hashlib.sha256(diff)
    names = sorted(n for n in untracked.decode(errors="replace").split("\0") if n)
    for name in names:
        try:
            size = (REPO / name).stat().st_size
            digest.update(f"{name}\0{size}\0".encode())
            if size <= UNTRACKED_BYTES:
                digest.update((REPO / name).read_bytes())
        except OSError:  # gone since git listed it
            digest.update(name.encode() + b"\0")
    dirty = bool(diff) or bool(names)
    return {"git_commit": commit, "git_dirty": dirty,
            "git_diff_sha256": digest.hexdigest() if dirty else None}


def machine_id() -> str | None:
    """A stable identity of the host that does not reveal /etc/machine-id itself."""
    try:
        raw = Path("/etc/machine-id").read_text().strip()
    except OSError:
        return None
    return hashlib.sha256(raw.encode()).hexdigest()[:16] if raw else None


def gpu_identity(device: torch.device) -> dict:
    """The GPU's UUID (torch) and the driver's version (nvidia-smi; None without it)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    uuid = f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith("GPU-") else uuid
    driver = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                                  "-i", str(device.index or 0)], capture_output=True, text=True,
                                 timeout=20)
            driver = out.stdout.strip() or None if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return {"uuid": str(uuid) if uuid is not None else None, "driver": driver}


def environment_manifest(device: torch.device, layout: dict, implementations: dict) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    gpu = gpu_identity(device) if device.type == "cuda" else {"uuid": None, "driver": None}
    return {"versions": package_versions(), "python": platform.python_version(),
            **git_tree(), "host": platform.node(), "machine_id": machine_id(),
            "device": {"type": device.type, "name": name, **gpu,
                       "count_per_node": torch.cuda.device_count() if device.type == "cuda" else None},
            "layout": layout, "implementations": implementations}


def run_manifest(resolved, *, device: torch.device, optimizer, kernels, experts,
                 resumed: dict | None) -> dict:
    """RUN_DIR/manifest.json of a run: the environment, the layout, what the engine was built
    with (`kernels`, `experts`: translate's choices as this rank made them) and, on resume,
    the checkpoint continued and the recipe's changes."""
    from dsforge.translate.compile import compiled_with
    from dsforge.translate.kernels import documents_summary

    model = resolved.recipe.model
    used = implementations(optimizer, kernels=kernels.impl, kernels_why=kernels.why,
                           sdpa_backend=model.sdpa_backend, experts=experts,
                           compiled=compiled_with(model.compile), fp8=resolved.recipe.train.fp8)
    used |= documents_summary(resolved.recipe.data, device=device.type,
                              sdpa_backend=resolved.recipe.model.sdpa_backend)
    manifest = environment_manifest(device, asdict(resolved.layout), used)
    if resumed is not None:
        manifest["resumed"] = resumed
    return manifest


def implementations(optimizer, *, kernels: str, kernels_why: str, sdpa_backend: str,
                    experts=None, compiled: str = "none", fp8: str = "none") -> dict:
    """What the engine was built with: DeepSpeed's optimizer wrappers around the torch
    optimizer (outermost first) and how that one steps; the kernels and why; the SDPA backend
    as set (auto: torch chooses per call); what was compiled ("layers (inductor)"); the float8
    GEMMs' scaling with torchao's version; an MoE model's experts (translate/experts.py) and why."""
    chain = optimizer_chain(optimizer)
    inner = chain[-1]
    return {"optimizer": [type(o).__name__ for o in chain],
            "optimizer_fused": bool(getattr(inner, "defaults", {}).get("fused")),
            "optimizer_foreach": bool(getattr(inner, "defaults", {}).get("foreach")),
            "kernels": kernels, "kernels_why": kernels_why, "sdpa_backend": sdpa_backend,
            "compile": compiled,
            "fp8": fp8 if fp8 == "none" else f"{fp8} (torchao {package_version('torchao')})",
            **({"experts": experts.impl, "experts_why": experts.why} if experts else {})}


def optimizer_chain(optimizer) -> list:
    """`optimizer` and what it wraps (DeepSpeed's wrappers keep the next one in `.optimizer`)."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None and \
            all(chain[-1].optimizer is not o for o in chain):
        chain.append(chain[-1].optimizer)
    return chain
