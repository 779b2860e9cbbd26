"""Bugs of the pinned Megatron-Core (0.16.1) that dsforge works around on every device.

The CPU backend (cpu_backend.py) redirects what Megatron assumes about CUDA; this module holds
what is wrong on a GPU as well, so the fix cannot depend on the device the tests run on.

- `moe_utils.te_general_gemm` is defined only when Transformer Engine imports, but
  `RouterGatingLinearFunction` (every MoE router's gating GEMM) tests `te_general_gemm is not
  None` unconditionally: without Transformer Engine the first MoE forward dies with
  "NameError: name 'te_general_gemm' is not defined" (measured on an H200, 2026-11-26, the GPU
  kit's moe-8l run). dsforge does not need Transformer Engine, so the name is bound to None,
  which selects the plain torch.mm path the function already has.
"""

from __future__ import annotations

import importlib

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def apply() -> None:
    """Install the workarounds (idempotent). A fixed Megatron-Core makes each a no-op."""
    moe_utils = importlib.import_module(MOE_UTILS)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
