"""dsforge global tensors <-> Hugging Face Llama / Mixtral tensors (pure; shapes and slicing).

dsforge's global names are those of a single-process (tp1, pp1, ep1) model
(runtime/assemble/init.py:_global_name); a checkpoint reader gives each one as a full tensor. The map
(derivation: docs/design/checkpoints-plan.md sections 3-4; table: docs/export.md):
- linear_qkv holds, per query group g, [the q heads of g; k_g; v_g] (Megatron's
  SelfAttention.get_query_key_value_tensors): viewed as [groups, heads per group + 2, head_dim,
  ...], q_proj is [:, :heads per group], k_proj [:, -2], v_proj [:, -1]. Query head
  g * (heads per group) + i uses KV head g in both, and both rotate halves (Megatron's
  rotary_interleaved is False), so no permutation is needed.
- linear_fc1 is [gate; up] (Megatron's glu chunks x in two, silu(first) * second).
- The embedding and output rows >= model.vocab_size are Megatron's padding: dropped on the way
  out, zeros on the way in.
- Mixtral is written with the hub's names (block_sparse_moe.gate, experts.E.w1/w3/w2), which
  transformers 4 reads as they are and transformers 5 converts on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping

import torch

from dsforge.schema import ModelConfig, MoEConfig

Part = Literal["whole", "vocab", "q", "k", "v", "gate", "up"]
LLAMA, MIXTRAL = "llama", "mixtral"


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor: its name and shape, the dsforge tensor it comes from and which
    part of that tensor it is."""

    hf_name: str
    shape: tuple[int, ...]
    source: str
    part: Part


def model_config(recipe: Mapping[str, Any]) -> ModelConfig:
    """The model section of a saved recipe (dataclasses.asdict form) as dsforge's own type."""
    fields = dict(recipe["model"])
    if fields.get("moe") is not None:
        fields["moe"] = MoEConfig(**fields["moe"])
    return ModelConfig(**fields)


def architecture(model: ModelConfig) -> str:
    return LLAMA if model.moe is None else MIXTRAL


def pieces(model: ModelConfig, padded_vocab: int) -> list[Piece]:
    """Every Hugging Face tensor of `model`, in the order they are written: the q, k and v of a
    layer (and its gate and up) are neighbours, so each dsforge tensor is read once."""
    h, v = model.hidden_size, model.vocab_size
    out = [Piece("model.embed_tokens.weight", (v, h), "embedding.word_embeddings.weight", "vocab")]
    for i in range(model.num_layers):
        out += _layer(model, i)
    out.append(Piece("model.norm.weight", (h,), "decoder.final_layernorm.weight", "whole"))
    if not model.tie_embeddings:
        out.append(Piece("lm_head.weight", (v, h), "output_layer.weight", "vocab"))
    return out


def _layer(model: ModelConfig, i: int) -> list[Piece]:
    h, d = model.hidden_size, model.head_dim
    nq, ng = model.num_attention_heads, model.query_groups
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    qkv, attn = src + "self_attention.linear_qkv", dst + "self_attn."
    out = [Piece(dst + "input_layernorm.weight", (h,), src + "input_layernorm.weight", "whole")]
    heads = (("q", nq), ("k", ng), ("v", ng))
    out += [Piece(f"{attn}{part}_proj.weight", (n * d, h), qkv + ".weight", part) for part, n in heads]
    if model.bias:
        out += [Piece(f"{attn}{part}_proj.bias", (n * d,), qkv + ".bias", part) for part, n in heads]
    proj = src + "self_attention.linear_proj"
    out.append(Piece(attn + "o_proj.weight", (h, nq * d), proj + ".weight", "whole"))
    if model.bias:
        out.append(Piece(attn + "o_proj.bias", (h,), proj + ".bias", "whole"))
    out.append(Piece(dst + "post_attention_layernorm.weight", (h,),
                     src + "pre_mlp_layernorm.weight", "whole"))
    if model.moe is None:
        return out + _mlp(src + "mlp.", dst + "mlp.", model.ffn_hidden_size, h, model.bias,
                          ("gate_proj", "up_proj", "down_proj"))
    moe, dst_moe = model.moe, dst + "block_sparse_moe."
    out.append(Piece(dst_moe + "gate.weight", (moe.num_experts, h), src + "mlp.router.weight",
                     "whole"))
    for e in range(moe.num_experts):
        out += _mlp(f"{src}mlp.experts.local_experts.{e}.", f"{dst_moe}experts.{e}.",
                    moe.ffn_hidden_size, h, False, ("w1", "w3", "w2"))
    return out


def _mlp(src: str, dst: str, ffn: int, h: int, bias: bool, names: tuple[str, str, str]) -> list[Piece]:
    gate, up, down = names
    out = [Piece(f"{dst}{gate}.weight", (ffn, h), src + "linear_fc1.weight", "gate"),
           Piece(f"{dst}{up}.weight", (ffn, h), src + "linear_fc1.weight", "up")]
    if bias:
        out += [Piece(f"{dst}{gate}.bias", (ffn,), src + "linear_fc1.bias", "gate"),
                Piece(f"{dst}{up}.bias", (ffn,), src + "linear_fc1.bias", "up")]
    out.append(Piece(f"{dst}{down}.weight", (h, ffn), src + "linear_fc2.weight", "whole"))
    if bias:
        out.append(Piece(f"{dst}{down}.bias", (h,), src + "linear_fc2.bias", "whole"))
    return out


