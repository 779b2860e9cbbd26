"""Training FLOPs per token: the one formula dsforge uses for MFU and HFU (docs/flops.md).

model FLOPs per token = 6 * N + 12 * L * s * (heads * head_dim)

  N  active parameters that take part in a matmul: attention Q/K/V/O, the MLP (MoE: the
     top_k routed experts and the router), and the output layer h x V (counted even when
     tied to the embedding, because the projection is still computed). Not counted: the
     embedding lookup (a gather), norms, biases and elementwise ops.
  6  = 2 FLOPs per multiply-add in the forward pass x 3 (backward costs twice the forward).
  12 * L * s * (heads * head_dim): attention scores QK^T and the weighted sum AV, each
     2 * s * heads * head_dim FLOPs per token in the forward pass, x 3 for backward. The full
     s x s score matrix is counted; the causal mask is NOT halved (the PaLM/nanoGPT/torchtitan
     convention; Megatron-LM halves it). Query heads are counted, so GQA does not reduce it.

HFU adds recomputed work: full activation checkpointing re-runs every forward pass
(hardware = 4/3 x model FLOPs); selective recomputes the attention core forward only.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.estimate.params import (count_params, layer_expert_params, layer_matmul_params,
                                     stage_layers)
from dsforge.schema import ModelConfig


@dataclass(frozen=True, kw_only=True)
class FlopsPerToken:
    model: float  # what MFU counts
    hardware: float  # what HFU counts: model + recomputation


def attention_flops_forward(m: ModelConfig, seq_len: int) -> float:
    """QK^T and AV for one token through all layers, forward only, full score matrix."""
    return 4.0 * m.num_layers * seq_len * m.num_attention_heads * m.head_dim


def flops_per_token(m: ModelConfig, seq_len: int, checkpointing: str = "none", *,
                    attention_share: float = 1.0) -> FlopsPerToken:
    """`attention_share`: the share of each sequence's seq x seq score matrix counted (1: all
    of it; attention within packed documents counts each document's own square,
    data/documents.py `attention_share`)."""
    matmul_forward = 2.0 * count_params(m).matmul_active
    attention_forward = attention_flops_forward(m, seq_len) * attention_share
    model = 3.0 * (matmul_forward + attention_forward)
    recompute = {"none": 0.0, "selective": attention_forward,
                 "full": matmul_forward + attention_forward}[checkpointing]
    return FlopsPerToken(model=model, hardware=model + recompute)


def pipeline_rank_flops(m: ModelConfig, seq_len: int, checkpointing: str, *, pp: int, vpp: int,
                        rank: int) -> float:
    """Hardware FLOPs per token on pipeline rank `rank` (all its model chunks, before tensor
    parallelism): its layers (model chunk c holds virtual stage c*pp + rank) and, on the last
    rank, the output layer. The same terms as flops_per_token, so the ranks sum to its
    `hardware` figure. The embedding (a gather) is free, so the last rank is the busiest: it
    runs the h x V projection on top of its share of the layers (Megatron-Core can move
    layers off it, account_for_loss_in_pipeline_split; dsforge splits layers evenly)."""
    layers = stage_layers(m.num_layers, pp, vpp, rank)
    attention = attention_flops_forward(m, seq_len) / m.num_layers  # per layer, forward
    matmul = 2.0 * sum(layer_matmul_params(m, layer) for layer in layers)
    if rank == pp - 1:
        matmul += 2.0 * m.vocab_size * m.hidden_size
    forward = matmul + attention * len(layers)
    recompute = {"none": 0.0, "selective": attention * len(layers), "full": forward}[checkpointing]
    return 3.0 * forward + recompute


def pipeline_rank_expert_flops(m: ModelConfig, checkpointing: str, *, pp: int, vpp: int,
                               rank: int) -> float:
    """The routed experts' share of pipeline_rank_flops (hardware FLOPs per token of rank
    `rank`, counted as it counts them): their forward x 3, and once more where full
    checkpointing recomputes the forward. 0 for a dense model."""
    forward = 2.0 * sum(layer_expert_params(m, layer) for layer in stage_layers(m.num_layers, pp, vpp, rank))
    return 3.0 * forward + (forward if checkpointing == "full" else 0.0)


def mfu(tokens_per_second_per_gpu: float, flops_per_token_: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the peak is unknown (CPU, unknown GPU)."""
    if not peak_flops:
        return None
    return tokens_per_second_per_gpu * flops_per_token_ / peak_flops
