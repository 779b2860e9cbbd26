"""Model presets: published architectures and tiny CPU sizes.

A recipe names one with `model.preset`; fields it also sets explicitly override the preset.
tests/unit/test_presets.py checks each published preset's parameter count against the
published figure (within 1%).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Meta Llama 3 8B: 8.03B parameters.
    "llama3-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                      num_attention_heads=32, num_kv_heads=8, vocab_size=128256,
                      max_seq_len=8192, rotary_base=500000),
    # Meta Llama 3 70B: 70.6B parameters.
    "llama3-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                       num_attention_heads=64, num_kv_heads=8, vocab_size=128256,
                       max_seq_len=8192, rotary_base=500000),
    # Llama 2 7B: 6.74B parameters (the classic "7B" shape, multi-head attention).
    "llama2-7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                      num_attention_heads=32, vocab_size=32000, max_seq_len=4096),
    # Llama 2 13B: 13.0B parameters.
    "llama2-13b": dict(num_layers=40, hidden_size=5120, ffn_hidden_size=13824,
                       num_attention_heads=40, vocab_size=32000, max_seq_len=4096),
    # Mixtral 8x7B: 46.7B parameters, 12.9B active (8 experts, top-2, every layer).
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                         num_attention_heads=32, num_kv_heads=8, vocab_size=32000,
                         max_seq_len=32768, rotary_base=1000000,
                         moe=dict(num_experts=8, top_k=2, ffn_hidden_size=14336, frequency=1)),
    # A small MoE for one to a few nodes: 4.61B parameters, 1.44B active (8 experts, top-2).
    "moe-4b": dict(num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                   num_kv_heads=4, vocab_size=32000, max_seq_len=4096,
                   moe=dict(num_experts=8, top_k=2, ffn_hidden_size=3584, frequency=1)),
    # Tiny sizes for CPU runs and tests; byte-level vocabulary (256).
    "tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                 num_kv_heads=2, vocab_size=256, max_seq_len=256),
    "tiny-moe": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                     num_kv_heads=2, vocab_size=256, max_seq_len=256,
                     moe=dict(num_experts=4, top_k=2, ffn_hidden_size=96, frequency=1)),
}

# Published total (and active) parameter counts the presets must reproduce within 1%.
PUBLISHED_PARAMS: dict[str, tuple[float, float]] = {
    "llama3-8b": (8.03e9, 8.03e9),
    "llama3-70b": (70.6e9, 70.6e9),
    "llama2-7b": (6.74e9, 6.74e9),
    "llama2-13b": (13.0e9, 13.0e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
}


def apply_preset(raw_model: dict[str, Any], preset: str) -> dict[str, Any]:
    """The preset's fields overlaid with the recipe's explicit ones (nested for `moe`)."""
    merged = dict(PRESETS[preset])
    for key, value in raw_model.items():
        if key == "moe" and isinstance(value, dict) and isinstance(merged.get("moe"), dict):
            merged["moe"] = {**merged["moe"], **value}
        else:
            merged[key] = value
    return merged
