"""The rules on the data section that need the files it names (D2-D4, D6's second half, D7-D16).

What data.source names decides which rules apply (`_kind`):
- "synthetic": D15 (a tokenizer is pointless). Validation draws held-out samples from a second
  seeded stream, so train.eval_every works.
- a flat token file (a string naming an existing file that is not a dataset's .bin or .idx):
  D2-D4; D12/D14 for data.tokenizer.
- a Megatron dataset prefix or a blend of them: D7-D14, D16, and D6 for a split that
  Megatron-Core reads differently from dsforge. Blend parts of weight 0 are left out, as the
  runtime leaves them out (data/samples.py).

A dataset is checked from its .idx (memory-mapped by Megatron-Core's own IndexedDataset), the
size of its .bin and its PREFIX.tokenizer.json record: never its tokens, so a 100 GB corpus
validates in seconds. Validation runs again for every value a fix suggests: what is read is
cached by path, size and modification time. megatron.core takes seconds to import; it is
imported only when a recipe names a dataset.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

from dsforge.data.cache import default_cache_dir
from dsforge.problems import Problem
from dsforge.recipe.schema import SYNTHETIC, DataConfig, Recipe, split_parts, split_shares

if TYPE_CHECKING:
    from dsforge.data.errors import DataError
    from dsforge.data.identity import TokenizerIdentity
    from dsforge.data.indexed import DatasetInfo

PREPARE = "`dsforge data prepare INPUT... --tokenizer T --output {prefix}`"


class _Context(Protocol):
    """What these rules use of validate.py's context (that module imports this one)."""
    batch: Any  # BatchSizes, or None when dp is unknown or the batch does not divide

    def working(self, recipe: Recipe, rule: str, path: str, values: Iterable[Any]) -> list[Any]:
        """The values of `path` with which `rule` holds and nothing else breaks."""


def _kind(data: DataConfig) -> str:
    """DataConfig.kind (what the ranks read) told apart further for the messages: a token file
    that is a dataset's .bin or .idx named instead of its prefix ("dataset_file"), and a
    directory that holds no dataset prefix ("directory"); "indexed" is called "dataset"."""
    kind = data.kind
    if kind == "token_file":
        return "dataset_file" if _prefix_of_file(data.source) else "token_file"
    if kind == "indexed" and isinstance(data.source, str) and Path(data.source).is_dir() \
            and not _has_dataset_files(data.source):
        return "directory"
    return "dataset" if kind == "indexed" else kind


def _prefix_of_file(path: str) -> str | None:
    """PREFIX when `path` is PREFIX.bin or PREFIX.idx and the other file of the pair exists."""
    for suffix, other in ((".bin", ".idx"), (".idx", ".bin")):
        if path.endswith(suffix) and os.path.isfile(path[:-len(suffix)] + other):
            return path[:-len(suffix)]
    return None


def _has_dataset_files(prefix: str) -> bool:
    return os.path.exists(f"{prefix}.bin") or os.path.exists(f"{prefix}.idx")


# ------------------------------------------------------------------------- flat token files

