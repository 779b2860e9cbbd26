"""A rank's side of the layout-free checkpoint state (format: dsforge/ckpt/format.py), the
checkpoint's only copy of the weights and the optimizer.

A save needs no collective: each rank takes the pieces of optimizer state it owns (its ZeRO
partition of its tensor-parallel shards; `snapshot_state`), copies them into host memory
(`StateSnapshot.copy`, runtime/checkpoint/staging.py; or in parts) and writes them under the
parameters' global names (`write_snapshot`, a stream: stream_file.py). `load_state` runs on
every rank of a resumed job, on the checkpoint's layout or another: for each of its parameters
it reads the full tensor (one at a time), cuts this rank's shard out of it and puts it where
the ZeRO stage keeps it, then restores the step counters, the learning-rate schedule and the
loss scaler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from dsforge.ckpt.format import (FORMAT_VERSION, STATE_DIR, STATE_FILE, STATES, Piece, piece_key,
                                 rank_file)
from dsforge.ckpt.names import ParamSpec, param_specs, shard
from dsforge.ckpt.reader import StateError, StateReader
from dsforge.files import fsync_directory, write_atomic
from dsforge.runtime.assemble.vocab import VOCAB_TENSORS, pad_rows
from dsforge.runtime.checkpoint.staging import Staging, ready_event
from dsforge.runtime.checkpoint.stream_file import Progress, write_stream
from dsforge.runtime.checkpoint.zero_state import optimizer_view


@dataclass
class StateSnapshot:
    """A rank's part of the layout-free state: its pieces (the engine's own tensors until
    `copy` makes them host tensors of the snapshot's own), their records, rank 0's state.json
    and the torch optimizer whose next step changes the pieces. `write_snapshot` writes it, in
    the training thread or a writer's."""

    rank: int
    tensors: dict[str, torch.Tensor]
    pieces: list[dict]
    engine_state: dict[str, Any] | None  # rank 0's state.json
    optimizer: torch.optim.Optimizer
    ready: Any = None  # on a GPU, the event the copies wait for (staging.ready_event)
    copied: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.tensors.values())  # written as fp32

    def copy(self, staging: Staging) -> None:
        """The pieces into host memory (`staging`'s buffers): before the optimizer's next step."""
        self.tensors = staging.copy_all(self.tensors, self.ready)
        self.ready, self.copied = None, True


def snapshot_state(engine, chunks, *, rank: int, world_size: int, step: int,
                   padded_vocab_size: int) -> StateSnapshot:
    """This rank's pieces, not yet copied, and (on rank 0) what state.json holds, now."""
    view = optimizer_view(engine)
    tensors, pieces = {}, []
    for param, spec in param_specs(chunks):
        if not spec.split and spec.tp_rank != 0:
            continue  # replicated over tensor-parallel ranks: rank 0 of them writes it
        for start, states in view.fragments(param):
            for state, tensor in states.items():
                piece = _piece(spec, param, state, start, tensor.numel())
                tensors[piece.key] = tensor.detach()
                pieces.append(piece.to_json())
    engine_state = _engine_state(engine, view, step=step, world_size=world_size,
                                 padded_vocab_size=padded_vocab_size) if rank == 0 else None
    return StateSnapshot(rank=rank, tensors=tensors, pieces=pieces, engine_state=engine_state,
                         optimizer=view.base, ready=ready_event(tensors))


def write_snapshot(snapshot: StateSnapshot, checkpoint_dir: Path,
                   parts: Iterable[torch.Tensor] | None = None,
                   progress: Progress | None = None) -> None:
    """The snapshot's files under CHECKPOINT/dsforge_state, on disk (fsync) when it returns:
    from its host copies, or from `parts` (Staging.parts: the pieces' elements end to end, each
    part copied as the one before is written). `progress` counts the bytes on disk."""
    if parts is None:
        assert snapshot.copied, "a snapshot is copied into host memory before it is written"
        parts = snapshot.tensors.values()
    directory = checkpoint_dir / STATE_DIR
    directory.mkdir(exist_ok=True)
    sizes = {key: t.numel() for key, t in snapshot.tensors.items()}
    write_stream(directory / rank_file(snapshot.rank), sizes,
                 {"pieces": json.dumps(snapshot.pieces)}, parts, progress)
    if snapshot.engine_state is not None:
        write_atomic(directory / STATE_FILE, json.dumps(snapshot.engine_state, indent=2))
    fsync_directory(directory)


