"""Bounds every section checks its numbers against, and the helpers that check them."""

from __future__ import annotations

import re

from dsforge.problems import Checks

# Largest values dsforge accepts. Far beyond any real model or cluster, they keep every loop
# over layers, ranks or candidate values (plan, the fixes validation suggests) short.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20  # hidden, ffn and head sizes
MAX_HEADS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_SEQ_LEN = 1 << 22
MAX_EXPERTS = 4096
MAX_ROTARY_BASE = 10**12
MAX_WORLD = 1 << 18  # ranks, and any one parallel degree
MAX_BATCH = 1 << 24  # sequences per step (global_batch), per microbatch, microbatches
MAX_STEPS = 10**9
# numpy's legacy seeding takes 0 <= seed < 2**32; the data order multiplies the seed by about
# 2**20 and torch generators take seeds below 2**64 (runtime/loop/data.py).
SEED_LIMIT = 1 << 32
MAX_NAME = 100
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def require_positive(checks: Checks, rule: str, section: str, **values: int | float | None) -> None:
    for name, value in values.items():
        if value is not None:
            checks.require(value > 0, rule, {f"{section}.{name}": value}, "must be > 0",
                           f"set {section}.{name} to a positive value")


def require_at_most(checks: Checks, rule: str, section: str, limit: int, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None:
            checks.require(value <= limit, rule, {f"{section}.{name}": value},
                           f"must be at most {limit:,} (dsforge's limit, far beyond real jobs)",
                           f"set {section}.{name} to a value up to {limit:,}")
