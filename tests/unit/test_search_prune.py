"""The search's fast path (search/prune.py, the shared sections of space.py, the memory
estimate's per-shape caches) finds exactly what the full validator finds on every recipe of
the space, and the search prints the same result either way."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from dsforge.cost.profile import default_profile
from dsforge.estimate import memory
from dsforge.problems import RecipeError
from dsforge.recipe.loader import build_recipe
from dsforge.recipe.resolve import resolve
from dsforge.search import search as search_module
from dsforge.search.command import render, result_json
from dsforge.search.prune import shape_refusal, variant_refusal
from dsforge.search.space import (Sections, Space, enumerate_candidates, exhaustive_candidates,
                                  variants)

_DENSE = {"num_layers": 8, "hidden_size": 256, "ffn_hidden_size": 688, "num_attention_heads": 8,
          "vocab_size": 1000, "max_seq_len": 512}
MODELS = {
    "dense": _DENSE,
    "tied": {**_DENSE, "tie_embeddings": True, "ffn_hidden_size": 684},  # L5 with pp > 1; T1 at tp 8
    # 12 heads in 6 query groups: T1 at tp 4 (groups) and 8 (heads); ffn 684 at tp 8
    "odd-heads": {**_DENSE, "num_layers": 6, "hidden_size": 384, "num_attention_heads": 12, "num_kv_heads": 6,
                  "ffn_hidden_size": 684},
    # MoE every other layer: E3 without sequence parallelism, E6 at ZeRO-3, T1 at tp 8 (expert width)
    "moe": {**_DENSE, "num_kv_heads": 4,
            "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 100, "frequency": 2}},
    "short-seq": _DENSE,  # at 200 tokens: T7 where 2 cp does not divide the sequence
}
SEQ_LEN = {"short-seq": 200}
# (model, precision, GPUs, global batch): small batches for L6/L4, fp16 for Z2, and a batch
# over dsforge's limit for some micro-batches (the train section refuses those variants).
CASES = [
    ("dense", "bf16", 8, 8), ("dense", "bf16", 16, 12), ("dense", "fp16", 8, 64),
    ("tied", "bf16", 16, 32), ("odd-heads", "bf16", 8, 6), ("odd-heads", "bf16", 12, 24),
    ("moe", "bf16", 8, 16), ("moe", "bf16", 16, 64), ("dense", "bf16", 3, 2**24),
    ("short-seq", "bf16", 16, 32),
]


def _base(model: str, precision: str):
    return build_recipe({"name": "prune", "model": MODELS[model],
                         "train": {"seq_len": SEQ_LEN.get(model, 256), "steps": 10, "lr": 3e-4,
                                   "precision": precision}})


def _space(gpus: int, batch: int) -> Space:
    # cp searched at these short sequences too, so its rule (T7) is exercised
    return Space(gpus=gpus, gpus_per_node=8, global_batch=batch, gpu="h100", cp_min_seq_len=0)


def _key(candidate) -> tuple:
    return candidate.resolved.recipe, candidate.resolved.layout, candidate.exact_batch


@pytest.mark.parametrize("model,precision,gpus,batch", CASES)
def test_the_fast_path_keeps_exactly_what_the_validator_accepts(model, precision, gpus, batch):
    base, space = _base(model, precision), _space(gpus, batch)
    fast, considered = enumerate_candidates(base, space)
    every, considered_every = exhaustive_candidates(base, space)
    assert considered == considered_every
    assert [_key(c) for c in fast] == [_key(c) for c in every]  # same layouts, same order


def _refusal(base, v) -> str | None:
    m = base.model
    return (shape_refusal(m, base.train.precision, base.train.seq_len, tp=v.tp, cp=v.cp, pp=v.pp,
                          sp=v.sequence_parallel)
            or variant_refusal(m, pp=v.pp, vpp=v.vpp, ep=v.ep, stage=v.stage, microbatches=v.microbatches))


def test_every_cheap_refusal_is_the_validators_and_every_rule_is_exercised():
    """Each layout a cheap condition drops, the full validator refuses with that rule."""
    named = set()
    for model, precision, gpus, batch in CASES:
        base, space = _base(model, precision), _space(gpus, batch)
        sections, topology = Sections(base), space.topology()
        for v in variants(base, space):
            parts, rule = sections.of(v), _refusal(base, v)
            if parts is None or rule is None:
                continue
            named.add(rule)
            with pytest.raises(RecipeError) as refused:
                resolve(dataclasses.replace(base, **parts, cluster=space.cluster()), topology)
            assert rule in {p.rule for p in refused.value.problems if p.severity == "error"}
    assert named == {"L5", "Z2", "T1", "E3", "E6", "L6", "L4", "T7"}


def test_a_section_refused_variant_is_not_considered():
    base, space = _base("dense", "bf16"), _space(3, 2**24)
    sections = Sections(base)
    refused = sum(sections.of(v) is None for v in variants(base, space))
    assert refused > 0
    assert enumerate_candidates(base, space)[1] == sum(1 for _ in variants(base, space)) - refused


def _printed(result) -> tuple[str, str]:
    text = re.sub(r"searched in [0-9.]+ s", "", render(result, 10**6, "prune"))
    data = result_json(result, 10**6)
    data.pop("seconds")
    return text, json.dumps(data, sort_keys=True)


@pytest.mark.parametrize("model,gpus,batch", [("dense", 16, 12), ("moe", 16, 64), ("tied", 8, 32)])
def test_the_search_prints_the_same_with_the_full_validator_alone(model, gpus, batch, monkeypatch):
    base, space, profile = _base(model, "bf16"), _space(gpus, batch), default_profile("h100")
    fast = search_module.search(base, space, profile)
    monkeypatch.setattr(search_module, "enumerate_candidates", exhaustive_candidates)
    assert _printed(fast) == _printed(search_module.search(base, space, profile))
    assert fast.ranked


def test_activations_summed_per_kind_of_layer_are_the_same_float(monkeypatch):
    """activation_bytes computes a layer's bytes once per kind (dense, MoE): the same float as
    computing every layer's, on a model that mixes both, at every rank of every candidate."""
    base, space = _base("moe", "bf16"), _space(16, 64)
    candidates = enumerate_candidates(base, space)[0]
    assert {c.resolved.layout.pp for c in candidates} >= {1, 2, 4}
    states = [(c.resolved.recipe.model, c.resolved.recipe.train, c.resolved.layout, rank)
              for c in candidates for rank in range(c.resolved.layout.pp)]
    once_per_kind = [memory.activation_bytes(*state) for state in states]
    monkeypatch.setattr(memory, "per_kind_of_layer", lambda m, bytes_of: bytes_of)
    assert once_per_kind == [memory.activation_bytes(*state) for state in states]
