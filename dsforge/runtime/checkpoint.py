"""Checkpoints that are complete or invisible, and resume that is exact.

Layout under RUN_DIR/checkpoints/:
  stepNNNNNNNN/                DeepSpeed's engine checkpoint (model, ZeRO-partitioned
                               optimizer, scheduler), one directory per saved step, plus
                               dsforge_rng_rankNNNNN.pt (each rank's RNG states),
                               dsforge_experts_rankNNNNN.pt (expert weights, with expert
                               parallelism) and, written last, dsforge_complete.json (step,
                               resolved recipe, world size)
  latest                       the tag of the newest complete checkpoint
`latest` moves (atomic rename) only after every rank has finished writing and rank 0 has
written the completion marker, so a crash during a save leaves the previous checkpoint as
latest. Data needs no state: step t always reads the same samples (runtime/data.py).

Everything DeepSpeed loads is a pickle, so before anything is unpickled the checkpoint's files
must belong to the current user and must not be writable by others (`check_safe_to_load`).
"""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsforge.files import write_atomic

COMPLETE = "dsforge_complete.json"
LATEST = "latest"

# Recipe fields a resumed run may change. Everything else must match, train.steps included:
# it is the horizon of the learning-rate schedule that the checkpoint restores.
RESUMABLE_CHANGES = {"train.timing_warmup", "train.checkpoint_every"}


class CheckpointError(RuntimeError):
    pass


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def save(engine, root: Path, *, step: int, recipe: dict[str, Any], world_size: int, rank: int,
         fault=None) -> None:
    """Write the checkpoint of the state after `step` steps on every rank; rank 0 publishes it."""
    tag = tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"dsforge_step": step},
                           save_latest=False)
    torch.save(_rng_state(), root / tag / f"dsforge_rng_rank{rank:05d}.pt")
    experts = _expert_weights(engine.module)
    if experts:
        torch.save(experts, root / tag / f"dsforge_experts_rank{rank:05d}.pt")
    if fault is not None:
        fault(rank, step)  # a drill: die with the files written but not published
    torch.distributed.barrier()  # every rank has finished writing
    if rank == 0:
        write_atomic(root / tag / COMPLETE, json.dumps(
            {"step": step, "tag": tag, "world_size": world_size, "recipe": recipe}, indent=2))
        write_atomic(root / LATEST, tag)
    torch.distributed.barrier()


def latest_complete(root: Path) -> dict[str, Any] | None:
    """The completion record of the newest published checkpoint, or None (reads JSON only)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    marker = root / tag / COMPLETE
    if not marker.is_file():
        raise CheckpointError(f"{pointer} names {tag}, which has no completion marker")
    return json.loads(marker.read_text())


def check_safe_to_load(root: Path, tag: str) -> None:
    """Refuse checkpoints written by another user or writable by others, before unpickling."""
    uid = os.getuid()
    for path in [root, root / tag, *sorted((root / tag).rglob("*"))]:
        info = path.lstat()
        if info.st_uid != uid:
            raise CheckpointError(f"{path} belongs to uid {info.st_uid}, not to you (uid {uid}); "
                                  "dsforge does not unpickle other users' checkpoints")
        if info.st_mode & stat.S_IWOTH:
            raise CheckpointError(f"{path} is writable by every user; anyone could have replaced "
                                  f"it. Fix: chmod o-w -R {root} if you trust its contents")
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(f"{path} is a symbolic link; refusing to follow it")


def recipe_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'section.field: saved -> current' for every difference a resume must not have."""
    differences = []
    for section in ("model", "parallel", "zero", "train", "data"):
        for key in sorted(set(saved.get(section) or {}) | set(current.get(section) or {})):
            name = f"{section}.{key}"
            old, new = (saved.get(section) or {}).get(key), (current.get(section) or {}).get(key)
            if old != new and name not in RESUMABLE_CHANGES:
                differences.append(f"{name}: {old!r} in the checkpoint, {new!r} now")
    return differences


def check_resumable(run_dir: Path, recipe: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The completion record a run of `recipe` on `world_size` ranks can resume from: the
    newest complete checkpoint in `run_dir`, safe to load, of this same model and layout."""
    root = checkpoint_root(run_dir)
    record = latest_complete(root)
    if record is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    check_safe_to_load(root, record["tag"])
    differences = recipe_differences(record["recipe"], recipe)
    if record["world_size"] != world_size:
        differences.append(f"world size: {record['world_size']} in the checkpoint, {world_size} now")
    if differences:
        raise CheckpointError("the recipe differs from the checkpoint's (resharding to a new "
                              "layout is not supported):\n  " + "\n  ".join(differences))
    return record


def load(engine, root: Path, tag: str, rank: int) -> int:
    """Restore engine and RNG state; returns the number of steps already done."""
    check_safe_to_load(root, tag)
    _, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None or "dsforge_step" not in client:
        raise CheckpointError(f"{root / tag}: DeepSpeed found no dsforge state in the checkpoint")
    rng = torch.load(root / tag / f"dsforge_rng_rank{rank:05d}.pt", weights_only=True)
    _set_rng_state(rng)
    _restore_expert_weights(engine.module, root / tag / f"dsforge_experts_rank{rank:05d}.pt")
    return int(client["dsforge_step"])


def _expert_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Expert weights of this rank. DeepSpeed writes model weights from data-parallel rank 0
    only, but with expert parallelism the data-parallel ranks hold different experts (and
    DeepSpeed's own expert files exist only for its own MoE layer class)."""
    from dsforge.runtime.grads import is_expert

    return {name: p.detach().cpu().clone() for name, p in module.named_parameters() if is_expert(p)}


def _restore_expert_weights(module: torch.nn.Module, path: Path) -> None:
    """The optimizer's fp32 copies come back from each rank's own ZeRO file; the weights the
    next forward uses must come from the rank's own expert file too."""
    if not path.exists():
        return
    saved = torch.load(path, weights_only=True)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)


def _rng_state() -> dict[str, Any]:
    """Every RNG a rank uses, as tensors and plain values (loadable with weights_only=True)."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
