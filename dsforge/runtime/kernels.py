"""Liger Kernel's fused kernels inside Megatron-Core's model (model.kernels: liger).

translate/kernels.py decides which kernels a rank runs; this module holds the three pieces
the liger choice plugs into the model (runtime/model.py builds the spec with them):
  - `LigerRMSNorm`: dsforge's RMSNorm (the sequence-parallel marker) on Liger's RMSNorm
    kernel, with Llama's casting (statistics in fp32, the weight applied in the input dtype);
  - `LigerSwiGLU`: MLP's activation on the whole fc1 output [.., 2 x ffn] (gate, then up),
    Megatron's `use_te_activation_func` slot, which any module taking the config fills;
  - `LigerLossGPTModel`: GPTModel whose loss is Liger's vocab-parallel cross-entropy over the
    16-bit logits (Megatron's upcasts them to fp32 first), at any tp.
Liger is imported when a model is built, never at import time: it imports Triton, and the CPU
path never needs either. `liger_ops()` is the one place that names Liger's functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dsforge.runtime.layers import RMSNorm
from dsforge.translate.kernels import KernelChoice


@dataclass(frozen=True)
class LigerOps:
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps) -> y
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # [tokens, 2 ffn] -> [tokens, ffn]
    cross_entropy: Callable[..., torch.Tensor]  # (logits [s, b, v/tp], labels [s, b], tp_group)


def liger_ops() -> LigerOps:
    from liger_kernel.megatron import LigerMegatronCrossEntropy
    from liger_kernel.ops import LigerFusedGateUpSiLUMulFunction, LigerRMSNormFunction

    def rms_norm(x, weight, eps):
        # offset 0, Llama's casting, not in place (Megatron keeps the input for recompute).
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False, None)

    def swiglu(x):
        return LigerFusedGateUpSiLUMulFunction.apply(x, False)

    return LigerOps(rms_norm=rms_norm, swiglu=swiglu, cross_entropy=LigerMegatronCrossEntropy())


def loadable(choice: KernelChoice, asked: str) -> KernelChoice:
    """`choice` as this rank can run it: auto's liger falls back to torch's kernels where Liger
    (or the Triton under it) does not load, saying why; a liger asked for by name must load."""
    if choice.impl != "liger" or asked != "auto":
        return choice
    try:
        liger_ops()
    except Exception as exc:  # a broken Triton or liger-kernel install; auto means: then torch
        return KernelChoice("torch", f"auto: liger-kernel did not load here "
                                     f"({type(exc).__name__}: {str(exc)[:120]})")
    return choice


class LigerRMSNorm(RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps)
        self._rms_norm = liger_ops().rms_norm

    def forward(self, x):
        return self._rms_norm(x, self.weight, self.eps)


class LigerSwiGLU(nn.Module):
    """silu(gate) x up for fc1's output, whose last dimension holds gate then up."""

    def __init__(self, config=None):
        super().__init__()
        self._swiglu = liger_ops().swiglu

    def forward(self, x):
        shape = x.shape
        out = self._swiglu(x.reshape(-1, shape[-1]))
        return out.view(*shape[:-1], shape[-1] // 2)


def liger_loss_gpt_model() -> type:
    """GPTModel with Liger's cross-entropy (a function: megatron.core imports at call time)."""
    from megatron.core.models.gpt import GPTModel

    class LigerLossGPTModel(GPTModel):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._cross_entropy = liger_ops().cross_entropy

        def compute_language_model_loss(self, labels, logits):
            """Per-token loss [batch, seq], as GPTModel's own: labels arrive [b, s], logits
            [s, b, vocab / tp]."""
            loss = self._cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                       self.pg_collection.tp)
            return loss.transpose(0, 1).contiguous()

    return LigerLossGPTModel
