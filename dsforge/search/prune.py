"""Cheap necessary conditions for a candidate layout to pass the validator.

Most of a search's space is refused by a handful of rules (L6 at 512 GPUs, L5 for tied
embeddings, E3 and E6 for MoE models), and the full validator is dear for a refused recipe:
it runs every rule twice and builds the fix suggestions. Each condition here mirrors a rule
of dsforge/recipe/validate.py that refuses the layout whatever the rest of the recipe says,
so a layout it names would be refused anyway; the search skips the resolver for it and still
counts it as considered. Whatever passes goes through the full validator, which has the last
word. tests/unit/test_search_prune.py holds that the search with these conditions keeps
exactly the layouts the validator accepts.
"""

from __future__ import annotations

from dsforge.recipe.fixes import microbatch_rule
from dsforge.schema import ModelConfig


def shape_refusal(m: ModelConfig, precision: str, seq_len: int, *, tp: int, cp: int, pp: int,
                  sp: bool) -> str | None:
    """The rule that refuses every variant of a model-parallel shape, or None."""
    if cp > 1 and (refused := _context_parallel_refusal(m, seq_len, tp=tp, cp=cp)):
        return refused
    if m.tie_embeddings and pp > 1:
        return "L5"
    if precision == "fp16" and pp > 1:
        return "Z2"
    if m.num_attention_heads % tp or m.ffn_hidden_size % tp:
        return "T1"
    groups = m.num_kv_heads
    if groups is not None and groups % tp and tp % groups:
        return "T1"
    if m.moe is not None:
        if m.moe.ffn_hidden_size % tp:  # the search leaves etp unset: expert tp = tp
            return "T1"
        if tp > 1 and not sp:
            return "E3"
    return None


def _context_parallel_refusal(m: ModelConfig, seq_len: int, *, tp: int, cp: int) -> str | None:
    """T7: 2 cp chunks of the sequence; the heads and KV heads a tensor-parallel rank holds
    divide by cp."""
    if seq_len % (2 * cp):
        return "T7"
    for heads in (m.num_attention_heads, m.query_groups):
        if heads % tp == 0 and (heads // tp) % cp:
            return "T7"
    return None


def variant_refusal(m: ModelConfig, *, pp: int, vpp: int, ep: int, stage: int,
                    microbatches: int) -> str | None:
    """The rule that refuses this ZeRO stage and number of microbatches per step, or None."""
    if m.moe is not None and ep > 1 and stage == 3:
        return "E6"
    return microbatch_rule(pp, vpp, microbatches)  # L6: fewer microbatches than stages; L4
