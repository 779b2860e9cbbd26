"""Where dataset indices are cached by default (data.cache_dir: null); no heavy imports, so
recipe validation and the ranks share it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "XDG_CACHE_HOME"


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/dsforge/indices, else ~/.cache/dsforge/indices: per machine, so every
    node builds its own (docs/data.md)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "dsforge" / "indices"
