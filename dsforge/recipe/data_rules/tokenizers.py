"""The rules on the tokenizer: D15 none with synthetic data; D14 data.tokenizer loads; D12 the
tokenizer's vocabulary (data.tokenizer's, else the datasets' records') fits model.vocab_size;
D13 data.tokenizer is the one the datasets were made with.

A tokenizer is loaded once for the sizes and modification times of the files that define it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from dsforge.problems import Problem
from dsforge.recipe.data_rules.datasets import Dataset, opened_datasets
from dsforge.recipe.data_rules.kind import data_kind, file_stat
from dsforge.recipe.fixes import Context
from dsforge.schema import SYNTHETIC, Recipe

if TYPE_CHECKING:
    from dsforge.data.errors import DataError
    from dsforge.data.identity import TokenizerIdentity


def tokenizer(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """D15: no tokenizer with synthetic data; D14: data.tokenizer loads; D12: the tokenizer's
    vocabulary fits model.vocab_size; D13: it is the one the datasets were made with."""
    d, kind = recipe.data, data_kind(recipe.data)
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
    recorded = [ds for ds in (opened_datasets(recipe) or ()) if ds.info.identity is not None]
    if identity is not None:
        for ds in recorded:
            yield from _other_tokenizer(d.tokenizer, identity, ds)
    yield from _vocabulary(recipe, identity, recorded)


def _other_tokenizer(name: str, identity: TokenizerIdentity, ds: Dataset) -> Iterator[Problem]:
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
                recorded: list[Dataset]) -> Iterator[Problem]:
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
        key = tuple(file_stat(str(path / file)) for file in TOKENIZER_FILES)
    else:
        key = (file_stat(name),)
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
