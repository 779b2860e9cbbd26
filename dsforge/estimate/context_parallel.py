"""What context parallelism (Ulysses, runtime/assemble/layers.py) sends: one rule for `dsforge
plan`'s line and the step-time model's term (cost/step_time.py)."""

from __future__ import annotations

from dsforge.recipe.resolve import Layout
from dsforge.schema import ModelConfig


def exchange_bytes(m: ModelConfig, lay: Layout, tokens: float, element_bytes: int) -> float:
    """Bytes one rank sends in one layer's forward for one microbatch of `tokens` (its shard):
    the all-to-alls of q, k and v in and of the attention's output back, each over the heads
    the rank holds after tp, keeping 1/cp of them and sending the rest. The backward sends
    their gradients the same way; 0 without cp."""
    if lay.cp == 1:
        return 0.0
    width = (2 * m.num_attention_heads + 2 * m.query_groups) * m.head_dim / lay.tp  # q, out; k, v
    return tokens * width * element_bytes * (lay.cp - 1) / lay.cp


def exchange_passes(checkpointing: str) -> int:
    """How many times a step sends each layer's exchange: forward and backward, and the
    forward's again when full checkpointing recomputes it."""
    return 3 if checkpointing == "full" else 2


def step_exchange_bytes(m: ModelConfig, lay: Layout, seq_len: int, element_bytes: int,
                        checkpointing: str) -> float:
    """Bytes one rank of the busiest pipeline stage sends in a step: every pass of each of its
    layers, for every microbatch of its shard (micro_batch x seq_len / cp tokens)."""
    tokens = lay.micro_batch * seq_len // lay.cp
    return (exchange_bytes(m, lay, tokens, element_bytes) * exchange_passes(checkpointing)
            * lay.grad_accum * m.num_layers / lay.pp)
