"""On a GPU: grouped experts train as Megatron's sequential ones do, and at ep 1 an MoE layer
with them copies nothing to the host (skipped on CPU; issue 38).

The two runs (conftest.py: recipes/tiny_moe.yaml on The Tempest at ep 1, bf16, lr 3e-4, 30
steps) differ only in how the experts run: the same parameters, the same tokens, sums in
another order. The host-sync check builds one MoE layer in a child process (a world of one
over NCCL) and runs its forward and backward under torch.cuda.set_sync_debug_mode("error"),
which raises on any synchronising call (.item(), .tolist(), nonzero, a device-to-host copy):
dsforge's on-device dispatch must pass, and Megatron's all-to-all dispatcher, which copies the
token counts to the host, must fail it (so the check can fail).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.gpu.test_gpu_precision import KERNEL_ATOL, KERNEL_RTOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_grouped_experts_train_as_sequential_ones_over_30_steps(gpu_runs):
    grouped_run = gpu_runs["moe_grouped"]
    used = json.loads((grouped_run.run_dir / "manifest.json").read_text())["implementations"]
    assert used["experts"] == "grouped", used
    grouped, sequential = grouped_run.losses(), gpu_runs["moe_sequential"].losses()
    assert grouped[-1] < grouped[0] - 0.5, "the grouped experts did not learn"
    far = [(step, g, s) for step, (g, s) in enumerate(zip(grouped, sequential))
           if abs(g - s) > KERNEL_ATOL + KERNEL_RTOL * abs(s)]
    assert not far, f"grouped and sequential experts part at (step, grouped, sequential): {far}"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="torch's grouped GEMM loops over the groups with a host sync below sm90")
@pytest.mark.parametrize("experts, syncs", [("grouped", False), ("sequential", True)])
def test_an_ep1_moe_layer_copies_nothing_to_the_host(experts, syncs):
    done = subprocess.run([sys.executable, "-m", "tests.gpu.moe_sync", experts], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["experts_module"] == {"grouped": "GroupedExperts",
                                        "sequential": "SequentialMLP"}[experts]
    assert result["synchronised"] == syncs, result
