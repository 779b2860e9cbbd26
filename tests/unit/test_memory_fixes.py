"""The changes predicted to make a recipe fit after an out-of-memory (estimate/memory_fixes.py):
each valid, each under the limit, the global batch kept, and exactly what its --set
overrides give when applied to the recipe."""

from __future__ import annotations

import pytest

from dsforge.estimate.memory_fixes import HEADROOM, estimate, fit_limit, memory_fixes, zero_at_stage
from dsforge.recipe import resolve_file
from dsforge.schema import ZeroConfig
from tests.conftest import REPO

GiB = 2**30
# recipes/7b_1gpu.yaml at ZeRO-3 without checkpointing at micro-batch 2: 135.7 GiB, more than
# an H200 holds (../shared/reference/gpu-h200-2026-11-26).
SEVEN_B = str(REPO / "recipes" / "7b_1gpu.yaml")
NO_CHECKPOINTING = ["zero.stage=3", "train.activation_checkpointing=none", "train.micro_batch=2",
                    "train.grad_accum=4", "train.global_batch=8"]  # the batch of 2026-11-26


def _applied(path: str, overrides: list[str], fix) -> float:
    """The fix's --set overrides applied to the recipe as a user would: its predicted peak."""
    items = [word for word in fix.overrides().split() if word != "--set"]
    resolved = resolve_file(path, overrides + items)
    assert resolved.layout.global_batch == resolve_file(path, overrides).layout.global_batch
    return estimate(resolved).total


def test_the_7b_without_checkpointing_on_an_h200():
    resolved = resolve_file(SEVEN_B, NO_CHECKPOINTING)
    assert round(estimate(resolved).total / GiB, 1) == 135.7
    limit = fit_limit(capacity=140.4 * GiB, predicted=estimate(resolved).total, needed=135 * GiB)
    fixes = memory_fixes(resolved, limit)
    # selective checkpointing saves nothing with fused attention, so it is no fix, and
    # combinations that hold a fix already are not shown
    assert [f.overrides() for f in fixes] == [
        "--set train.micro_batch=1 --set train.grad_accum=8",
        "--set train.activation_checkpointing=full"]
    for fix in fixes:
        assert fix.predicted <= limit and _applied(SEVEN_B, NO_CHECKPOINTING, fix) == fix.predicted


def test_a_higher_zero_stage_and_combinations_when_nothing_alone_fits():
    path = str(REPO / "recipes" / "13b_8gpu_zero3.yaml")
    at_stage_1 = ["zero.stage=1", "train.activation_checkpointing=none"]
    resolved = resolve_file(path, at_stage_1)
    assert round(estimate(resolved).total / GiB, 1) == 119.4
    fixes = memory_fixes(resolved, 100 * GiB)
    assert fixes[0].overrides() == "--set zero.stage=2"  # one lever, the most memory left in use
    assert all(fix.levers == 1 for fix in fixes)
    tight = memory_fixes(resolved, 60 * GiB, shown=20)
    assert tight and min(fix.levers for fix in tight) == 2  # no single change gets under 60 GiB
    for fix in tight:
        assert _applied(path, at_stage_1, fix) == fix.predicted <= 60 * GiB
        assert not any(set(other.changes) < set(fix.changes) for other in tight)
    assert memory_fixes(resolved, 30 * GiB) == []


def test_nothing_fits_and_the_recipe_itself_is_never_a_fix():
    resolved = resolve_file(SEVEN_B, NO_CHECKPOINTING)
    assert memory_fixes(resolved, 10 * GiB) == []
    # with room for the recipe as it is, only changes are listed, never the recipe unchanged
    assert all(fix.changes for fix in memory_fixes(resolved, 1000 * GiB, shown=100))


def test_the_limit_keeps_the_searchs_headroom_and_what_the_model_missed():
    assert fit_limit(capacity=100.0, predicted=80.0, needed=70.0) == pytest.approx(100 * (1 - HEADROOM))
    assert fit_limit(capacity=100.0, predicted=80.0, needed=85.0) == pytest.approx(90.0 - 5.0)


def test_zero_options_carried_to_another_stage():
    offloaded = ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu", offload_ratio=0.5)
    assert zero_at_stage(offloaded, 1) == ZeroConfig(stage=1, offload_optimizer="cpu")
    assert zero_at_stage(ZeroConfig(stage=1, offload_optimizer="cpu"), 3) == \
        ZeroConfig(stage=3, offload_optimizer="cpu")
