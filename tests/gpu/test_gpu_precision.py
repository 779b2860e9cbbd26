"""On a GPU: bf16 training follows fp32 on the smoke recipe (skipped on CPU).

Both runs use one rank, the same seed and the same data order, so their loss curves differ only
by precision. The GPU kit (benchmarks/gpu/kit_results.py) reads the two runs' metrics from
this test's `precision-fp32` and `precision-bf16` run directories for its table.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch

from dsforge.metrics_file import read_metrics
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

STEPS = 60
TOLERANCE = 0.05  # |bf16 - fp32| / fp32 of the mean loss over the last 10 steps


def _losses(run_dir, precision: str) -> list[float]:
    result = subprocess.run(
        [sys.executable, "-m", "dsforge", "run", str(REPO / "recipes" / "smoke.yaml"),
         "--set", "parallel.dp=1", "--set", f"train.precision={precision}",
         "--set", f"train.steps={STEPS}", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == STEPS
    return [r["loss"] for r in records]


def test_bf16_loss_follows_fp32(tmp_path):
    fp32 = _losses(tmp_path / "precision-fp32", "fp32")
    bf16 = _losses(tmp_path / "precision-bf16", "bf16")
    tail32, tail16 = statistics.mean(fp32[-10:]), statistics.mean(bf16[-10:])
    assert tail16 < bf16[0] - 0.5, "bf16 did not learn"
    assert abs(tail16 - tail32) <= TOLERANCE * tail32, (tail16, tail32)
