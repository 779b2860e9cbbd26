"""Checkpoints that are complete or invisible, and resume that is exact.

Layout under RUN_DIR/checkpoints/:
  stepNNNNNNNN/                one directory per saved step: dsforge_state/ (the layout-free
                               state, the only copy of the weights and the optimizer:
                               dsforge/ckpt, layout_free.py), dsforge_rng_rankNNNNN.pt (each
                               rank's RNG states) and, written last, dsforge_complete.json
                               (step, resolved recipe, world size, every file and its size)
  latest                       the tag of the newest complete checkpoint
A save is a snapshot of each rank's state (`take_snapshot`), copied into host memory before the
optimizer's next step (runtime/checkpoint/staging.py), its files written
(`write_files`: in the training thread, or by a background writer, runtime/loop/checkpointer.py)
and on disk (fsync) before the ranks agree they are written; then rank 0 writes the completion
marker and moves `latest` (atomic renames: `publish`), so a crash during a save leaves the
previous checkpoint as latest. Data needs no state: step t always reads the same
samples (runtime/loop/data.py).

Every resume reads the layout-free state, on the layout that wrote it (bitwise: the fp32
masters and Adam's moments are the optimizer's own, the training-precision weights a cast of
them, as after any step) or on another. A checkpoint written before that state existed also
holds DeepSpeed's engine files, which resume it on its own layout (`_load_engine_files`).

Before anything is loaded, the trust checks of ckpt/trust.py run again on every rank.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from dsforge.ckpt.format import COMPLETE, LATEST, STATE_DIR, experts_file, rng_file
from dsforge.ckpt.reader import StateError, open_state
from dsforge.ckpt.trust import (CheckpointError, check_complete, check_safe_to_load, layout_changes,
                                listing, read_marker, schedule_change, tag_for)
from dsforge.files import fsync_directory, fsync_file, write_atomic
from dsforge.runtime.checkpoint.layout_free import (StateSnapshot, load_state, snapshot_state,
                                                    write_snapshot)
from dsforge.runtime.checkpoint.stream_file import Progress


@dataclass
class Snapshot:
    """A rank's checkpoint of `step` copied out of the engine into host memory, to be written
    (`write_files`) by the training thread or a background writer."""

    root: Path
    step: int
    rank: int
    rng: dict[str, Any]
    state: StateSnapshot

    @property
    def directory(self) -> Path:
        return self.root / tag_for(self.step)


def take_snapshot(engine, root: Path, *, step: int, world_size: int, rank: int) -> Snapshot:
    """Every rank at once (the directory is emptied first, behind a barrier): its RNG states
    and its pieces of the state after `step` steps, to be copied into host memory
    (`Snapshot.state.copy`) before the optimizer's next step."""
    _fresh_directory(root / tag_for(step), rank)
    chunks = engine.module.chunks
    return Snapshot(root=root, step=step, rank=rank, rng=_rng_state(),
                    state=snapshot_state(engine, chunks, rank=rank, world_size=world_size,
                                         step=step, padded_vocab_size=padded_vocab_of(chunks)))


def write_files(snapshot: Snapshot, fault=None, *, parts: Iterable[torch.Tensor] | None = None,
                progress: Progress | None = None) -> None:
    """A snapshot's files, on disk (fsync) when it returns: from its host copies, or from
    `parts` (layout_free.write_snapshot); `progress` counts the bytes on disk. `fault`: the
    drill that dies, hangs or signals while saving, with the files written but not
    published."""
    rng = snapshot.directory / rng_file(snapshot.rank)
    torch.save(snapshot.rng, rng)
    fsync_file(rng)
    write_snapshot(snapshot.state, snapshot.directory, parts, progress)
    if fault is not None:
        fault(snapshot.rank, snapshot.step)


def publish(root: Path, step: int, *, world_size: int, recipe: dict[str, Any]) -> None:
    """Rank 0, once every rank's files of `step` are on disk: the completion marker (every
    file and its size), then `latest`."""
    tag = tag_for(step)
    directory = root / tag
    fsync_directory(directory)
    write_atomic(directory / COMPLETE, json.dumps(
        {"step": step, "tag": tag, "world_size": world_size, "recipe": recipe,
         "files": listing(directory)}, indent=2))
    write_atomic(root / LATEST, tag)


def _fresh_directory(directory: Path, rank: int) -> None:
    """The checkpoint's directory, empty. An earlier save of the same step (its job died, and
    a resume came back to that step, maybe on another layout; or a complete one of another
    trajectory, after `latest` was set back by hand) would leave files no rank of this save
    overwrites, which the marker would then list, and a complete one would claim to be
    complete while its files are written over. Its marker goes first, so a save cut short
    here leaves nothing that claims to be complete. A save never writes the step it resumed
    from (its first save is of a step it trained), so this is never `latest`'s checkpoint."""
    if rank == 0:
        (directory / COMPLETE).unlink(missing_ok=True)
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
    torch.distributed.barrier()


def load(engine, root: Path, tag: str, rank: int, *, recipe: dict[str, Any] | None = None,
         world_size: int | None = None, say=None) -> int:
    """Restore engine and RNG state; returns the number of steps already done. When `recipe`
    and `world_size` split the job differently from the checkpoint's, `say` (rank 0's
    console, or None) is told how."""
    record = read_marker(root, tag)
    check_safe_to_load(root, tag)
    check_complete(root, record)
    changes = [] if recipe is None else layout_changes(record["recipe"], recipe,
                                                       record["world_size"], world_size)
    if not (root / tag / STATE_DIR).is_dir():  # older than the layout-free state: same layout
        return _load_engine_files(engine, root, tag, rank)
    notes = _load_state(engine, root / tag)
    if changes:
        # RNG streams belong to ranks; on another layout rank r is another part of the model.
        # No training step draws random numbers (no dropout; data is indexed by step), so the
        # seeded streams of this job serve as well.
        if say is not None:
            say(f"dsforge: continuing {tag} on a new layout ({'; '.join(changes)})")
            for note in notes:
                say(f"dsforge: note: {note}")
    else:
        _set_rng_state(torch.load(root / tag / rng_file(rank), weights_only=True))
    return int(record["step"])


def _load_state(engine, directory: Path) -> list[str]:
    try:
        return load_state(engine, engine.module.chunks, open_state(directory))
    except StateError as exc:
        raise CheckpointError(f"cannot resume {directory}: {exc}") from exc


def _load_engine_files(engine, root: Path, tag: str, rank: int) -> int:
    """A checkpoint written before the layout-free state existed: DeepSpeed's engine files,
    and the expert weights each rank wrote beside them (DeepSpeed writes weights from
    data-parallel rank 0 only, and with expert parallelism those ranks hold different
    experts)."""
    _, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None or "dsforge_step" not in client:
        raise CheckpointError(f"{root / tag}: DeepSpeed found no dsforge state in the checkpoint")
    _set_rng_state(torch.load(root / tag / rng_file(rank), weights_only=True))
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


def padded_vocab_of(chunks) -> int:
    """The vocabulary the model was built with: dsforge passes Megatron the padded size."""
    return int(chunks[0].vocab_size)


def _restore_expert_weights(module: torch.nn.Module, path: Path) -> None:
    """The optimizer's fp32 copies come back from each rank's own ZeRO file; the weights the
    next forward uses must come from the rank's own expert file too (engine files only)."""
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
