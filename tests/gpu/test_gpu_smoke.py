"""On a GPU machine: the smoke recipe in bf16 through NCCL, with MFU reported (skipped on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dsforge.metrics_file import read_metrics
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_smoke_recipe_in_bf16_on_one_gpu(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "dsforge", "run", str(REPO / "recipes" / "smoke.yaml"),
         "--set", "parallel.dp=1", "--set", "train.precision=bf16", "--set", "train.steps=30",
         "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["memory_source"] == "cuda max_memory_allocated"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["device"]["type"] == "cuda"
