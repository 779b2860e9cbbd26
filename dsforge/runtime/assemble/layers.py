"""The modules dsforge plugs into Megatron-Core's local layer spec.

- RMSNorm that works with sequence parallelism: the local spec's torch norm refuses it. The
  weight is marked `sequence_parallel`, so its gradient is summed over the tensor-parallel
  group (each TP rank only saw its slice of the sequence; runtime/assemble/grads.py).
- Core attention on torch's scaled_dot_product_attention: flash/memory-efficient kernels on
  GPU (no s x s matrix), a fused kernel on CPU; causal, with grouped KV heads. With context
  parallelism the same attention between two all-to-alls (Ulysses). With packed documents
  (data.document_masking) the attention stays inside each document: Megatron's
  `attention_mask` argument then carries the document ids (runtime/assemble/documents.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsforge.runtime.assemble import documents as documents_mod
from dsforge.runtime.context_shards import gathered_order


class RMSNorm(nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Megatron's marker: the gradient is summed over the TP group (runtime/assemble/grads.py).
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SDPAttention(nn.Module):
    """Megatron DotProductAttention's interface on F.scaled_dot_product_attention.

    `sdpa_backend` (model.sdpa_backend) restricts torch to one kernel; "auto" leaves the
    choice to torch. Grouped KV heads go to SDPA as they are (`enable_gqa`), not repeated
    into copies of every query head's size, where a kernel takes them so: flash and math (and
    auto, which then picks flash for 16-bit inputs on a GPU); fp32 on a GPU, the memory-efficient
    and the cuDNN kernel get the heads repeated (a grouped fp32 call on a GPU would fall back
    to the math kernel and its s x s matrix)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 sdpa_backend: str = "auto", document_kernel: str = "sdpa-mask"):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backends = sdpa_backends(sdpa_backend)
        self.native_gqa = sdpa_backend in GQA_SDPA_BACKENDS
        self.document_kernel = document_kernel  # documents.DOCUMENT_KERNELS

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        out = self.attend(query, key, value, attention_mask)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def attend(self, query, key, value, documents=None):
        """Causal attention over the whole sequence, [seq, batch, heads, head_dim] in and out;
        with `documents` ([batch, seq] ids), within each document."""
        # Megatron passes [seq, batch, heads, head_dim]; SDPA wants [batch, heads, seq, head_dim].
        # Rotary gave Q and K storage of their own, but V is still a view of the fused QKV
        # projection's output: the kernel would save it for the backward and keep that whole
        # output alive, its Q and K parts too (2 (heads + groups) head_dim bytes a token and
        # layer). V's own copy costs 2 groups head_dim and lets the rest go
        # (tests/unit/test_saved_activations.py).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value.contiguous()))
        grouped = k.shape[1] != q.shape[1]
        # flex attention takes grouped heads as they are; a GPU's masked SDPA kernel does not
        native = (documents is not None and self.document_kernel == "flex") or (
            self.native_gqa and (q.device.type == "cpu" or
                                 (q.dtype != torch.float32 and documents is None)))
        if grouped and not native:  # share each KV head by repeating it
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        if documents is not None and self.document_kernel == "flex":
            out = documents_mod.flex(q, k, v, documents, scale=self.softmax_scale,
                                     enable_gqa=grouped)
        elif documents is not None:
            with self._kernel():
                out = documents_mod.masked_sdpa(q, k, v, documents, scale=self.softmax_scale,
                                                dropout_p=dropout_p, enable_gqa=grouped and native)
        else:
            with self._kernel():
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale, dropout_p=dropout_p,
                    enable_gqa=grouped and native)
        return out.permute(2, 0, 1, 3)

    def _kernel(self):
        return contextlib.nullcontext() if self.backends is None else sdpa_kernel(self.backends)


class UlyssesAttention(SDPAttention):
    """Context-parallel core attention (DeepSpeed-Ulysses): each context-parallel rank holds
    a shard of the sequence with every head; an all-to-all over Megatron's context-parallel
    group gives each rank the whole sequence for heads / cp of them, SDPAttention runs causal
    attention on it, and a second all-to-all gives the shards back
    (deepspeed.sequence.layer.DistributedAttention, Megatron's [seq, batch, heads, dim]).

    The shards are the zigzag chunks of runtime/context_shards.py (rank r holds chunks r and
    2 cp - 1 - r), so the gathered sequence arrives in the ranks' order of chunks; it is put in
    the sequence's own order for the causal mask and back after."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from deepspeed.sequence.layer import DistributedAttention
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
        self.cp = torch.distributed.get_world_size(group)
        self.exchange = DistributedAttention(self._in_order, group, scatter_idx=2, gather_idx=0)
        self._orders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        # batch_dim_idx 1: [seq, batch, heads, dim]; no rotary there (Megatron applied it);
        # the document ids (whole sequences, in order) go through to `_in_order`
        out = self.exchange(query, key, value, 1, None, attention_mask)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _in_order(self, query, key, value, documents=None):
        to_sequence, to_ranks = self._order(query.shape[0], query.device)
        out = self.attend(*(t.index_select(0, to_sequence) for t in (query, key, value)),
                          documents)
        return out.index_select(0, to_ranks)

    def _order(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """gathered_order on `device`, made once per sequence length and device."""
        if (seq_len, device) not in self._orders:
            orders = gathered_order(seq_len, self.cp)
            self._orders[seq_len, device] = tuple(t.to(device) for t in orders)
        return self._orders[seq_len, device]


GQA_SDPA_BACKENDS = ("auto", "flash", "math")


def sdpa_backends(name: str) -> list[SDPBackend] | None:
    """model.sdpa_backend -> the backends torch may use (None: torch's own choice)."""
    return None if name == "auto" else [_SDPA_BACKENDS[name]]


_SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
