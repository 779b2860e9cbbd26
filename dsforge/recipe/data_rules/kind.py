"""What data.source names, told apart for the data rules, and the file facts they share."""

from __future__ import annotations

import os
from pathlib import Path

from dsforge.schema import DataConfig


def data_kind(data: DataConfig) -> str:
    """DataConfig.kind (what the ranks read) told apart further for the messages: a token file
    that is a dataset's .bin or .idx named instead of its prefix ("dataset_file"), and a
    directory that holds no dataset prefix ("directory"); "indexed" is called "dataset"."""
    kind = data.kind
    if kind == "token_file":
        return "dataset_file" if prefix_of_file(data.source) else "token_file"
    if kind == "indexed" and isinstance(data.source, str) and Path(data.source).is_dir() \
            and not has_dataset_files(data.source):
        return "directory"
    return "dataset" if kind == "indexed" else kind


def prefix_of_file(path: str) -> str | None:
    """PREFIX when `path` is PREFIX.bin or PREFIX.idx and the other file of the pair exists."""
    for suffix, other in ((".bin", ".idx"), (".idx", ".bin")):
        if path.endswith(suffix) and os.path.isfile(path[:-len(suffix)] + other):
            return path[:-len(suffix)]
    return None


def has_dataset_files(prefix: str) -> bool:
    return os.path.exists(f"{prefix}.bin") or os.path.exists(f"{prefix}.idx")


def file_stat(path: str) -> tuple[int, int] | None:
    """(size, modification time in ns), the key of what is cached from a file; None when
    there is no file to stat."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns
