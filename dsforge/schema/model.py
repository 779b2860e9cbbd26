"""The `model:` section (docs/recipe.md#model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsforge.problems import Checks
from dsforge.schema.limits import (MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_ROTARY_BASE, MAX_SEQ_LEN,
                                   MAX_VOCAB, MAX_WIDTH, require_at_most, require_positive)
from dsforge.schema.parsing import divisors


# How an MoE layer runs its experts (translate/experts.py says what each means).
MoeExperts = Literal["auto", "sequential", "grouped"]
# Kernels for the work outside the matrix products (translate/kernels.py).
Kernels = Literal["auto", "torch", "liger"]
# torch.nn.attention.SDPBackend to use; auto = torch's own choice.
SdpaBackend = Literal["auto", "flash", "cudnn", "efficient", "math"]
Compile = Literal["none", "layers"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    num_experts: int
    top_k: int = 2
    ffn_hidden_size: int  # per expert
    frequency: int = 1  # every Nth layer is an MoE layer (Megatron moe_layer_freq)
    aux_loss_coeff: float = 0.01  # load-balancing loss weight
    experts: MoeExperts = "auto"  # a loop of per-expert GEMMs, or grouped GEMMs

    def __post_init__(self) -> None:
        c = Checks()
        require_positive(c, "M1", "model.moe", num_experts=self.num_experts,
                         ffn_hidden_size=self.ffn_hidden_size, frequency=self.frequency)
        require_at_most(c, "M1", "model.moe", MAX_EXPERTS, num_experts=self.num_experts)
        require_at_most(c, "M1", "model.moe", MAX_WIDTH, ffn_hidden_size=self.ffn_hidden_size)
        c.require(0 < self.top_k <= self.num_experts, "E2",
                  {"model.moe.top_k": self.top_k, "model.moe.num_experts": self.num_experts},
                  "top_k must be between 1 and num_experts",
                  f"set model.moe.top_k in 1..{max(self.num_experts, 1)}")
        c.require(self.aux_loss_coeff >= 0, "M1", {"model.moe.aux_loss_coeff": self.aux_loss_coeff},
                  "must be >= 0", "use 0 to disable the load-balancing loss")
        c.raise_if_any()


# Megatron pads the vocabulary so every tensor-parallel shard is a multiple of 128 (rule T4).
# The padding is storage only: its rows are zero and masked out of every loss, so the model is
# the same on every tp (runtime/assemble/vocab.py).
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP, rotary embeddings, optional GQA and MoE."""

    preset: str | None = None  # applied by the loader; kept to say where the numbers came from
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int | None = None  # None = num_attention_heads (no GQA)
    kv_channels: int | None = None  # head dim; None = hidden_size / num_attention_heads
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool = False
    bias: bool = False  # bias in linear layers
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    moe: MoEConfig | None = None
    # A Hugging Face Llama (dense) or Mixtral (MoE) folder whose weights the model starts from
    # instead of drawn ones (dsforge/recipe/init_from.py checks it, rules I1-I5); None = drawn.
    init_from: str | None = None
    # RMSNorm, SwiGLU, rotary embedding and the output layer's cross-entropy: torch's plain
    # operations, or Liger Kernel's fused Triton kernels (GPU only); auto picks per device.
    kernels: Kernels = "auto"
    sdpa_backend: SdpaBackend = "auto"  # the attention kernel torch's SDPA may use
    # none: eager; layers: each transformer layer compiled once with torch.compile (regional
    # compilation, runtime/assemble/compile.py; rules CM1-CM5).
    compile: Compile = "none"

    def __post_init__(self) -> None:
        c = Checks()
        require_positive(c, "M1", "model", num_layers=self.num_layers, hidden_size=self.hidden_size,
                         ffn_hidden_size=self.ffn_hidden_size,
                         num_attention_heads=self.num_attention_heads, num_kv_heads=self.num_kv_heads,
                         kv_channels=self.kv_channels, vocab_size=self.vocab_size,
                         max_seq_len=self.max_seq_len, rotary_base=self.rotary_base,
                         norm_epsilon=self.norm_epsilon, init_std=self.init_std)
        require_at_most(c, "M1", "model", MAX_LAYERS, num_layers=self.num_layers)
        require_at_most(c, "M1", "model", MAX_WIDTH, hidden_size=self.hidden_size,
                        ffn_hidden_size=self.ffn_hidden_size, kv_channels=self.kv_channels)
        require_at_most(c, "M1", "model", MAX_HEADS, num_attention_heads=self.num_attention_heads,
                        num_kv_heads=self.num_kv_heads)
        require_at_most(c, "M1", "model", MAX_VOCAB, vocab_size=self.vocab_size)
        require_at_most(c, "M1", "model", MAX_SEQ_LEN, max_seq_len=self.max_seq_len)
        require_at_most(c, "M1", "model", MAX_ROTARY_BASE, rotary_base=self.rotary_base)
        if self.num_kv_heads and self.num_attention_heads > 0:
            c.require(self.num_attention_heads % self.num_kv_heads == 0, "M2",
                      {"model.num_attention_heads": self.num_attention_heads,
                       "model.num_kv_heads": self.num_kv_heads},
                      "num_attention_heads must be a multiple of num_kv_heads (query groups)",
                      "use model.num_kv_heads in {"
                      + ", ".join(map(str, divisors(min(self.num_attention_heads, MAX_HEADS))))
                      + "}")
        if self.kv_channels is None and self.num_attention_heads > 0:
            c.require(self.hidden_size % self.num_attention_heads == 0, "T2",
                      {"model.hidden_size": self.hidden_size,
                       "model.num_attention_heads": self.num_attention_heads},
                      "hidden_size must be divisible by num_attention_heads",
                      "change one of them, or set model.kv_channels (the head dimension)")
        if self.moe is not None:
            c.require(self.moe.frequency <= self.num_layers, "M3",
                      {"model.moe.frequency": self.moe.frequency,
                       "model.num_layers": self.num_layers},
                      "the MoE layer frequency exceeds the number of layers, so only layer 0 "
                      "would be MoE", f"use model.moe.frequency <= {self.num_layers} (1 = every layer)")
            c.require(not (self.moe.experts == "grouped" and self.bias), "E9",
                      {"model.moe.experts": "grouped", "model.bias": True},
                      "grouped experts compute bias-free SwiGLU experts",
                      "use model.moe.experts: sequential (or auto) with biases, or model.bias: false")
        c.raise_if_any()

    @property
    def query_groups(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Megatron's moe_layer_freq=N convention: layer i is MoE when i % N == 0."""
        return self.moe is not None and layer % self.moe.frequency == 0
