"""Every shipped recipe validates at its declared size (litgpt's config-hub pattern)."""

from __future__ import annotations

import pytest

from dsforge.estimate.memory import estimate_memory
from dsforge.hardware import gpu_by_key
from dsforge.recipe import load_recipe, resolve_file
from tests.conftest import RECIPES

REQUIRED = {"70b_pp4", "tiny", "tiny_moe", "tiny_pp"}


def test_required_recipes_are_shipped():
    assert REQUIRED <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates_at_its_declared_size(path):
    resolved = resolve_file(path)
    assert not resolved.warnings, resolved.warnings
    recipe = resolved.recipe
    assert recipe.name == path.stem
    assert path.read_text().startswith("#"), "each recipe starts with a comment saying what it shows"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_gpu_recipes_fit_their_gpu(path):
    recipe = load_recipe(path)
    if recipe.cluster is None or recipe.cluster.gpu is None:
        pytest.skip("CPU recipe")
    resolved = resolve_file(path)
    r = resolved.recipe
    est = estimate_memory(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout)
    assert est.total <= gpu_by_key(recipe.cluster.gpu).memory_bytes


def test_70b_pp4_is_the_issue_layout():
    resolved = resolve_file(next(p for p in RECIPES if p.stem == "70b_pp4"))
    recipe, layout = resolved.recipe, resolved.layout
    assert (layout.tp, layout.pp, layout.dp, layout.vpp) == (4, 4, 2, 5)
    assert recipe.model.num_layers // layout.pp == 20
