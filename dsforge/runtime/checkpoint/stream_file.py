"""A rank's state file written as a stream: the safetensors format (what `safetensors.safe_open`
reads, ckpt/reader.py), its header first, then the tensors' bytes in order, from host buffers
that may hold only part of the state at a time (runtime/checkpoint/staging.py `parts`).

safetensors' own `save_file` needs every tensor in memory at once and writes them in one call
that says nothing until it returns. Written here piece by piece instead, a save can stage less
than the whole state, and `progress` counts the bytes on disk as they get there, so a slow
save that moves is told from a hung one (runtime/guard/watchdog.py). The file is flushed to disk
every SYNC_EVERY_BYTES, so the final fsync does not hold a whole state's dirty pages.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Iterable

import torch

SYNC_EVERY_BYTES = 256 * 2**20
_ALIGN = 8  # the data starts 8-byte aligned, as safetensors' writer pads its header


class Progress:
    """Bytes a rank's save has on disk so far (written and synced), read by the watchdog's
    thread while the writer adds to it."""

    def __init__(self):
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes

    def __call__(self) -> int:
        with self._lock:
            return self._bytes


def header(sizes: dict[str, int], metadata: dict[str, str]) -> bytes:
    """The file's first bytes for flat fp32 tensors of `sizes` (key -> elements), in order."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, numel in sizes.items():
        entries[key] = {"dtype": "F32", "shape": [numel],
                        "data_offsets": [offset, offset + 4 * numel]}
        offset += 4 * numel
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return len(text).to_bytes(8, "little") + text


def write_stream(path: Path, sizes: dict[str, int], metadata: dict[str, str],
                 chunks: Iterable[torch.Tensor], progress: Progress | None = None) -> None:
    """The file at `path`, on disk (fsync) when this returns: `chunks` are fp32 host tensors
    whose elements, end to end, are the tensors of `sizes` in order (a chunk may hold several
    tensors, or part of one)."""
    expected = 4 * sum(sizes.values())
    written = unsynced = 0
    with open(path, "wb") as out:
        out.write(header(sizes, metadata))
        for chunk in chunks:
            data = memoryview(chunk.detach().reshape(-1).numpy()).cast("B")
            for start in range(0, len(data), SYNC_EVERY_BYTES):  # a large chunk moves too
                piece = data[start:start + SYNC_EVERY_BYTES]
                out.write(piece)
                written, unsynced = written + len(piece), unsynced + len(piece)
                if unsynced >= SYNC_EVERY_BYTES:
                    _sync(out, progress, unsynced)
                    unsynced = 0
        if written != expected:
            raise ValueError(f"{path}: {written} bytes of tensors given, {expected} expected")
        _sync(out, progress, unsynced)


def _sync(out, progress: Progress | None, nbytes: int) -> None:
    out.flush()
    os.fsync(out.fileno())
    if progress is not None:
        progress.add(nbytes)