def token_file(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """D2: a token file exists, holds whole tokens and at least one sample; D3/D4: a sample
    of its ids fits model.vocab_size and does not look like the other token_dtype."""
    d, seq_len = recipe.data, recipe.train.seq_len
    if _kind(d) not in ("token_file", "directory"):
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


# ------------------------------------------------------------------------------- datasets

@dataclass(frozen=True, eq=False)
class _Dataset:
    """One dataset the recipe trains on, opened or not."""
    field: str  # as the recipe writes it: "data.source" or "data.source[i].path"
    path: str
    info: DatasetInfo | None = None
    opened: "_Opened | None" = None
    problem: Problem | None = None  # D7/D8: why it cannot be opened


@dataclass(frozen=True, eq=False)
class _Opened:
    dataset: Any  # Megatron-Core's IndexedDataset: holds the memory map of the .idx
    info: DatasetInfo

    def tokens(self, first: int, last: int) -> int:
        """Tokens in sequences [first, last): reads the shorter side of the index."""
        lengths, count = self.dataset.sequence_lengths, self.info.sequences
        if last - first <= count // 2:
            return int(lengths[first:last].sum(dtype="int64"))
        outside = lengths[:first].sum(dtype="int64") + lengths[last:].sum(dtype="int64")
        return self.info.tokens - int(outside)


def _datasets(data: DataConfig) -> list[_Dataset]:
    """The datasets of a prefix or a blend (weight-0 parts left out)."""
    if isinstance(data.source, str):
        parts = [("data.source", data.source)]
    else:
        parts = [(f"data.source[{i}].path", part.path) for i, part in enumerate(data.source)
                 if part.weight > 0]
    return [_dataset(field, path, single=isinstance(data.source, str)) for field, path in parts]


def _dataset(field: str, path: str, *, single: bool) -> _Dataset:
    prefix = _prefix_of_file(path)
    if prefix is not None:
        return _Dataset(field=field, path=path, problem=Problem(
            rule="D8", fields={field: path},
            message=f"names the dataset's {path[len(prefix):]} file; a dataset is read by its "
                    "prefix (PREFIX for PREFIX.bin + PREFIX.idx)",
            fix=f"write the prefix {prefix}"))
    opened = _open(path)
    if not isinstance(opened, _Opened):
        return _Dataset(field=field, path=path, problem=_cannot_open(field, path, opened, single))
    return _Dataset(field=field, path=path, info=opened.info, opened=opened)


def _cannot_open(field: str, path: str, error: DataError, single: bool) -> Problem:
    if single and not os.path.exists(path) and not _has_dataset_files(path) \
            and "has not finished" not in error.message:
        return Problem(rule="D7", fields={field: path},
                       message="not found: no token file of this name and no dataset "
                               f"{Path(path).name}.bin + .idx",
                       fix="check the path (relative paths start at the recipe's directory); "
                           f"make a dataset with {PREPARE.format(prefix=path)}, or a token "
                           "file with tools/tokenize_text.py")
    return Problem(rule="D7", fields={field: path}, message=error.message,
                   fix=error.fix.replace("--output PREFIX", f"--output {path}"))


def _stat(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns


def _open(prefix: str) -> _Opened | DataError:
    from dsforge.data.identity import RECORD_SUFFIX

    stats = tuple(_stat(prefix + suffix) for suffix in (".bin", ".idx", RECORD_SUFFIX))
    if stats[0] is None or stats[1] is None:  # refused before anything is read or imported
        return _open_files(prefix)
    return _open_cached(prefix, stats)


@functools.lru_cache(maxsize=16)
def _open_cached(prefix: str, stats: tuple) -> _Opened | DataError:
    """Keyed by the sizes and modification times of PREFIX.bin, .idx and .tokenizer.json."""
    return _open_files(prefix)


def _open_files(prefix: str) -> _Opened | DataError:
    from dsforge.data.errors import DataError
    from dsforge.data.indexed import open_dataset

    try:
        dataset, info = open_dataset(prefix)
    except DataError as exc:
        return exc
    return _Opened(dataset=dataset, info=info)


def dataset_files(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """D7: every dataset opens (both files, an index, sizes that agree, its record); D8: a
    prefix is named, not its .bin or .idx; D9: a blend's datasets share one tokenizer."""
    kind = _kind(recipe.data)
    if kind == "dataset_file":
        yield _dataset("data.source", recipe.data.source, single=True).problem
        return
    if kind != "dataset":
        return
    datasets = _datasets(recipe.data)
    yield from (d.problem for d in datasets if d.problem is not None)
    yield from _blend_tokenizers(datasets)


def _blend_tokenizers(datasets: list[_Dataset]) -> Iterator[Problem]:
    from dsforge.data.identity import mismatches

    recorded = [d for d in datasets if d.info is not None and d.info.identity is not None]
    if not recorded:
        return
    first = recorded[0]
    others = [d for d in recorded[1:] if mismatches(first.info.identity, d.info.identity)]
    if not others:
        return
    made = "; ".join(f"{d.field}: {d.info.identity.summary()}" for d in [first, *others])
    yield Problem(rule="D9", fields={d.field: d.path for d in [first, *others]},
                  message=f"the blend's datasets were made with different tokenizers ({made}): "
                          "the same id would mean different text",
                  fix="prepare every dataset of the blend with one tokenizer (`dsforge data "
                      "prepare INPUT... --tokenizer T --output PREFIX`), or leave out the "
                      "datasets made with another")


def _opened(recipe: Recipe) -> list[_Dataset] | None:
    """The recipe's datasets when it names datasets and every one of them opens."""
    if _kind(recipe.data) != "dataset":
        return None
    datasets = _datasets(recipe.data)
    return datasets if all(d.opened is not None for d in datasets) else None


# -------------------------------------------------------------------------------- splits

TRAIN, VALIDATION = 0, 1  # indices of the parts in split_ranges


@functools.lru_cache(maxsize=256)
def _split_tokens(opened: _Opened, split: str) -> tuple[tuple[int, int] | None, ...]:
    """(sequences, tokens) of the train, validation and test parts; None for a part without
    a share. Raises what Megatron's split parser raises."""
    from dsforge.data.indexed import split_ranges

    return tuple(None if bounds is None else (bounds[1] - bounds[0], opened.tokens(*bounds))
                 for bounds in split_ranges(split, opened.info.sequences))


def _megatron_reading(split: str) -> list[float] | None:
    """Megatron-Core's shares for the split string, None when its parser refuses it."""
    from dsforge.data.indexed import parse_split

    try:
        return parse_split(split)
    except (AssertionError, ValueError, ZeroDivisionError):
        return None


def dataset_splits(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """D6: Megatron-Core reads the split as dsforge does; D10: with train.eval_every, every
    dataset's validation part holds a sequence; D11: the training part holds one global
    batch, and every dataset's training part a sequence. The test part, and the validation part
    without evaluation, are never built (data/samples.py), so they may be empty."""
    datasets = _opened(recipe)
    if datasets is None:
        return
    split = recipe.data.split
    shares, megatron = split_shares(split), _megatron_reading(split)
    if shares is None:
        return  # D6, found when the section was built
    if megatron is None or not all(math.isclose(ours, theirs, abs_tol=1e-9)
                                   for ours, theirs in zip(shares, megatron)):
        read = "cannot read it" if megatron is None else \
            "reads it as " + ", ".join(f"{100 * share:.4g}%" for share in megatron)
        plain = ",".join(f"{100 * share:.4g}" for share in shares)
        yield Problem(rule="D6", fields={"data.split": split},
                      message=f"Megatron-Core, which splits the datasets, {read} (it takes the "
                              "digits and dots of the string as numbers)",
                      fix=f'write plain numbers: data.split: "{plain}"')
        return
    parts = [(d, _split_tokens(d.opened, split)) for d in datasets]
    if recipe.train.eval_every > 0:
        yield from _validation_part(recipe, ctx, parts)
    yield from _training_part(recipe, ctx, parts)


def _validation_part(recipe: Recipe, ctx: _Context, parts: list) -> Iterator[Problem]:
    split, every = recipe.data.split, recipe.train.eval_every
    fields = {"data.split": split, "train.eval_every": every}
    if parts[0][1][VALIDATION] is None:
        yield Problem(rule="D10", fields=fields,
                      message="gives the validation set no share, but train.eval_every asks for "
                              f"a validation loss every {every} steps",
                      fix=_split_fix(recipe, ctx, "D10", "or set train.eval_every: 0"))
        return
    empty = [d for d, shares in parts if shares[VALIDATION][0] == 0]
    if not empty:
        return
    fix = _split_fix(recipe, ctx, "D10", "or set train.eval_every: 0")
    yield Problem(rule="D10", fields={**fields, **{d.field: d.path for d in empty}},
                  message=f"the validation part ({_share(split, VALIDATION)} of each dataset's "
                          "sequences, cut at bounds Megatron-Core rounds to whole sequences) is "
                          f"empty for {_sizes(empty)}: Megatron-Core would loop forever drawing "
                          "validation samples from it", fix=fix)


def _training_part(recipe: Recipe, ctx: _Context, parts: list) -> Iterator[Problem]:
    t, split = recipe.train, recipe.data.split
    if parts[0][1][TRAIN] is None:
        yield Problem(rule="D11", fields={"data.split": split},
                      message="gives training no share of the data",
                      fix=_split_fix(recipe, ctx, "D11", "") or 'use e.g. data.split: "98,1,1"')
        return
    empty = [d for d, shares in parts if shares[TRAIN][0] == 0]
    if empty:
        yield Problem(rule="D11", fields={"data.split": split, **{d.field: d.path for d in empty}},
                      message=f"the training part ({_share(split, TRAIN)} of each dataset's "
                              "sequences, cut at bounds Megatron-Core rounds to whole sequences) "
                              f"is empty for {_sizes(empty)}: Megatron-Core would loop forever "
                              "drawing training samples from it",
                      fix=_split_fix(recipe, ctx, "D11", "or use datasets with more documents"))
        return
    global_batch = ctx.batch.global_batch if ctx.batch else t.global_batch
    if global_batch is None:
        return  # derived from a world size not known here
    need = global_batch * t.seq_len + 1
    held = sum(shares[TRAIN][1] for _, shares in parts)
    if held >= need:
        return
    batch_fields = {f"train.{name}": getattr(t, name) for name in _BATCH_FIELDS
                    if getattr(t, name) is not None}
    fields = {**batch_fields, "train.seq_len": t.seq_len, **{d.field: d.path for d, _ in parts}}
    batch = "train.global_batch" if t.global_batch is not None else "the global batch"
    most = (held - 1) // t.seq_len
    options = [_fitting(recipe, ctx, "train.global_batch", most),
               _fitting(recipe, ctx, "train.seq_len", (held - 1) // global_batch)]
    options = [option for option in options if option]
    yield Problem(rule="D11", fields=fields,
                  message=f"the training part of the data ({_share(split, TRAIN)} of each "
                          f"dataset's sequences) holds {held:,} tokens, fewer than one global "
                          f"batch needs: {batch} x train.seq_len + 1 = {global_batch} x "
                          f"{t.seq_len} + 1 = {need:,}",
                  fix="use more data (a larger dataset or blend), or "
                      + ("use " + ", or ".join(options) if options else
                         f"a global batch of at most {most} sequences"))


_BATCH_FIELDS = ("global_batch", "micro_batch", "grad_accum")  # those the recipe sets are fields


def _sizes(datasets: list[_Dataset]) -> str:
    """'data.source (50 sequences)', for each dataset."""
    return ", ".join(f"{d.field} ({d.info.sequences:,} sequence{'s' * (d.info.sequences != 1)})"
                     for d in datasets)


def _share(split: str, part: int) -> str:
    return f"{100 * split_shares(split)[part]:.4g}%"


def _fitting(recipe: Recipe, ctx: _Context, path: str, most: int) -> str:
    """'PATH in {..., a, b}': the largest values <= `most` with which D11 holds and nothing
    else breaks (checked by validating again); '' when there are none."""
    values = ctx.working(recipe, "D11", path, range(max(1, most - 63), most + 1))
    if not values:
        return ""
    return f"{path} in {{{'..., ' if len(values) > 4 else ''}{', '.join(map(str, values[-4:]))}}}"


def _split_fix(recipe: Recipe, ctx: _Context, rule: str, otherwise: str) -> str:
    """'use data.split: "X", OTHERWISE' with the split nearest the recipe's that clears `rule`
    (checked by validating again), or OTHERWISE alone."""
    found = ctx.working(recipe, rule, "data.split", _split_candidates(recipe.data.split))
    if not found:
        return otherwise.removeprefix("or ")
    return f'use data.split: "{found[0]}"' + (f", {otherwise}" if otherwise else "")


_SHARES = (0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 25, 30, 40, 50)  # validation percent
_COMMON = ((98, 1, 1), (90, 5, 5), (80, 10, 10))


def _split_candidates(split: str) -> list[str]:
    """Splits with a larger validation share taken from training (the test share kept), then
    common ones; written as the recipe writes its split (percent or fractions)."""
    values = split_parts(split)
    total = sum(values)
    scale = 1.0 if math.isclose(total, 1.0, rel_tol=1e-6) else 100.0
    _, validation, test = (100 * v / total for v in values)
    candidates = [(100 - share - test, share, test) for share in _SHARES
                  if share > validation and 100 - share - test > 0]
    written = [",".join(f"{v * scale / 100:.4g}" for v in shares)
               for shares in [*candidates, *_COMMON]]
    return list(dict.fromkeys(written))


# ----------------------------------------------------------------------------- tokenizers

def tokenizer(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """D15: no tokenizer with synthetic data; D14: data.tokenizer loads; D12: the tokenizer's
    vocabulary fits model.vocab_size; D13: it is the one the datasets were made with."""
    d, kind = recipe.data, _kind(recipe.data)
    if kind == "synthetic":
        if d.tokenizer is not None:
            yield Problem(rule="D15",
                          fields={"data.tokenizer": d.tokenizer, "data.source": SYNTHETIC},
                          message="synthetic tokens are drawn uniformly from model.vocab_size; "
                                  "no tokenizer is used",
                          fix="remove data.tokenizer (or train on a dataset made with it)")
        return
    identity = None
    if d.tokenizer is not None:
        loaded = _tokenizer_identity(d.tokenizer)
        if isinstance(loaded, Exception):
            yield Problem(rule="D14", fields={"data.tokenizer": d.tokenizer},
                          message=loaded.message, fix=loaded.fix)
        else:
            identity = loaded
    recorded = [ds for ds in (_opened(recipe) or ()) if ds.info.identity is not None]
    if identity is not None:
        for ds in recorded:
            yield from _other_tokenizer(d.tokenizer, identity, ds)
    yield from _vocabulary(recipe, identity, recorded)


def _other_tokenizer(name: str, identity: TokenizerIdentity, ds: _Dataset) -> Iterator[Problem]:
    from dsforge.data.identity import mismatches

    found = mismatches(ds.info.identity, identity)
    if found:
        made = ds.info.identity
        yield Problem(rule="D13", fields={"data.tokenizer": name, ds.field: ds.path},
                      message=f"is not the tokenizer the dataset was made with ({'; '.join(found)}"
                              f"; the dataset's: {made.summary()})",
                      fix=f"use data.tokenizer: {made.path or made.name} (the dataset's), or "
                          f"prepare the dataset again with `dsforge data prepare INPUT... "
                          f"--tokenizer {name} --output {ds.path}`")


def _vocabulary(recipe: Recipe, identity: TokenizerIdentity | None,
                recorded: list[_Dataset]) -> Iterator[Problem]:
    vocab = recipe.model.vocab_size
    if identity is not None:
        needed, fields = identity.vocab_size, {"data.tokenizer": recipe.data.tokenizer}
        whose = "data.tokenizer's"
    elif recorded:
        widest = max(recorded, key=lambda ds: ds.info.identity.vocab_size)
        needed, fields = widest.info.identity.vocab_size, {widest.field: widest.path}
        whose = "the dataset's tokenizer (its PREFIX.tokenizer.json record)"
    else:
        return
    if needed > vocab:
        yield Problem(rule="D12", fields={"model.vocab_size": vocab, **fields},
                      message=f"{whose} vocabulary holds {needed:,} ids (0..{needed - 1:,}), more "
                              f"than the model's {vocab:,}: ids beyond it fail inside the model",
                      fix=f"set model.vocab_size to at least {needed}")


def _tokenizer_identity(name: str) -> TokenizerIdentity | DataError:
    """data.tokenizer's identity, or why it cannot be loaded; cached by the sizes and times of
    the files that define it."""
    from dsforge.data.tokenizers import BYTES, TOKENIZER_FILES

    path = Path(name)
    if name == BYTES or not path.exists():
        key: tuple = ()
    elif path.is_dir():
        key = tuple(_stat(str(path / file)) for file in TOKENIZER_FILES)
    else:
        key = (_stat(name),)
    return _load_identity(name, key)


@functools.lru_cache(maxsize=8)
def _load_identity(name: str, key: tuple) -> TokenizerIdentity | DataError:
    from dsforge.data.errors import DataError
    from dsforge.data.tokenizers import load_tokenizer

    try:
        return load_tokenizer(name).identity
    except DataError as exc:
        return exc
    except OSError as exc:
        return DataError("data.tokenizer", name, f"cannot be read: {exc.strerror or exc}",
                         "check the files' permissions")


# ------------------------------------------------------------------------------ cache_dir

def cache_dir(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """D16: the index cache of a dataset recipe is a writable directory, or can be made."""
    if _kind(recipe.data) != "dataset":
        return
    given = recipe.data.cache_dir
    path = Path(given) if given is not None else default_cache_dir()
    why = _unwritable(path)
    if why is None:
        return
    where = "" if given is not None else f" (the default, {path}: data.cache_dir is not set)"
    yield Problem(rule="D16", fields={"data.cache_dir": given},
                  message=f"{why}{where}; Megatron-Core writes the datasets' sample indices there",
                  fix="set data.cache_dir to a directory this user can write (a few MB per "
                      "dataset and split)" + (", or leave it out for ~/.cache/dsforge/indices"
                                              if given is not None else ""))


def _unwritable(path: Path) -> str | None:
    """Why `path` cannot serve as a directory to write in; None when it can (or can be made)."""
    if path.exists():
        if not path.is_dir():
            return "is a file, not a directory"
        writable = os.access(path, os.W_OK | os.X_OK)
        return None if writable else "is a directory this user cannot write"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: this user cannot write {parent}"
    return None


DATA_RULES: tuple[Callable[[Recipe, "_Context"], Iterator[Problem]], ...] = (
    token_file, dataset_files, dataset_splits, tokenizer, cache_dir,
)
