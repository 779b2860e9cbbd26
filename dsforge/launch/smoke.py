"""The correctness half of `dsforge run --tiny`: the layout's losses against one rank's.

dsforge initialises every layout identically (runtime/assemble/init.py) and feeds step t the same
samples whatever the layout (runtime/loop/data.py), so the tiny model on the recipe's layout and
the same tiny model on a single rank must follow the same loss trajectory up to the order of
floating-point reductions. A larger difference means the layout computes something else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsforge.job.run_dir import RunDir
from dsforge.job.metrics_file import read_metrics

# Largest per-step loss difference accepted (absolute, on losses of ~5 at tiny size). fp32:
# different reduction orders move losses by ~1e-5 (tests/distributed/test_equivalence.py
# holds 1e-4 on 2-4 ranks); bf16 rounds each matmul to 8 bits of mantissa.
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}


@dataclass(frozen=True, kw_only=True)
class LossCheck:
    steps: int
    max_difference: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.steps > 0 and self.max_difference <= self.tolerance

    def describe(self) -> str:
        verdict = "matches" if self.ok else "DOES NOT match"
        return (f"layout check: the loss {verdict} a single-rank run of the same tiny model "
                f"(largest difference {self.max_difference:.2e} over {self.steps} steps, "
                f"tolerance {self.tolerance:.0e})")


def losses(run_dir: RunDir) -> dict[tuple[str, int], float | None]:
    """Training losses by ("loss", step) and validation losses by ("val_loss", step); None for
    one that was not finite (metrics.jsonl writes null)."""
    path = run_dir.metrics
    if not path.exists():
        return {}
    steps, evals = read_metrics(path)
    return {**{("loss", r["step"]): r["loss"] for r in steps},
            **{("val_loss", r["step"]): r["val_loss"] for r in evals}}


def compare_losses(run_dir: RunDir, reference_dir: RunDir, precision: str) -> LossCheck:
    run, reference = losses(run_dir), losses(reference_dir)
    common = set(run) & set(reference)
    worst = max((_difference(run[key], reference[key]) for key in common), default=math.inf)
    return LossCheck(steps=sum(kind == "loss" for kind, _ in common), max_difference=worst, tolerance=LOSS_TOLERANCE[precision])


def _difference(got: float | None, expected: float | None) -> float:
    """How far apart two losses are; a loss that was not finite (None) equals only another."""
    if got is None or expected is None:
        return 0.0 if got is None and expected is None else math.inf
    return abs(got - expected)
