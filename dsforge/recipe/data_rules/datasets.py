"""The rules on Megatron datasets and blends of them: D7 every dataset opens (both files, an
index, sizes that agree, its record); D8 a dataset is named by its prefix, not its .bin or .idx;
D9 a blend's datasets share one tokenizer. The datasets, opened, for the split and tokenizer
rules (`opened_datasets`).

A dataset is opened from its .idx (memory-mapped by Megatron-Core's own IndexedDataset), the
size of its .bin and its PREFIX.tokenizer.json record, never its tokens; what is opened is
cached by the sizes and modification times of those files.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dsforge.problems import Problem
from dsforge.recipe.data_rules.kind import data_kind, file_stat, has_dataset_files, prefix_of_file
from dsforge.recipe.fixes import Context
from dsforge.schema import DataConfig, Recipe

if TYPE_CHECKING:
    from dsforge.data.errors import DataError
    from dsforge.data.indexed import DatasetInfo

PREPARE = "`dsforge data prepare INPUT... --tokenizer T --output {prefix}`"


@dataclass(frozen=True, eq=False)
class Dataset:
    """One dataset the recipe trains on, opened or not."""
    field: str  # as the recipe writes it: "data.source" or "data.source[i].path"
    path: str
    info: DatasetInfo | None = None
    opened: "Opened | None" = None
    problem: Problem | None = None  # D7/D8: why it cannot be opened


@dataclass(frozen=True, eq=False)
class Opened:
    dataset: Any  # Megatron-Core's IndexedDataset: holds the memory map of the .idx
    info: DatasetInfo

    def tokens(self, first: int, last: int) -> int:
        """Tokens in sequences [first, last): reads the shorter side of the index."""
        lengths, count = self.dataset.sequence_lengths, self.info.sequences
        if last - first <= count // 2:
            return int(lengths[first:last].sum(dtype="int64"))
        outside = lengths[:first].sum(dtype="int64") + lengths[last:].sum(dtype="int64")
        return self.info.tokens - int(outside)


def _datasets(data: DataConfig) -> list[Dataset]:
    """The datasets of a prefix or a blend (weight-0 parts left out)."""
    if isinstance(data.source, str):
        parts = [("data.source", data.source)]
    else:
        parts = [(f"data.source[{i}].path", part.path) for i, part in enumerate(data.source)
                 if part.weight > 0]
    return [_dataset(field, path, single=isinstance(data.source, str)) for field, path in parts]


def _dataset(field: str, path: str, *, single: bool) -> Dataset:
    prefix = prefix_of_file(path)
    if prefix is not None:
        return Dataset(field=field, path=path, problem=Problem(
            rule="D8", fields={field: path},
            message=f"names the dataset's {path[len(prefix):]} file; a dataset is read by its "
                    "prefix (PREFIX for PREFIX.bin + PREFIX.idx)",
            fix=f"write the prefix {prefix}"))
    opened = _open(path)
    if not isinstance(opened, Opened):
        return Dataset(field=field, path=path, problem=_cannot_open(field, path, opened, single))
    return Dataset(field=field, path=path, info=opened.info, opened=opened)


def _cannot_open(field: str, path: str, error: DataError, single: bool) -> Problem:
    if single and not os.path.exists(path) and not has_dataset_files(path) \
            and "has not finished" not in error.message:
        return Problem(rule="D7", fields={field: path},
                       message="not found: no token file of this name and no dataset "
                               f"{Path(path).name}.bin + .idx",
                       fix="check the path (relative paths start at the recipe's directory); "
                           f"make a dataset with {PREPARE.format(prefix=path)}, or a token "
                           "file with tools/tokenize_text.py")
    return Problem(rule="D7", fields={field: path}, message=error.message,
                   fix=error.fix.replace("--output PREFIX", f"--output {path}"))


def _open(prefix: str) -> Opened | DataError:
    from dsforge.data.identity import RECORD_SUFFIX

    stats = tuple(file_stat(prefix + suffix) for suffix in (".bin", ".idx", RECORD_SUFFIX))
    if stats[0] is None or stats[1] is None:  # refused before anything is read or imported
        return open_files(prefix)
    return _open_cached(prefix, stats)


@functools.lru_cache(maxsize=16)
def _open_cached(prefix: str, stats: tuple) -> Opened | DataError:
    """Keyed by the sizes and modification times of PREFIX.bin, .idx and .tokenizer.json."""
    return open_files(prefix)


def open_files(prefix: str) -> Opened | DataError:
    from dsforge.data.errors import DataError
    from dsforge.data.indexed import open_dataset

    try:
        dataset, info = open_dataset(prefix)
    except DataError as exc:
        return exc
    return Opened(dataset=dataset, info=info)


def dataset_files(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """D7: every dataset opens (both files, an index, sizes that agree, its record); D8: a
    prefix is named, not its .bin or .idx; D9: a blend's datasets share one tokenizer."""
    kind = data_kind(recipe.data)
    if kind == "dataset_file":
        yield _dataset("data.source", recipe.data.source, single=True).problem
        return
    if kind != "dataset":
        return
    datasets = _datasets(recipe.data)
    yield from (d.problem for d in datasets if d.problem is not None)
    yield from _blend_tokenizers(datasets)


def _blend_tokenizers(datasets: list[Dataset]) -> Iterator[Problem]:
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


def opened_datasets(recipe: Recipe) -> list[Dataset] | None:
    """The recipe's datasets when it names datasets and every one of them opens."""
    if data_kind(recipe.data) != "dataset":
        return None
    datasets = _datasets(recipe.data)
    return datasets if all(d.opened is not None for d in datasets) else None
