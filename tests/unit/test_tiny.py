"""Any recipe's layout at tiny size (recipe/tiny.py) and the loss check (launch/smoke.py)."""

from __future__ import annotations

import json

import pytest

from dsforge.job.run_dir import RunDir
from dsforge.launch.smoke import compare_losses
from dsforge.recipe import RecipeError, resolve_file
from dsforge.recipe.tiny import TINY_STEPS, reference_resolved, tiny_resolved
from dsforge.schema import padded_vocab_size
from tests.conftest import REPO

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))
LAYOUT_FIELDS = ("world_size", "dp", "tp", "pp", "vpp", "ep", "etp", "sequence_parallel", "schedule")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_recipe_keeps_its_layout_at_tiny_size(path):
    full = resolve_file(path)
    tiny = tiny_resolved(full)
    for name in LAYOUT_FIELDS:
        assert getattr(tiny.layout, name) == getattr(full.layout, name), name
    r, f = tiny.recipe, full.recipe
    assert (r.zero, r.train.precision, r.train.activation_checkpointing) == \
           (f.zero, f.train.precision, f.train.activation_checkpointing)
    assert (r.model.moe is None) == (f.model.moe is None)
    if f.model.moe:
        assert (r.model.moe.num_experts, r.model.moe.top_k) == (f.model.moe.num_experts, f.model.moe.top_k)
    assert r.model.hidden_size <= 128 and r.model.num_layers == full.layout.pp * full.layout.vpp
    assert r.train.steps == TINY_STEPS and r.train.seq_len <= 64
    # the same padded vocabulary on one rank, so the reference is the same model
    assert padded_vocab_size(r.model.vocab_size, 1) == padded_vocab_size(r.model.vocab_size, tiny.layout.tp)


def test_the_70b_pipeline_layout_at_tiny_size():
    tiny = tiny_resolved(resolve_file(REPO / "recipes" / "70b_pp4.yaml"))
    lay = tiny.layout
    assert (lay.world_size, lay.tp, lay.pp, lay.vpp, lay.dp) == (32, 4, 4, 5, 2)
    assert lay.grad_accum == 4 and tiny.recipe.model.num_layers == 20
    assert tiny.recipe.data.source == "synthetic"


def test_set_fields_win_over_shrinking():
    path = REPO / "recipes" / "70b_pp4.yaml"
    overrides = ("train.steps=7", "train.precision=fp32")
    tiny = tiny_resolved(resolve_file(path, overrides), overrides)
    assert tiny.recipe.train.steps == 7 and tiny.recipe.train.precision == "fp32"


def test_a_set_data_path_keeps_meaning_the_recipes_directory(tmp_path, monkeypatch):
    """--set data.source=../data/tempest (a study's `set:` too) is relative to the recipe's
    directory, as at full size; given again after shrinking it meant the working directory's
    (every shipped CPU study's cells were rejected under --tiny, rule D7)."""
    monkeypatch.chdir(tmp_path)
    overrides = ("data.source=../data/tempest", "model.vocab_size=257", "train.steps=6")
    tiny = tiny_resolved(resolve_file(REPO / "recipes" / "tiny.yaml", overrides), overrides)
    assert tiny.recipe.data.source == str(REPO / "data" / "tempest")
    assert tiny.recipe.train.steps == 6  # the other fields still win over shrinking


def test_tiny_runs_what_cpu_ranks_run_and_its_own_steps():
    """The recipe's GPU kernels and attention backend become auto (rule K1 on CPU ranks), and
    its profiler steps, which the 4-step tiny run may not have (R4), are dropped."""
    path = REPO / "recipes" / "7b_1gpu.yaml"
    overrides = ("model.kernels=liger", "model.sdpa_backend=cudnn", 'tracking.profile="10:12"')
    tiny = tiny_resolved(resolve_file(path, overrides))
    m = tiny.recipe.model
    assert (m.kernels, m.sdpa_backend, tiny.recipe.tracking.profile) == ("auto", "auto", None)


def test_a_set_batch_field_lets_the_others_follow():
    path = REPO / "recipes" / "13b_8gpu_zero3.yaml"
    overrides = ("train.global_batch=64",)
    tiny = tiny_resolved(resolve_file(path, overrides), overrides)
    lay = tiny.layout
    assert (lay.global_batch, lay.micro_batch, lay.grad_accum, lay.dp) == (64, 1, 8, 8)


def test_a_set_field_that_breaks_the_tiny_layout_is_reported():
    path = REPO / "recipes" / "70b_pp4.yaml"
    with pytest.raises(RecipeError) as caught:
        tiny_resolved(resolve_file(path), ("model.num_layers=6",))
    assert "L2" in {p.rule for p in caught.value.problems}


def test_reference_is_one_rank_with_the_same_global_batch():
    tiny = tiny_resolved(resolve_file(REPO / "recipes" / "70b_pp4.yaml"))
    ref = reference_resolved(tiny)
    lay = ref.layout
    assert (lay.world_size, lay.tp, lay.pp, lay.dp) == (1, 1, 1, 1)
    assert lay.global_batch == tiny.layout.global_batch and ref.recipe.model == tiny.recipe.model


def _metrics(path, losses) -> RunDir:
    run_dir = RunDir(path)
    run_dir.path.mkdir()
    run_dir.metrics.write_text(
        "".join(json.dumps({"step": i, "loss": loss}) + "\n" for i, loss in enumerate(losses)))
    return run_dir


def test_loss_comparison(tmp_path):
    run = _metrics(tmp_path / "run", [5.5, 5.4, 5.3])
    same = _metrics(tmp_path / "same", [5.5, 5.4000001, 5.3])
    other = _metrics(tmp_path / "other", [6.2, 6.1, 6.0])
    assert compare_losses(run, same, "fp32").ok
    bad = compare_losses(run, other, "fp32")
    assert not bad.ok and "DOES NOT match" in bad.describe()
    assert not compare_losses(run, RunDir(tmp_path / "missing"), "bf16").ok


def test_a_loss_that_was_not_finite_equals_only_another(tmp_path):
    """metrics.jsonl writes null for a skipped step's NaN loss (train.on_nonfinite: skip): the
    same skipped step on both sides matches, one side's alone does not."""
    run = _metrics(tmp_path / "run", [5.5, None, 5.3])
    same = _metrics(tmp_path / "same", [5.5, None, 5.3])
    finite = _metrics(tmp_path / "finite", [5.5, 5.4, 5.3])
    assert compare_losses(run, same, "fp32").ok
    assert not compare_losses(run, finite, "fp32").ok
