"""The rules on a flat token file (data.source naming a file of token ids): D2 it holds whole
tokens and a sample; D3/D4 a sample of its ids fits model.vocab_size and does not look like the
other token_dtype; D10/D11 the split leaves windows to train and evaluate on.

The ids are checked from at most ~1M tokens spread over the file, read through a memory map and
cached by path, size and modification time.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from dsforge.problems import Problem
from dsforge.recipe.data_rules.kind import data_kind
from dsforge.recipe.fixes import Context
from dsforge.schema import Recipe, split_shares


def token_file(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """D2: a token file exists, holds whole tokens and at least one sample; D3/D4: a sample
    of its ids fits model.vocab_size and does not look like the other token_dtype."""
    d, seq_len = recipe.data, recipe.train.seq_len
    if data_kind(d) not in ("token_file", "directory"):
        return
    path, fields = Path(d.source), {"data.source": d.source}
    if path.is_dir():
        yield Problem(rule="D2", fields=fields,
                      message="is a directory, not a token file or a dataset prefix",
                      fix="name the token file itself (a flat array of token ids), e.g. "
                          "data/tempest.u16.bin, or a dataset's prefix (PREFIX for PREFIX.bin + "
                          "PREFIX.idx), e.g. data/tempest")
        return
    info = path.stat()
    width = _TOKEN_BYTES[d.token_dtype]
    fields = {**fields, "data.token_dtype": d.token_dtype}
    if info.st_size % width:
        yield Problem(rule="D2", fields=fields,
                      message=f"{info.st_size} bytes is not a whole number of {d.token_dtype} "
                              f"tokens ({width} bytes each)",
                      fix="set data.token_dtype: uint16 if the file holds 16-bit ids"
                          if d.token_dtype == "uint32" and info.st_size % 2 == 0
                          else "check the file: it was cut short or holds no token ids")
        return
    tokens = info.st_size // width
    if tokens < seq_len + 1:
        yield Problem(rule="D2", fields={**fields, "train.seq_len": seq_len},
                      message=f"{tokens} tokens is fewer than one sample of seq_len + 1 = "
                              f"{seq_len + 1}",
                      fix="use a longer file" + (f", or train.seq_len <= {tokens - 1}"
                                                  if tokens > 1 else ""))
        return
    try:
        sample = _token_sample(str(path), d.token_dtype, info.st_size, info.st_mtime_ns)
    except OSError as exc:
        yield Problem(rule="D2", fields=fields, message=f"cannot be read: {exc.strerror}",
                      fix="check the file's permissions")
        return
    yield from _token_ids(recipe, sample, fields)
    yield from _token_file_parts(recipe, (tokens - 1) // seq_len)


def _token_file_parts(recipe: Recipe, windows: int) -> Iterator[Problem]:
    """D11 / D10 for a flat token file: the split cuts its windows of seq_len + 1 tokens
    (runtime/loop/data.py); training needs some, evaluation some held out."""
    from dsforge.data.indexed import split_ranges

    d, t = recipe.data, recipe.train
    if split_shares(d.split) is None:
        return  # D6, found when the section was built
    train, validation, _ = [(b[1] - b[0]) if b else 0 for b in split_ranges(d.split, windows)]
    fields = {"data.source": d.source, "data.split": d.split, "train.seq_len": t.seq_len}
    if not train:
        yield Problem(rule="D11", fields=fields,
                      message=f"leaves no training window of the file's {windows} windows of "
                              f"seq_len + 1 tokens", fix="give training a larger share")
    elif t.eval_every > 0 and not validation:
        yield Problem(rule="D10", fields={**fields, "train.eval_every": t.eval_every},
                      message=f"leaves no validation window of the file's {windows} windows of "
                              "seq_len + 1 tokens, but train.eval_every asks for a validation loss",
                      fix="give validation a larger share (e.g. data.split: \"90,10,0\"), use "
                          "a longer file or a shorter train.seq_len, or set train.eval_every: 0")


_TOKEN_BYTES = {"uint16": 2, "uint32": 4}
_SAMPLE_BLOCKS, _SAMPLE_BLOCK = 256, 4096  # at most ~1M tokens are read to check a file


@dataclass(frozen=True)
class _TokenSample:
    tokens: int  # how many were read
    whole_file: bool
    largest: int  # the largest id read as the declared dtype
    largest_as_uint16: int  # the same bytes read as uint16 (for a uint32 declaration)
    # Read as uint16 pairs (a uint16 declaration only): the largest value at the places the
    # high and the low halves of 32-bit ids would be; None when too few were read.
    high_halves: int | None
    low_halves: int | None


@functools.lru_cache(maxsize=16)  # validation runs again for every suggested value
def _token_sample(path: str, dtype: str, size: int, mtime_ns: int) -> _TokenSample:
    """Up to _SAMPLE_BLOCKS blocks of _SAMPLE_BLOCK tokens spread over the file (all of it
    when small), read through a memory map; size and mtime key the cache."""
    import numpy as np

    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    count = len(tokens)
    if count <= _SAMPLE_BLOCKS * _SAMPLE_BLOCK:
        sample = np.array(tokens)
    else:  # block starts are even, so uint16 pairs stay aligned with 32-bit ids
        starts = np.linspace(0, count - _SAMPLE_BLOCK, _SAMPLE_BLOCKS).astype(np.int64) & ~1
        sample = np.concatenate([tokens[s:s + _SAMPLE_BLOCK] for s in starts])
    halves = sample.view(np.uint16)
    pairs = halves[: len(halves) // 2 * 2].reshape(-1, 2)
    high = 1 if sys.byteorder == "little" else 0
    paired = dtype == "uint16" and len(pairs) >= 16
    return _TokenSample(tokens=len(sample), whole_file=len(sample) == count,
                        largest=int(sample.max()), largest_as_uint16=int(halves.max()),
                        high_halves=int(pairs[:, high].max()) if paired else None,
                        low_halves=int(pairs[:, 1 - high].max()) if paired else None)


def _token_ids(recipe: Recipe, sample: _TokenSample, fields: dict[str, Any]) -> Iterator[Problem]:
    vocab, dtype = recipe.model.vocab_size, recipe.data.token_dtype
    read = "in the file" if sample.whole_file else f"in a sample of {sample.tokens:,} tokens"
    # 32-bit ids below the vocabulary have high halves <= (vocab - 1) >> 16: all 0 when the
    # vocabulary fits 16 bits. Token ids written as uint16 are never confined like that.
    most_high = (vocab - 1) >> 16
    if sample.high_halves is not None and sample.high_halves <= most_high < sample.low_halves:
        yield Problem(rule="D4", fields=fields,
                      message=f"every second 16-bit value {read} is "
                              f"{'0' if most_high == 0 else f'at most {most_high}'} while the "
                              "others are larger: the pattern of 32-bit token ids read as uint16 "
                              "(their high halves would be trained on as token ids)",
                      fix="set data.token_dtype: uint32")
        return
    if sample.largest < vocab:
        return
    vocab_field = {**fields, "model.vocab_size": vocab}
    if dtype == "uint32" and sample.largest_as_uint16 < vocab:
        yield Problem(rule="D4", fields=vocab_field,
                      message=f"read as uint32 the ids {read} reach {sample.largest:,}, beyond "
                              "the vocabulary; read as uint16 they all fit it: the file looks "
                              "like 16-bit token ids",
                      fix="set data.token_dtype: uint16")
        return
    yield Problem(rule="D3", fields=vocab_field,
                  message=f"token id {sample.largest:,} {read} is outside the model's "
                          f"vocabulary (ids 0..{vocab - 1})",
                  fix=f"set model.vocab_size to at least {sample.largest + 1} (the tokenizer's "
                      "vocabulary), or check data.token_dtype and that the file was made with "
                      "this model's tokenizer")
