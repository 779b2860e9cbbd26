"""The work outside the GEMMs and attention (cost.py `other`): its count, and the refit that
fits it only where runs of different widths tell it from the GEMMs (cost/fit.py)."""

from __future__ import annotations

import dataclasses

import pytest

from dsforge.cost import fit as cal
from dsforge.cost.profile import default_profile
from dsforge.cost.step_time import other_units, step_time
from dsforge.recipe import resolve_file
from tests.conftest import REPO

ONE_B = REPO / "benchmarks" / "gpu" / "recipes" / "1b_1gpu.yaml"
BARE = dataclasses.replace(default_profile("h200", gpus_per_node=1), host_layer_s=0.0,
                           host_layer_zero3_s=0.0)
# A machine whose GEMMs run 20% faster than the profile says, with the rest of a layer's work
# at 1.3e-10 s a token, layer and hidden unit (the H200's, fitted to the GPU kit's runs).
TRUE = {"compute": 0.8, "other": 1.3e-10, "host": 0.003, "host_zero3": 0.008, "fixed": 0.0,
        "gathers": 0.0, "optimizer": 1.0, "communication": 1.0}
# The 1B as shipped and twice as wide (Llama-2 7B's width and MLP), as the GPU kit's H200 runs.
WIDTHS = (("model.hidden_size=2048",), ("model.hidden_size=4096", "model.ffn_hidden_size=14336"))


def _layout(*overrides):
    return resolve_file(ONE_B, list(overrides), world_size=1)


def _points(*layouts) -> list[cal.Point]:
    truth = cal.apply(BARE, TRUE)
    return [cal.Point(" ".join(o), r := _layout(*o), step_time(r, truth).total) for o in layouts]


def test_the_other_work_counts_tokens_hidden_units_and_layers_of_a_step():
    r = _layout("train.micro_batch=2")
    m, lay = r.recipe.model, r.layout
    assert other_units(r) == pytest.approx(lay.grad_accum * 2 * 4096 * m.num_layers * m.hidden_size)
    full = _layout("train.micro_batch=2", "train.activation_checkpointing=full")
    assert 1.3 < other_units(full) / other_units(r) < 4 / 3 + 1e-9  # the forward again, < 1/3 more
    profile = dataclasses.replace(BARE, other_s_per_token_hidden=1e-10)
    t = step_time(r, profile)
    assert t.other == pytest.approx(other_units(r) * 1e-10)
    assert t.total == pytest.approx(step_time(r, BARE).total + t.other)


def test_runs_of_two_widths_tell_the_other_work_from_the_gemms():
    layouts = [(*w, f"train.micro_batch={mb}", *z) for w in WIDTHS for mb in (1, 4)
               for z in ((), ("zero.stage=3",))]
    coefficients = cal.fit(_points(*layouts), BARE, host_floors=True)
    assert coefficients["compute"] == pytest.approx(TRUE["compute"], rel=1e-3)
    assert coefficients["other"] == pytest.approx(TRUE["other"], rel=1e-2)
    assert coefficients["host"] == pytest.approx(TRUE["host"], abs=1e-4)
    assert coefficients["host_zero3"] == pytest.approx(TRUE["host_zero3"], abs=1e-4)


def test_one_width_leaves_the_other_work_as_it_was():
    """Within one model the other work differs from the GEMMs only by their saturation (a few
    percent between micro-batches): not enough to tell the two apart, so compute takes both."""
    layouts = [(*WIDTHS[1], f"train.micro_batch={mb}") for mb in (1, 2, 4, 8)]
    coefficients = cal.fit(_points(*layouts), BARE, host_floors=True)
    assert coefficients["other"] == BARE.other_s_per_token_hidden == 0.0
    kept = cal.fit(_points(*layouts), BARE, host_floors=True, keep=("other",))
    assert kept["other"] == 0.0
