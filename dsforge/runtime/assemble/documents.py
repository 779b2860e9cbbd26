"""Attention that stays inside each document of a packed sequence, and rotary positions that
restart at each document (data.document_masking, data.reset_position_ids).

The document ids of a microbatch (dsforge/data/documents.py: [batch, seq], in sequence order)
reach every layer's core attention as Megatron's `attention_mask` argument, which Megatron
passes through its layers (and their recompute) untouched. A query attends to a key when both
are in the same document and the key is not after it. Two kernels (translate/kernels.py
`document_attention` chooses, with the reason, for plan and manifest):
- "sdpa-mask": torch's scaled_dot_product_attention with the dense mask, [batch, 1, seq,
  seq] in the attention's dtype, made once per microbatch and shared by the layers: exact on
  any device, its cost the whole causal attention's (and seq^2 elements of mask);
- "flex": flex attention with a block mask made from the ids once per microbatch: blocks no
  document reaches are skipped, so its cost follows the documents' lengths. Compiled (GPUs).

Megatron's RoPE ignores `position_ids` (it rotates by 0..seq-1, sliced for context
parallelism). `rotary_from_position_ids` makes a model's rotary embedding rotate each token by
its own position id, which the data loader has already cut to this context-parallel rank's
shard, so the frequencies come out [seq, batch, 1, dim], which Megatron's rotation broadcasts.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F

DOCUMENT_KERNELS = ("sdpa-mask", "flex")


def dense_mask(documents: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] bool: same document and not in the future."""
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


def masked_sdpa(q, k, v, documents: torch.Tensor, *, scale, dropout_p: float,
                enable_gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_dense_bias(documents, q.dtype),
                                          scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa)


def flex(q, k, v, documents: torch.Tensor, *, scale, enable_gqa: bool) -> torch.Tensor:
    """Flex attention over the block mask of `documents`."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = _compiled(flex_attention) if q.device.type == "cuda" else flex_attention
    return attend(q, k, v, block_mask=_block_mask(documents), scale=scale,
                  enable_gqa=enable_gqa)


@functools.cache
def _compiled(function):
    return torch.compile(function, dynamic=False)


# Each mask is made once per microbatch: every layer, and the backward's recompute, get the
# same tensor of ids. (id(ids), what) -> (weak reference to the ids, the mask); an entry goes
# with its ids. A mask must not hold the ids tensor itself, or neither would ever go.
_MASKS: dict[tuple[int, Any], tuple[weakref.ref, Any]] = {}


def _per_microbatch(documents: torch.Tensor, what: Any, make: Callable[[], Any]) -> Any:
    key = (id(documents), what)
    found = _MASKS.get(key)
    if found is not None and found[0]() is documents:
        return found[1]
    mask = make()
    _MASKS[key] = (weakref.ref(documents, lambda _: _MASKS.pop(key, None)), mask)
    return mask


def _dense_bias(documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense mask as SDPA's additive mask in the attention's dtype: SDPA takes it as it is,
    so the layers share one [batch, 1, seq, seq] tensor (a boolean one each layer's SDPA
    would convert, and keep the copy for its backward)."""
    def make() -> torch.Tensor:
        allowed = dense_mask(documents)
        return torch.zeros(allowed.shape, dtype=dtype, device=documents.device).masked_fill_(
            ~allowed, float("-inf"))
    return _per_microbatch(documents, dtype, make)


def _block_mask(documents: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    def make():
        ids = documents.detach().clone()  # the mask keeps its own copy (see _MASKS)

        def same_document(b, h, q_index, kv_index):
            return (ids[b, q_index] == ids[b, kv_index]) & (q_index >= kv_index)

        # compiled on a GPU: eager, it evaluates the mask over the whole seq x seq grid (1 GiB
        # a sequence at 32k) before reducing it to blocks
        batch, seq = ids.shape
        return create_block_mask(same_document, batch, None, seq, seq, device=ids.device,
                                 _compile=ids.is_cuda)
    return _per_microbatch(documents, "flex", make)


def rotary_from_position_ids(model_class: type) -> type:
    """`model_class` (a GPTModel) whose rotary embedding rotates each token by its position
    id: the model's forward hands the ids to the embedding for the length of the call."""
    class PositionIdsRotaryModel(model_class):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            _rotate_by_ids(self.rotary_pos_emb)

        def forward(self, input_ids, position_ids, attention_mask, *args: Any, **kwargs: Any):
            self.rotary_pos_emb.position_ids = position_ids
            try:
                return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
            finally:
                self.rotary_pos_emb.position_ids = None

    return PositionIdsRotaryModel


def _rotate_by_ids(rope) -> None:
    """Megatron's RotaryEmbedding made to return, while `position_ids` is set, the rotation of
    each token [seq, batch, 1, dim] by its id, as its own `get_emb` builds one by position
    (interpolation factor, interleaved layout)."""
    plain_forward = rope.forward
    rope.position_ids = None

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        ids = rope.position_ids
        if ids is None:
            return plain_forward(max_seq_len, offset, packed_seq, cp_group)
        inv_freq = rope.inv_freq.to(ids.device)
        seq = ids.t().to(inv_freq.dtype) + offset  # [seq, batch]
        if rope.seq_len_interpolation_factor is not None:
            seq = seq / rope.seq_len_interpolation_factor
        freqs = seq[..., None] * inv_freq  # [seq, batch, dim / 2]
        if rope.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, :, None, :]

    rope.forward = forward
