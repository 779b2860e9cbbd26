"""The rule on the index cache of a dataset recipe: D16 data.cache_dir (or the default,
~/.cache/dsforge/indices) is a directory this user can write, or can be made."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from dsforge.data.cache import default_cache_dir
from dsforge.problems import Problem
from dsforge.recipe.data_rules.kind import data_kind
from dsforge.recipe.fixes import Context
from dsforge.schema import Recipe


def cache_dir(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """D16: the index cache of a dataset recipe is a writable directory, or can be made."""
    if data_kind(recipe.data) != "dataset":
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
