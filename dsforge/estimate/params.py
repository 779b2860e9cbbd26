"""Parameter counts of the Llama-style GPT/MoE model, whole and per GPU.

Layer anatomy (Megatron-Core local/TE spec with RMSNorm, SwiGLU, rotary embeddings):
  attention: Q (h x heads*d), K and V (h x groups*d each), output projection (heads*d x h)
  MLP:       fc1 h x 2*ffn (gate and up, SwiGLU), fc2 ffn x h  -> 3*h*ffn
  MoE layer: router h x experts, then `experts` copies of the MLP with the expert width
  norms:     one RMSNorm weight (h) before attention and one before the MLP; one final norm
  embedding: vocab x h; output layer vocab x h unless tied to the embedding
Biases (model.bias) add the output width of each linear layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.schema import ModelConfig


def attention_params(m: ModelConfig, with_bias: bool = True) -> int:
    q_width, kv_width = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim
    weights = m.hidden_size * (q_width + 2 * kv_width) + q_width * m.hidden_size
    biases = (q_width + 2 * kv_width + m.hidden_size) if m.bias and with_bias else 0
    return weights + biases


def mlp_params(m: ModelConfig, ffn: int, with_bias: bool = True) -> int:
    """One SwiGLU MLP of width `ffn`: fc1 produces gate and up (2*ffn), fc2 projects back."""
    return 3 * m.hidden_size * ffn + ((2 * ffn + m.hidden_size) if m.bias and with_bias else 0)


def router_params(m: ModelConfig) -> int:
    return m.hidden_size * m.moe.num_experts if m.moe else 0


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    total: int
    active: int  # used per token: MoE layers count top_k experts
    embedding: int  # input embedding table
    output: int  # output layer (0 when tied to the embedding)
    matmul_active: int  # active parameters that take part in matmuls (the 6N of FLOPs)


def layer_matmul_params(m: ModelConfig, layer: int) -> int:
    """Parameters of one layer that take part in a matmul for each token (its share of the
    6N of FLOPs): attention, and the MLP or the router and the top_k routed experts."""
    attention = attention_params(m, with_bias=False)
    if m.is_moe_layer(layer):
        return attention + router_params(m) + layer_expert_params(m, layer)
    return attention + mlp_params(m, m.ffn_hidden_size, with_bias=False)


def layer_expert_params(m: ModelConfig, layer: int) -> int:
    """The routed experts' share of layer_matmul_params: the top_k experts' MLPs a token
    goes through in an MoE layer (0 in a dense one)."""
    if not m.is_moe_layer(layer):
        return 0
    return m.moe.top_k * mlp_params(m, m.moe.ffn_hidden_size, with_bias=False)


def count_params(m: ModelConfig, vocab_size: int | None = None) -> ParamCounts:
    """Counts for the whole model; `vocab_size` overrides the model's (e.g. the padded one)."""
    vocab = vocab_size or m.vocab_size
    h, norms = m.hidden_size, 2 * m.hidden_size
    attention = attention_params(m)
    total = active = matmul = 0
    for layer in range(m.num_layers):
        matmul += layer_matmul_params(m, layer)
        if m.is_moe_layer(layer):
            expert = mlp_params(m, m.moe.ffn_hidden_size)
            total += attention + router_params(m) + m.moe.num_experts * expert + norms
            active += attention + router_params(m) + m.moe.top_k * expert + norms
        else:
            dense = attention + mlp_params(m, m.ffn_hidden_size) + norms
            total, active = total + dense, active + dense
    embedding = vocab * h
    output = 0 if m.tie_embeddings else vocab * h
    final_norm = h
    # The output projection is a matmul whether or not its weight is shared with the embedding.
    return ParamCounts(total=total + embedding + output + final_norm,
                       active=active + embedding + output + final_norm,
                       embedding=embedding, output=output, matmul_active=matmul + vocab * h)


def stage_layers(num_layers: int, pp: int, vpp: int, rank: int) -> list[int]:
    """Layer indices on pipeline rank `rank`: model chunk c holds global chunk c*pp + rank."""
    per_chunk = num_layers // (pp * vpp)
    return [layer for chunk in range(vpp)
            for layer in range((chunk * pp + rank) * per_chunk, (chunk * pp + rank + 1) * per_chunk)]
