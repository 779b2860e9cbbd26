"""Bugs of the pinned Megatron-Core (0.16.1) that dsforge works around on every device.

The CPU backend (cpu_backend.py) redirects what Megatron assumes about CUDA; this module holds
what is wrong on a GPU as well, so the fix cannot depend on the device the tests run on.

- `moe_utils.te_general_gemm` is defined only when Transformer Engine imports, but
  `RouterGatingLinearFunction` (every MoE router's gating GEMM) tests `te_general_gemm is not
  None` unconditionally: without Transformer Engine the first MoE forward dies with
  "NameError: name 'te_general_gemm' is not defined" (measured on an H200, 2026-11-26, the GPU
  kit's moe-8l run). dsforge does not need Transformer Engine, so the name is bound to None,
  which selects the plain torch.mm path the function already has.
- `RowParallelLinear.forward` hands `tp_group=None` to its linear function (the column one
  hands its group), which then looks the group up and, on rank 0, calls `warnings.warn` on
  every forward: a graph break torch.compile cannot trace (model.compile: layers). The
  layer's own group is handed instead; the row layer's linear does no tensor-parallel
  communication of its own (its reduction follows outside), so nothing else changes.
- Attention's linear layers run inside `FineGrainedActivationOffloadingInterface(flag, x,
  name)`, a context manager that does nothing when offloading is off (dsforge never turns it
  on) but that torch.compile cannot step into. With offloading off it is a
  `contextlib.nullcontext(x)`, which torch.compile traces.
"""

from __future__ import annotations

import contextlib
import importlib

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
ATTENTION = "megatron.core.transformer.attention"
LAYERS = "megatron.core.tensor_parallel.layers"


def apply() -> None:
    """Install the workarounds (idempotent). A fixed Megatron-Core makes each a no-op."""
    moe_utils = importlib.import_module(MOE_UTILS)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _row_linear_group()
    _offloading_off()


def _row_linear_group() -> None:
    row = importlib.import_module(LAYERS).RowParallelLinear
    if getattr(row._forward_impl, "dsforge_fix", False):
        return
    original = row._forward_impl

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return original(self, input, weight, *args, **kwargs)

    _forward_impl.dsforge_fix = True
    _forward_impl.__wrapped_original__ = original  # what the fix replaced (the tests restore it)
    row._forward_impl = _forward_impl


def _offloading_off() -> None:
    attention = importlib.import_module(ATTENTION)
    interface = attention.off_interface
    if getattr(interface, "dsforge_fix", False):
        return

    class Offloading(interface):
        """The interface, or a nullcontext yielding its tensor where offloading is off."""
        dsforge_fix = True

        def __new__(cls, offload, tensor, name):
            if not offload:
                return contextlib.nullcontext(tensor)
            return super().__new__(cls)

    attention.off_interface = Offloading
