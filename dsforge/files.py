"""Writing files so a reader sees the old content or the new one, never half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write beside `path`, flush to disk, rename over it, and sync the directory entry."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename or a new entry in `directory` durable (the entry, not the file's data)."""
    fsync_file(directory)  # a directory is fsynced through a descriptor as a file is


def fsync_file(path: Path) -> None:
    """Flush a file another library wrote (torch.save, safetensors) to disk: a completion
    marker written after it must never name data still in the page cache."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
