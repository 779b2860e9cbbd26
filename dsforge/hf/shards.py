"""A streaming safetensors writer: shards planned from shapes, tensors written as produced.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range in the data that follows) and the tensors' bytes back to back
(https://github.com/huggingface/safetensors, "Format"). Everything in the header follows from
the shapes and dtypes, so it is written first and each tensor is written the moment it is
produced and then dropped: the writer holds one tensor (and its cast copy), never a shard or
the model. Shards follow transformers' names (model.safetensors alone, else
model-0000K-of-0000N.safetensors plus model.safetensors.index.json) and its rule for
max_shard_size: a shard takes tensors in order until the next would pass the limit; a tensor
larger than the limit gets a shard of its own.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from dsforge.files import write_atomic

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.finfo(self.dtype).bits // 8


def parse_size(text: str) -> int:
    """Bytes in "5GB" (10**9, as transformers counts), "2GiB" (2**30), "500MB" or "123"."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    return int(value)


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def header(entries: list[Entry]) -> bytes:
    """The length prefix and JSON header of a file holding `entries` in this order."""
    fields: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        fields[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def write_shards(folder: Path, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]],
                 max_bytes: int) -> list[str]:
    """Write `entries` into shards under `folder`, taking each tensor from `tensors` (pairs of
    name and tensor, in the order of `entries`; cast to the entry's dtype here). Returns the
    file names written, the index included when there is more than one shard."""
    shards = plan_shards(entries, max_bytes)
    names = shard_names(len(shards))
    for name, shard in zip(names, shards):
        _write_file(folder / name, shard, tensors)
    if len(shards) > 1:
        weight_map = {entry.name: name for name, shard in zip(names, shards) for entry in shard}
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        write_atomic(folder / INDEX, json.dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names


def _write_file(path: Path, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    with open(path, "wb") as f:
        f.write(header(entries))
        for entry in entries:
            name, tensor = next(tensors)
            if name != entry.name or tuple(tensor.shape) != entry.shape:
                raise ValueError(f"expected {entry.name} {entry.shape}, got {name} "
                                 f"{tuple(tensor.shape)}")
            data = tensor.detach().to(device="cpu", dtype=entry.dtype).contiguous()
            f.write(data.reshape(-1).view(torch.uint8).numpy())
            del data, tensor
        f.flush()
        os.fsync(f.fileno())
