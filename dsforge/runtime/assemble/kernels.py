"""Liger Kernel's fused kernels inside Megatron-Core's model (model.kernels: liger).

translate/kernels.py decides which kernels a rank runs; this module holds the three pieces
the liger choice plugs into the model (runtime/assemble/model.py builds the spec with them):
  - `LigerRMSNorm`: dsforge's RMSNorm (the sequence-parallel marker) on Liger's RMSNorm
    kernel, with Llama's casting (statistics in fp32, the weight applied in the input dtype);
  - `LigerSwiGLU`: MLP's activation on the whole fc1 output [.., 2 x ffn] (gate, then up),
    Megatron's `use_te_activation_func` slot, which any module taking the config fills;
  - `LigerLossGPTModel`: GPTModel whose loss is Liger's: with one tensor-parallel rank the
    output layer and the cross-entropy fused, the logits made one chunk of tokens at a time
    and never whole (neither the 16-bit [tokens, vocab] logits nor their fp32 copy, 6 bytes a
    logit, 6 GiB a microbatch of 8k tokens at a 128k vocabulary); with tp > 1 Liger's
    vocab-parallel cross-entropy (one kernel, but an fp32 buffer of the logits as Megatron's).
    Either loss sees the recipe's vocabulary only (vocab.py): the fused one is given the
    weight's unpadded rows, the vocab-parallel one the output layer's masked logits.
Liger is imported when a model is built, never at import time: it imports Triton, and the CPU
path never needs either. `liger_ops()` is the one place that names Liger's functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dsforge.runtime.assemble.layers import RMSNorm
from dsforge.runtime.assemble.vocab import masked_vocab_gpt_model
from dsforge.translate.kernels import KernelChoice


@dataclass(frozen=True)
class LigerOps:
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps) -> y
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # [tokens, 2 ffn] -> [tokens, ffn]
    cross_entropy: Callable[..., torch.Tensor]  # (logits [s, b, v/tp], labels [s, b], tp_group)
    # (hidden [tokens, h], output weight [v, h], labels [tokens]) -> the mean loss, the logits
    # made one chunk of tokens at a time and never whole
    linear_cross_entropy: Callable[..., torch.Tensor]


def liger_ops() -> LigerOps:
    from liger_kernel.megatron import LigerMegatronCrossEntropy
    from liger_kernel.ops import LigerFusedGateUpSiLUMulFunction, LigerRMSNormFunction
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    def rms_norm(x, weight, eps):
        # offset 0, Llama's casting, not in place (Megatron keeps the input for recompute).
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False, None)

    def swiglu(x):
        return LigerFusedGateUpSiLUMulFunction.apply(x, False)

    linear_loss = LigerFusedLinearCrossEntropyLoss()  # mean: its gradient is made in the forward
    return LigerOps(rms_norm=rms_norm, swiglu=swiglu, cross_entropy=LigerMegatronCrossEntropy(),
                    linear_cross_entropy=lambda x, weight, labels: linear_loss(weight, x, labels))


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


def liger_loss_gpt_model(fused_head: bool = True) -> type:
    """GPTModel with Liger's loss (a function: megatron.core imports at call time). With one
    tensor-parallel rank the output layer and the cross-entropy are one fused function that
    makes the logits a chunk of tokens at a time (`_FusedLossHead`); with tp > 1, or without
    `fused_head` (a loss masked per token, data.eod_mask_loss: the fused one is a mean), the
    logits are vocabulary-parallel, their padded columns masked (vocab.py), and Liger's
    vocab-parallel cross-entropy takes them."""
    class LigerLossGPTModel(masked_vocab_gpt_model()):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._ops = liger_ops()
            self._fused_head = fused_head and self.post_process and \
                self.config.tensor_model_parallel_size == 1
            if self._fused_head:
                _FusedLossHead.adopt(self.output_layer, self._ops.linear_cross_entropy,
                                     self.unpadded_vocab_size)

        def forward(self, *args: Any, labels=None, **kwargs: Any):
            if not self._fused_head or labels is None:
                return super().forward(*args, labels=labels, **kwargs)
            self.output_layer.labels = labels.transpose(0, 1).contiguous()
            try:
                return super().forward(*args, labels=labels, **kwargs)
            finally:
                self.output_layer.labels = None

        def compute_language_model_loss(self, labels, logits):
            """Per-token loss [batch, seq], as GPTModel's own: labels arrive [b, s], logits
            [s, b, vocab / tp], or, from the fused head, the loss already [s, b]."""
            if self._fused_head:
                return logits.transpose(0, 1)
            loss = self._ops.cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                           self.pg_collection.tp)
            return loss.transpose(0, 1).contiguous()

    return LigerLossGPTModel


class _FusedLossHead:
    """The output layer (Megatron's ColumnParallelLinear, one tp rank), made to return the loss
    when its model was given labels: the matmul and the cross-entropy run inside the layer's
    own forward, so ZeRO-3 has its weight gathered there as for any forward. The loss is the
    mean over the tokens, spread back over them ([s, b], every entry the mean): dsforge's step
    takes the mean of the per-token loss, which is then this loss, and its gradient Liger's.
    The fused function is given the weight's first `vocab_size` rows: the padded rows make no
    logit (vocab.py), and their gradient is zero. Without labels the layer's own forward runs,
    its padded logits masked."""

    @staticmethod
    def adopt(layer, linear_cross_entropy, vocab_size: int) -> None:
        plain_forward = layer.forward
        layer.labels = None

        def forward(input_, weight=None, runtime_gather_output=None):
            if layer.labels is None:
                return plain_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            seq, batch, hidden = input_.shape
            full = layer.weight if weight is None else weight
            loss = linear_cross_entropy(input_.reshape(-1, hidden), full[:vocab_size],
                                        layer.labels.reshape(-1))
            return loss.expand(seq, batch), None

        layer.forward = forward
