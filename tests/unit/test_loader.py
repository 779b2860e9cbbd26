"""Strict loading: safe YAML, duplicate and unknown keys, types, overrides, presets."""

from __future__ import annotations

import pytest

from dsforge.recipe.loader import load_recipe, parse_overrides
from dsforge.problems import RecipeError
from tests.conftest import REPO, make_recipe, rule_ids

GOOD = """
name: demo
model: {preset: tiny}
train: {seq_len: 64, global_batch: 8, steps: 10, lr: 3e-4}
"""


def test_loads_the_issue_example_with_every_field():
    recipe = load_recipe(REPO / "recipes" / "70b_pp4.yaml")
    assert recipe.model.num_layers == 80 and recipe.model.num_kv_heads == 8
    assert recipe.parallel.vpp == 5 and recipe.parallel.dp == -1
    assert recipe.zero.stage == 1 and recipe.train.lr == pytest.approx(3e-4)
    assert recipe.cluster.gpu == "h200" and recipe.schedule == "interleaved"


def test_float_written_without_a_dot_is_accepted_for_float_fields(recipe_file):
    recipe = load_recipe(recipe_file(GOOD))  # PyYAML reads 3e-4 as the string "3e-4"
    assert isinstance(recipe.train.lr, float) and recipe.train.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("field, value, expected", [
    ("train.global_batch", '"8"', "expected an integer"),
    ("train.global_batch", "8.5", "expected an integer"),
    ("parallel.tp", "true", "expected an integer"),
    ("train.lr", "fast", "expected a number"),
    ("train.lr", ".nan", "expected a number"),
    ("model.tie_embeddings", "1", "expected true or false"),
    ("name", "7", "expected a string"),
])
def test_wrong_types_are_rejected_with_the_field_and_value(field, value, expected):
    with pytest.raises(RecipeError) as info:
        make_recipe(f"{field}={value}")
    (problem,) = info.value.problems
    assert problem.rule == "Y2" and field in problem.fields and expected in problem.message


def test_duplicate_keys_are_all_reported_with_lines(recipe_file):
    text = GOOD + "train: {seq_len: 32}\nmodel: {preset: tiny}\n"
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe_file(text))
    assert rule_ids(info.value) == {"Y1"} and len(info.value.problems) == 2
    assert "line 5 (first at line 4)" in str(info.value)
    assert "line 6 (first at line 3)" in str(info.value)


def test_nested_duplicate_key_is_rejected(recipe_file):
    text = GOOD.replace("train: {seq_len: 64,", "train: {seq_len: 64, seq_len: 32,")
    with pytest.raises(RecipeError, match=r"\[Y1\] key='seq_len'"):
        load_recipe(recipe_file(text))


@pytest.mark.parametrize("override, where, suggestion", [
    ("train.micro_bach=2", "train.micro_bach", "micro_batch"),
    ("parallel.sequence_paralel=true", "parallel.sequence_paralel", "sequence_parallel"),
    ("trian.steps=3", "trian", "train"),
    ("model.moe.top_kk=1", "model.moe.top_kk", "top_k"),
])
def test_unknown_keys_at_every_level_get_a_suggestion(override, where, suggestion):
    overrides = [override]
    if override.startswith("model.moe"):
        overrides = ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=32", override]
    with pytest.raises(RecipeError) as info:
        make_recipe(*overrides)
    problem = next(p for p in info.value.problems if p.rule == "Z6")
    assert where in problem.fields and f'Did you mean "{suggestion}"' in problem.fix


def test_bad_choice_names_the_choices_and_the_closest():
    with pytest.raises(RecipeError) as info:
        make_recipe("train.activation_checkpointing=ful")
    (problem,) = info.value.problems
    assert problem.rule == "Y3" and "none, selective, full" in problem.message
    assert 'Did you mean "full"' in problem.fix


def test_problems_from_all_sections_are_reported_together():
    with pytest.raises(RecipeError) as info:
        make_recipe("train.micro_bach=2", "zero.stage=5", "parallel.tp=0", "train.lr=-1",
                    "cluster.gpu=h1000", "cluster.gpus_per_node=4")
    assert {"Z6", "Z1", "P3", "R1", "C2"} <= rule_ids(info.value)


def test_required_field_missing():
    base = {"name": "t", "model": {"preset": "tiny"}, "train": {"seq_len": 64, "lr": 1e-3}}
    with pytest.raises(RecipeError) as info:
        make_recipe(base=base)
    assert rule_ids(info.value) == {"Y5"} and "train.steps" in str(info.value)


def test_overrides_are_typed_like_yaml_and_create_sections():
    recipe = make_recipe("train.micro_batch=2", "train.lr=5e-4", "model.moe.num_experts=4",
                         "model.moe.ffn_hidden_size=32", "cluster.gpus_per_node=2")
    assert recipe.train.micro_batch == 2 and recipe.train.lr == pytest.approx(5e-4)
    assert recipe.model.moe.num_experts == 4 and recipe.model.moe.top_k == 2
    assert recipe.cluster.gpus_per_node == 2 and recipe.cluster.nodes == 1


@pytest.mark.parametrize("bad", ["train.micro_batch", "=3", "train..x=1", "train.x y=1"])
def test_malformed_override_is_rejected(bad):
    with pytest.raises(RecipeError, match="section.field=value"):
        parse_overrides([bad])


def test_override_through_a_scalar_is_rejected():
    with pytest.raises(RecipeError, match="train.steps is not a section"):
        make_recipe("train.steps.x=1")


def test_preset_fields_are_overridden_by_explicit_ones():
    recipe = make_recipe("model.preset=mixtral-8x7b", "model.num_layers=2", "model.moe.top_k=1")
    assert recipe.model.num_layers == 2 and recipe.model.hidden_size == 4096
    assert recipe.model.moe.top_k == 1 and recipe.model.moe.num_experts == 8


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(RecipeError) as info:
        make_recipe("model.preset=llama3-7b")
    problem = next(p for p in info.value.problems if p.rule == "M4")
    assert "Did you mean" in problem.fix


def test_missing_file_invalid_yaml_and_non_mapping(tmp_path, recipe_file):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(recipe_file("model: [unclosed\n"))
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_recipe(recipe_file("- a\n- b\n"))


def test_unsafe_yaml_tags_are_refused(recipe_file):
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(recipe_file("name: !!python/object/apply:os.system ['true']\n"))


def test_name_defaults_to_the_file_stem(recipe_file):
    recipe = load_recipe(recipe_file(GOOD.replace("name: demo\n", ""), name="my_job.yaml"))
    assert recipe.name == "my_job"
