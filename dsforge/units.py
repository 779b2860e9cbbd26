"""Byte units, and the one way dsforge shows a size to a person.

(launch/probe.py keeps its own MiB: its source runs alone on remote hosts, without dsforge.)
"""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30


def format_bytes(n: float, digits: int = 1) -> str:
    """`n` bytes in GiB from half a GiB up, in MiB below, with `digits` decimals."""
    return f"{n / GiB:,.{digits}f} GiB" if n >= GiB / 2 else f"{n / MiB:,.{digits}f} MiB"