def global_shapes(model: ModelConfig, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every dsforge global tensor the map reads, with its full shape (vocab tensors padded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for piece in pieces(model, padded_vocab):
        shapes[piece.source] = _source_shape(model, piece, padded_vocab, shapes.get(piece.source))
    return shapes


def _source_shape(model: ModelConfig, piece: Piece, padded_vocab: int,
                  seen: tuple[int, ...] | None) -> tuple[int, ...]:
    first, rest = piece.shape[0], piece.shape[1:]
    if piece.part == "vocab":
        return (padded_vocab, *rest)
    if piece.part in ("q", "k", "v"):
        return ((model.num_attention_heads + 2 * model.query_groups) * model.head_dim, *rest)
    if piece.part in ("gate", "up"):
        return (2 * first, *rest)
    return piece.shape if seen is None else seen


def take(model: ModelConfig, piece: Piece, full: torch.Tensor) -> torch.Tensor:
    """The part of dsforge tensor `full` that is Hugging Face tensor `piece` (a view where
    slicing allows one)."""
    if piece.part == "whole":
        return full
    if piece.part == "vocab":
        return full[:model.vocab_size]
    if piece.part in ("gate", "up"):
        half = full.shape[0] // 2
        return full[:half] if piece.part == "gate" else full[half:]
    q, k, v = _split_qkv(model, full)
    return {"q": q, "k": k, "v": v}[piece.part]


def _split_qkv(model: ModelConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ng, d = model.query_groups, model.head_dim
    per_group = model.num_attention_heads // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, per_group + 2, d, *rest)
    return (grouped[:, :per_group].reshape(ng * per_group * d, *rest),
            grouped[:, per_group].reshape(ng * d, *rest),
            grouped[:, per_group + 1].reshape(ng * d, *rest))


def _join_qkv(model: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ng, d = model.query_groups, model.head_dim
    per_group, rest = model.num_attention_heads // ng, q.shape[1:]
    grouped = torch.cat([q.reshape(ng, per_group, d, *rest), k.reshape(ng, 1, d, *rest),
                         v.reshape(ng, 1, d, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def to_hf(model: ModelConfig, padded_vocab: int,
          full: Callable[[str], torch.Tensor]) -> Iterator[tuple[Piece, torch.Tensor]]:
    """Each Hugging Face tensor in `pieces` order, from `full(global_name)`. Only the dsforge
    tensor in use is held (neighbouring pieces share it), so the peak is the largest tensor.
    A tensor whose shape is not the model's raises ValueError (a checkpoint of another model)."""
    shapes = global_shapes(model, padded_vocab)
    name, tensor = None, None
    for piece in pieces(model, padded_vocab):
        if piece.source != name:
            name, tensor = piece.source, None  # let the previous tensor go before reading
            tensor = full(name)
            if tuple(tensor.shape) != shapes[name]:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, but the recipe's model "
                                 f"needs {shapes[name]}")
        yield piece, take(model, piece, tensor)


def from_hf(model: ModelConfig, padded_vocab: int,
            hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dsforge global tensors from Hugging Face tensors named as `pieces` names them (padding
    rows of the vocabulary tensors are zeros). KeyError names a missing tensor; ValueError a
    tensor of the wrong shape."""
    return {name: global_tensor(model, padded_vocab, parts, hf)
            for name, parts in by_source(model, padded_vocab).items()}


def by_source(model: ModelConfig, padded_vocab: int) -> dict[str, list[Piece]]:
    """The Hugging Face pieces of each dsforge global tensor."""
    out: dict[str, list[Piece]] = {}
    for piece in pieces(model, padded_vocab):
        out.setdefault(piece.source, []).append(piece)
    return out


def global_tensor(model: ModelConfig, padded_vocab: int, parts: list[Piece],
                  hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One dsforge global tensor from its pieces (`by_source`), `hf` holding at least those."""
    tensors: dict[str, torch.Tensor] = {}
    for piece in parts:
        tensor = hf[piece.hf_name]
        if tuple(tensor.shape) != piece.shape:
            raise ValueError(f"{piece.hf_name} has shape {tuple(tensor.shape)}, but the recipe's "
                             f"model needs {piece.shape}")
        tensors[piece.part] = tensor
    return _assemble(model, padded_vocab, tensors)


def _assemble(model: ModelConfig, padded_vocab: int, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    if "whole" in parts:
        return parts["whole"].clone()
    if "vocab" in parts:
        rows = parts["vocab"]
        padded = rows.new_zeros((padded_vocab, *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        return padded
    if "gate" in parts:
        return torch.cat([parts["gate"], parts["up"]], dim=0)
    return _join_qkv(model, parts["q"], parts["k"], parts["v"])
