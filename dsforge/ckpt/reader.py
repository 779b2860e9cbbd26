"""Read a checkpoint's layout-free state back as full, unsharded tensors, without a process group.

`open_state(checkpoint_dir)` reads the piece records of every rank file (headers only);
`full(name, state)` reads the pieces of one parameter and joins them: the data-parallel
ranges of each tensor-parallel shard are concatenated (they must tile the shard exactly),
then the shards are joined along the shard dimension (ckpt/names.py `unshard`). Memory is
one parameter at a time, which is what keeps a resume on another layout and `dsforge export`
bounded by the largest parameter rather than the model: the rank files' memory maps are closed
after each parameter, since the pages read through an open map stay resident
(benchmarks/checkpoints: a 1B export peaked at 4.8 GiB with them kept open).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from dsforge.ckpt.format import COMPLETE, FORMAT_VERSION, STATE_DIR, STATE_FILE, Piece, rank_file
from dsforge.ckpt.names import unshard

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StateError(RuntimeError):
    """A checkpoint whose layout-free state is missing, incomplete or inconsistent."""


class StateReader:
    def __init__(self, directory: Path, marker: dict[str, Any], state: dict[str, Any],
                 pieces: dict[tuple[str, str], list[tuple[Path, Piece]]]):
        self.directory = directory
        self.recipe: dict[str, Any] = marker["recipe"]
        self.state = state
        self.padded_vocab_size: int = state["padded_vocab_size"]
        self._pieces = pieces
        self._files: dict[Path, Any] = {}

    def names(self) -> list[str]:
        """Global parameter names in model order (embedding, layers by number, final norm,
        output layer)."""
        return sorted({name for name, _ in self._pieces}, key=_model_order)

    def has_state(self, state: str) -> bool:
        if state == "param":
            state = "fp32"
        return any(s == state for _, s in self._pieces)

    def full(self, name: str, state: str = "param") -> torch.Tensor:
        """The full tensor of parameter `name`'s `state`: "fp32", "exp_avg", "exp_avg_sq", or
        "param" (the fp32 master weights in the training precision)."""
        if state == "param":
            precision = (self.recipe.get("train") or {}).get("precision", "fp32")
            return self.full(name, "fp32").to(_DTYPES[precision])
        pieces = self._pieces.get((name, state))
        if not pieces:
            raise StateError(f"{self.directory}: no {state} state for {name}")
        first = pieces[0][1]
        try:
            shards = [self._shard(name, state, rank, [(f, p) for f, p in pieces if p.tp_rank == rank])
                      for rank in range(first.tp_size)]
        finally:
            # A rank file is read through a memory map, and every page read stays in the
            # process's resident set while the map is open: kept open, the maps would hold the
            # whole state read so far (measured: a 1B export peaked at the model's size).
            self._close()
        full = unshard(shards, dim=first.tp_dim, stride=first.stride)
        del shards
        if tuple(full.shape) != first.full_shape:
            raise StateError(f"{self.directory}: {name} ({state}) joins to {tuple(full.shape)}, "
                             f"not its recorded shape {first.full_shape}")
        return full

    def _shard(self, name: str, state: str, tp_rank: int,
               pieces: list[tuple[Path, Piece]]) -> torch.Tensor:
        if not pieces:
            raise StateError(f"{self.directory}: {name} ({state}) has no piece from "
                             f"tensor-parallel rank {tp_rank}: a rank file is missing")
        shape = pieces[0][1].local_shape
        flat = torch.empty(math.prod(shape), dtype=torch.float32)
        covered = 0
        for path, piece in sorted(pieces, key=lambda fp: fp[1].start):
            if piece.start != covered:
                raise StateError(f"{self.directory}: {name} ({state}, tensor-parallel rank "
                                 f"{tp_rank}): elements {covered}..{piece.start} are in no rank "
                                 "file, or two files overlap (files from different saves?)")
            flat[piece.start:piece.start + piece.numel] = self._read(path, piece)
            covered += piece.numel
        if covered != flat.numel():
            raise StateError(f"{self.directory}: {name} ({state}, tensor-parallel rank {tp_rank}) "
                             f"has {covered} of its {flat.numel()} elements")
        return flat.view(shape)

    @property
    def open_files(self) -> int:
        """Rank files mapped now: none between parameters (pages read through an open map
        stay resident)."""
        return len(self._files)

    def _close(self) -> None:
        for handle in self._files.values():
            handle.__exit__(None, None, None)
        self._files.clear()

    def _read(self, path: Path, piece: Piece) -> torch.Tensor:
        from safetensors import safe_open

        if path not in self._files:
            self._files[path] = safe_open(str(path), framework="pt")
        return self._files[path].get_tensor(piece.key)


def open_state(directory: Path) -> StateReader:
    """The layout-free state of checkpoint `directory` (a stepNNNNNNNN directory with its
    completion marker). StateError when it has none or it is incomplete."""
    directory = Path(directory)
    marker = _read_json(directory / COMPLETE, "its completion marker (the save never finished)")
    state_dir = directory / STATE_DIR
    if not state_dir.is_dir():
        raise StateError(f"{directory} has no layout-free state ({STATE_DIR}/): it was saved by a "
                         "dsforge before checkpoints kept one. Resume it once on its own layout "
                         "with this dsforge and let it save, then use the new checkpoint")
    state = _read_json(state_dir / STATE_FILE, "its layout-free state record")
    if state.get("format") != FORMAT_VERSION:
        raise StateError(f"{state_dir / STATE_FILE}: format {state.get('format')!r}; this dsforge "
                         f"reads format {FORMAT_VERSION}")
    pieces: dict[tuple[str, str], list[tuple[Path, Piece]]] = defaultdict(list)
    for rank in range(state["ranks"]):
        path = state_dir / rank_file(rank)
        for piece in _pieces_of(path):
            pieces[(piece.name, piece.state)].append((path, piece))
    return StateReader(directory, marker, state, dict(pieces))


def _pieces_of(path: Path) -> list[Piece]:
    from safetensors import safe_open

    if not path.is_file():
        raise StateError(f"{path} is missing: every rank writes one")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for a cut-short header
        raise StateError(f"{path} cannot be read ({exc}): cut short?") from None
    return [Piece.from_json(record) for record in json.loads(metadata.get("pieces", "[]"))]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"{path} is missing: the checkpoint has no {what}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateError(f"{path} is not whole JSON ({exc}): cut short?") from None


_NUMBER = re.compile(r"(\d+)")


def _model_order(name: str) -> tuple:
    """Embedding first, then layers by number (experts by id), final norm, output layer."""
    rank = 0 if name.startswith("embedding.") else 2 if not name.startswith("decoder.layers.") else 1
    if name.startswith("output_layer."):
        rank = 3
    parts = tuple(int(p) if p.isdigit() else p for p in _NUMBER.split(name))
    return (rank, parts)
