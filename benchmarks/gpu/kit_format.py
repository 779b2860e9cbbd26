"""How the GPU kit's tables write a figure (kit_table.py, kit_peers.py)."""

from __future__ import annotations


def num(value, fmt: str = ",.0f") -> str:
    """`value` in `fmt`, or "-" where the run has none."""
    return format(value, fmt) if value is not None else "-"


def pct(value, missing: str = "-") -> str:
    """A share as a percentage, or `missing` (the results table says "n/a" where an MFU cannot
    be known, the peers' "-" where a run did not measure one)."""
    return f"{value:.1%}" if value is not None else missing
