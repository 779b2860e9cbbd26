"""The vocabulary's padding is storage only: padded logits never reach a softmax.

Megatron-Core needs every tensor-parallel shard of the embedding and the output layer to be a
multiple of 128 rows (schema/model.py `padded_vocab_size`: 128 x tp), so the same recipe has
384 rows at tp 1 and 512 at tp 2 for a vocabulary of 257. Megatron's cross-entropy takes the
softmax over every row it has, so the padding rows would change the loss with tp, and the
model trained with it. `MaskedVocabGPTModel` sets the output layer's padded columns to the
dtype's lowest value before anything reads them (every loss: Megatron's vocab-parallel
cross-entropy, Liger's vocab-parallel one; the logits returned without labels too), so each
token's softmax is over the recipe's vocabulary exactly: exp of a masked column is 0 in any
of those losses (their largest logit is over every rank and finite), and the mask's gradient
is zero there, so the padded output rows get none. Liger's fused output layer and loss never
makes the logits; it is given the unpadded rows of the weight instead (kernels.py).

The padded rows are zero from the start (runtime/assemble/init.py; a Hugging Face folder has no
such rows, hf/names.py adds zeros) and stay zero: no gradient reaches them (an embedding row
past the vocabulary is never looked up), so Adam's moments stay zero, and weight decay keeps a
zero a zero. A checkpoint therefore holds the same tensors on every tp but for zero rows,
which a resume on another tp drops or adds (runtime/checkpoint/layout_free.py).

The mask is a finite value, not -inf: a shard that is all padding (a vocabulary of 257 at tp 4:
rank 3 holds rows 384..511) then has a finite local maximum, and no kernel subtracts -inf from
-inf.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# The tensors with a row per vocabulary entry (global names, ckpt/names.py).
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def first_padded_column(vocab_size: int, width: int, padded: int, tp_rank: int) -> int:
    """The first padded column of a rank's logits `width` columns wide: its vocab-parallel
    shard (`padded` / tp columns from tp_rank x that), or the whole padded vocabulary when
    gathered. `width` when the shard holds no padding."""
    start = 0 if width == padded else tp_rank * width
    return min(max(vocab_size - start, 0), width)


def mask_padded_logits(logits: torch.Tensor, first_padded: int) -> torch.Tensor:
    """`logits` with columns from `first_padded` on set to the lowest value of its dtype, in
    place (a copy would double the largest activation of the step); autograd passes no
    gradient through the filled columns."""
    if first_padded < logits.shape[-1]:
        logits[..., first_padded:].fill_(torch.finfo(logits.dtype).min)
    return logits


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows` (a vocabulary tensor's padding)."""
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


@functools.cache
def masked_vocab_gpt_model() -> type:
    """GPTModel whose output layer masks its padded columns (a function: megatron.core
    imports at call time). `unpadded_vocab_size` is the recipe's vocabulary; `vocab_size`
    stays Megatron's padded one."""
    from megatron.core.models.gpt import GPTModel

    class MaskedVocabGPTModel(GPTModel):
        def __init__(self, *args: Any, unpadded_vocab_size: int, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.unpadded_vocab_size = unpadded_vocab_size
            if self.post_process:
                _mask_output_layer(self.output_layer, vocab_size=unpadded_vocab_size,
                                   padded=self.vocab_size, tp_rank=self.pg_collection.tp.rank())

    return MaskedVocabGPTModel


def _mask_output_layer(layer, *, vocab_size: int, padded: int, tp_rank: int) -> None:
    """Megatron's output layer (ColumnParallelLinear), made to return masked logits."""
    if vocab_size > padded:
        raise ValueError(f"the vocabulary ({vocab_size}) is larger than the model's {padded} rows")
    plain_forward = layer.forward

    def forward(input_, weight=None, runtime_gather_output=None):
        logits, bias = plain_forward(input_, weight=weight,
                                     runtime_gather_output=runtime_gather_output)
        first = first_padded_column(vocab_size, logits.shape[-1], padded, tp_rank)
        return mask_padded_logits(logits, first), bias

    layer.forward = forward