def _piece(spec: ParamSpec, param, state: str, start: int, numel: int) -> Piece:
    split = spec.split
    return Piece(key=piece_key(state, spec.global_name, spec.tp_rank if split else 0, start),
                 name=spec.global_name, state=state, full_shape=spec.full_shape,
                 tp_dim=spec.tp_dim if split else None, stride=spec.stride if split else 1,
                 tp_rank=spec.tp_rank if split else 0, tp_size=spec.tp_size if split else 1,
                 local_shape=tuple(getattr(param, "ds_shape", param.shape)), start=start,
                 numel=numel)


def _engine_state(engine, view, *, step: int, world_size: int,
                  padded_vocab_size: int) -> dict[str, Any]:
    groups = engine.optimizer.param_groups
    return {
        "format": FORMAT_VERSION, "step": step, "ranks": world_size,
        "padded_vocab_size": padded_vocab_size,
        "adam_step": view.adam_step(),
        "param_group": {k: v for k, v in groups[0].items() if k != "params" and _plain(v)},
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": _scalars(getattr(engine.optimizer, "loss_scaler", None)),
    }


def _plain(value) -> bool:
    return isinstance(value, (int, float, bool, str, type(None))) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value))


def _scalars(obj) -> dict[str, Any] | None:
    """A loss scaler's numbers (its whole state: scale, hysteresis, iteration counters)."""
    if obj is None:
        return None
    return {k: v for k, v in vars(obj).items() if isinstance(v, (int, float, bool))}


def load_state(engine, chunks, reader: StateReader) -> list[str]:
    """Install the checkpoint's state into this rank's engine; returns notes for the user
    (e.g. a vocabulary padding that changed with the tensor-parallel size)."""
    view = optimizer_view(engine)
    state = reader.state
    view.prepare(state["adam_step"] or 0)
    notes: list[str] = []
    moments = reader.has_state("exp_avg")
    with torch.no_grad():
        _install_all(view, chunks, reader, moments, notes)
    view.finish()
    _restore_engine(engine, state)
    return sorted(set(notes))


def _install_all(view, chunks, reader: StateReader, moments: bool, notes: list[str]) -> None:
    """One parameter and one state at a time: the peak is the largest full tensor plus its
    shard, not the model."""
    for param, spec in param_specs(chunks):
        for key in STATES:
            if key != "fp32" and not moments:
                continue  # saved before the first step: Adam's moments stay zero (prepare)
            full = fit_to_layout(reader.full(spec.global_name, key), spec, notes)
            view.install(param, key, shard(full, spec))
            del full


def fit_to_layout(full: torch.Tensor, spec: ParamSpec, notes: list[str]) -> torch.Tensor:
    """The saved tensor in this layout's shape. Only the vocabulary padding may differ (it is
    a multiple of 128 x tp): rows are dropped or zero rows added past the padded size. The
    padded rows are zero in a model trained by dsforge and take part in no loss
    (runtime/assemble/vocab.py), so the resumed model is the saved one."""
    if tuple(full.shape) == spec.full_shape:
        return full
    if spec.global_name not in VOCAB_TENSORS or full.shape[1:] != spec.full_shape[1:]:
        raise StateError(f"{spec.global_name} is {tuple(full.shape)} in the checkpoint but "
                         f"{spec.full_shape} in this model")
    rows = spec.full_shape[0]
    notes.append(f"the padded vocabulary changes from {full.shape[0]} to {rows} rows with the "
                 "tensor-parallel size; the padding rows are outside the softmax, so the model "
                 "is unchanged")
    if full.shape[0] > rows:
        return full[:rows].clone()
    return pad_rows(full, rows)


def _restore_engine(engine, state: dict[str, Any]) -> None:
    for group in engine.optimizer.param_groups:
        for key, value in state["param_group"].items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in (state["loss_scaler"] or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)
