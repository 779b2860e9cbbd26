"""Pipeline bubble of 1F1B and interleaved 1F1B (docs/memory-and-bubble.md).

Two definitions are in use and dsforge reports both, named:
- bubble_fraction: idle time relative to the ideal (bubble-free) compute time,
  (p-1)/m for 1F1B and (p-1)/(v*m) for interleaved 1F1B (Narayanan et al. 2021, Megatron).
- bubble_share_of_step: idle share of the whole step, (p-1)/(v*m + p-1); this is what a
  measurement of "time spent waiting / step time" compares with.
"""

from __future__ import annotations


def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
    if pp == 1:
        return 0.0
    return (pp - 1) / (vpp * num_microbatches)


def bubble_share_of_step(pp: int, vpp: int, num_microbatches: int) -> float:
    if pp == 1:
        return 0.0
    return (pp - 1) / (vpp * num_microbatches + pp - 1)
