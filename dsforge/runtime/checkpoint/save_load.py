"""Checkpoints that are complete or invisible, and resume that is exact.

Layout under RUN_DIR/checkpoints/:
  stepNNNNNNNN/                DeepSpeed's engine checkpoint (model, ZeRO-partitioned
                               optimizer, scheduler), one directory per saved step, plus
                               dsforge_rng_rankNNNNN.pt (each rank's RNG states),
                               dsforge_experts_rankNNNNN.pt (expert weights, with expert
                               parallelism), dsforge_state/ (the layout-free state that a
                               resume on another layout reads: dsforge/ckpt, layout_free.py)
                               and, written last, dsforge_complete.json (step, resolved
                               recipe, world size, every file and its size)
  latest                       the tag of the newest complete checkpoint
`latest` moves (atomic rename) only after every rank has finished writing and rank 0 has
written the completion marker, so a crash during a save leaves the previous checkpoint as
latest. Data needs no state: step t always reads the same samples (runtime/loop/data.py).

Before anything is loaded, the trust checks of ckpt/trust.py run again on every rank.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsforge.ckpt.format import COMPLETE, LATEST, experts_file, rng_file
from dsforge.ckpt.reader import StateError, open_state
from dsforge.ckpt.trust import (CheckpointError, check_complete, check_safe_to_load, layout_changes,
                                listing, read_marker, schedule_change, tag_for)
from dsforge.files import write_atomic
from dsforge.runtime.checkpoint.layout_free import load_state, write_state


def save(engine, root: Path, *, step: int, recipe: dict[str, Any], world_size: int, rank: int,
         fault=None) -> None:
    """Write the checkpoint of the state after `step` steps on every rank; rank 0 publishes it."""
    tag = tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"dsforge_step": step},
                           save_latest=False)
    torch.save(_rng_state(), root / tag / rng_file(rank))
    write_state(engine, engine.module.chunks, root / tag, rank=rank, world_size=world_size,
                step=step, padded_vocab_size=padded_vocab_of(engine.module.chunks))
    experts = _expert_weights(engine.module)
    if experts:
        torch.save(experts, root / tag / experts_file(rank))
    if fault is not None:
        fault(rank, step)  # a drill: die with the files written but not published
    torch.distributed.barrier()  # every rank has finished writing
    if rank == 0:
        write_atomic(root / tag / COMPLETE, json.dumps(
            {"step": step, "tag": tag, "world_size": world_size, "recipe": recipe,
             "files": listing(root / tag)}, indent=2))
        write_atomic(root / LATEST, tag)
    torch.distributed.barrier()


def load(engine, root: Path, tag: str, rank: int, *, recipe: dict[str, Any] | None = None,
         world_size: int | None = None, say=None) -> int:
    """Restore engine and RNG state; returns the number of steps already done. When `recipe`
    and `world_size` split the job differently from the checkpoint's, the layout-free state
    is read onto this layout (runtime/checkpoint/layout_free.py) and `say` (rank 0's console, or None)
    is told how."""
    record = read_marker(root, tag)
    check_safe_to_load(root, tag)
    check_complete(root, record)
    changes = [] if recipe is None else layout_changes(record["recipe"], recipe,
                                                       record["world_size"], world_size)
    if changes:
        return _load_on_new_layout(engine, root, tag, record, changes, say)
    _, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None or "dsforge_step" not in client:
        raise CheckpointError(f"{root / tag}: DeepSpeed found no dsforge state in the checkpoint")
    rng = torch.load(root / tag / rng_file(rank), weights_only=True)
    _set_rng_state(rng)
    _restore_expert_weights(engine.module, root / tag / experts_file(rank))
    return int(client["dsforge_step"])


def continue_schedule(engine, train, saved_train: dict[str, Any]) -> str | None:
    """After a resume whose schedule spans another number of steps (ckpt/trust.schedule_change;
    `train` the recipe's TrainConfig, `saved_train` the checkpoint's train section): the next
    step's rate set from the new schedule (the optimizer's state brought back the old one's; the
    scheduler's state is only its step), and a line saying both rates; None when unchanged."""
    if schedule_change(saved_train, asdict(train)) is None:
        return None
    scheduler = engine.lr_scheduler
    before = engine.get_lr()[0]
    scheduler.step(scheduler.last_batch_iteration)  # the same step: sets the rate, advances nothing
    old = replace(train, steps=saved_train["steps"],
                  lr_decay_steps=saved_train.get("lr_decay_steps"))
    return (f"dsforge: the learning-rate schedule now spans {train.schedule_steps} steps (it "
            f"spanned {old.schedule_steps}): the next step trains at lr "
            f"{engine.get_lr()[0]:.3e}, {before:.3e} under the checkpoint's schedule")


def _load_on_new_layout(engine, root: Path, tag: str, record: dict[str, Any],
                        changes: list[str], say) -> int:
    try:
        notes = load_state(engine, engine.module.chunks, open_state(root / tag))
    except StateError as exc:
        raise CheckpointError(f"cannot resume {root / tag} on a new layout: {exc}") from exc
    # RNG streams belong to ranks; on another layout rank r is another part of the model. No
    # training step draws random numbers (no dropout; data is indexed by step), so the
    # seeded streams of this job serve as well.
    if say is not None:
        say(f"dsforge: continuing {tag} on a new layout ({'; '.join(changes)})")
        for note in notes:
            say(f"dsforge: note: {note}")
    return int(record["step"])


def padded_vocab_of(chunks) -> int:
    """The vocabulary the model was built with: dsforge passes Megatron the padded size."""
    return int(chunks[0].vocab_size)


def _expert_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Expert weights of this rank. DeepSpeed writes model weights from data-parallel rank 0
    only, but with expert parallelism the data-parallel ranks hold different experts (and
    DeepSpeed's own expert files exist only for its own MoE layer class)."""
    from dsforge.ckpt.names import is_expert

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
