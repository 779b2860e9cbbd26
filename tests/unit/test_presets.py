"""Presets reproduce the published parameter counts within 1%."""

from __future__ import annotations

import pytest

from dsforge.estimate.params import count_params
from dsforge.recipe.presets import PRESETS, PUBLISHED_PARAMS
from tests.conftest import make_recipe


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts_within_one_percent(preset):
    model = make_recipe(f"model.preset={preset}", "train.seq_len=64").model
    counts = count_params(model)
    total, active = PUBLISHED_PARAMS[preset]
    assert counts.total == pytest.approx(total, rel=0.01)
    assert counts.active == pytest.approx(active, rel=0.01)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds(preset):
    model = make_recipe(f"model.preset={preset}", "train.seq_len=64").model
    assert count_params(model).total > 0


def test_required_presets_exist():
    assert {"llama3-8b", "llama3-70b", "llama2-7b", "llama2-13b", "mixtral-8x7b", "tiny",
            "tiny-moe"} <= set(PRESETS)


def test_hand_counted_tiny_model():
    # h=64, 4 layers, ffn 176, 4 heads of 16, 2 KV heads, vocab 256, untied.
    h, ffn, kv = 64, 176, 2 * 16
    attention = h * h + 2 * h * kv + h * h
    layer = attention + 3 * h * ffn + 2 * h
    expected = 4 * layer + 256 * h * 2 + h
    assert count_params(make_recipe().model).total == expected
