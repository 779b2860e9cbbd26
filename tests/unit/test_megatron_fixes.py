"""Megatron-Core bugs dsforge works around on every device (dsforge.runtime.assemble.megatron_fixes).

Each test runs in a fresh interpreter without the CPU backend, as a GPU rank would: the fix
must not depend on the CPU backend being active."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

# The MoE router's gating GEMM, forward and backward, as Megatron's TopKRouter.gating calls it
# on a GPU. Plain CPU tensors: the function itself needs no device.
GATING = (
    "import torch\n"
    "from megatron.core.transformer.moe import moe_utils\n"
    "{fix}"
    "x = torch.randn(4, 8, requires_grad=True)\n"
    "w = torch.randn(3, 8, requires_grad=True)\n"
    "y = moe_utils.router_gating_linear(x, w, None, torch.float32)\n"
    "y.sum().backward()\n"
    "assert torch.allclose(y, x @ w.t()) and w.grad is not None\n"
    "print('gated')\n")


def _python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_the_pinned_megatron_core_still_has_the_router_bug():
    """Without Transformer Engine the pinned package's router dies on its first GEMM. When an
    upgrade fixes it, this fails: drop the workaround from megatron_fixes.py then."""
    out = _python(GATING.format(fix=""))
    assert "NameError: name 'te_general_gemm' is not defined" in out.stderr


def test_the_router_gemm_runs_without_transformer_engine():
    fix = "from dsforge.runtime.assemble import megatron_fixes\nmegatron_fixes.apply()\n"
    out = _python(GATING.format(fix=fix))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "gated"
