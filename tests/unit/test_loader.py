"""Strict loading: safe YAML, duplicate and unknown keys, types, overrides, presets."""

from __future__ import annotations

import json
import time

import pytest

from dsforge.recipe.loader import build_recipe, load_recipe, parse_overrides, read_yaml
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
    ("train.lr", ".nan", "NaN and infinities are not allowed"),
    ("train.lr", "-.inf", "NaN and infinities are not allowed"),
    ("train.lr", "1e999", "NaN and infinities are not allowed"),
    ("train.lr", "1" + "0" * 400, "NaN and infinities are not allowed"),
    ("train.steps", str(2**63), "integer out of range"),
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
    # The preset's own fields, missing only because of it, are not errors of their own.
    with pytest.raises(RecipeError) as info:
        build_recipe({"name": "x", "model": {"preset": "llama3-8x"},
                      "train": {"seq_len": 128, "steps": 10, "lr": 1e-3}})
    assert rule_ids(info.value) == {"M4"}


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


def test_a_non_utf8_recipe_names_the_file_the_byte_and_the_line(recipe_file):
    path = recipe_file("")
    path.write_bytes(b"name: demo\nmodel: {preset: tiny}  # caf\xe9\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    (problem,) = info.value.problems
    assert problem.rule == "Y6" and problem.fields == {"recipe": str(path)}
    assert "not UTF-8 text (byte 0xe9 on line 2)" in problem.message


def test_a_directory_is_called_a_directory(tmp_path):
    with pytest.raises(RecipeError, match="is a directory, not a recipe file"):
        load_recipe(tmp_path)


def test_a_study_file_is_named_as_a_study(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(RecipeError) as info:
        read_yaml(path, what="study")
    assert info.value.problems[0].fields == {"study": str(path)}


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands(recipe_file):
    """Ten lines that stand for 10**10 values: the old loader accepted them and the unknown-key
    message printed them all."""
    start = time.monotonic()
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe_file(GOOD + _alias_bomb()))
    assert time.monotonic() - start < 5
    (problem,) = info.value.problems
    assert problem.rule == "Y6" and "holds more than 10000 values" in problem.message
    assert len(str(info.value)) < 500


def test_anchors_and_merge_keys_within_the_limit_still_load(recipe_file):
    text = ("name: demo\nmodel: &m {preset: tiny}\n"
            "train:\n  <<: {seq_len: 64, steps: 10, lr: 3e-4}\n  global_batch: 8\n"
            "cluster: {gpus_per_node: 8}\n")
    recipe = load_recipe(recipe_file(text))
    assert recipe.train.steps == 10 and recipe.train.global_batch == 8


@pytest.mark.parametrize("text, message", [
    ("a: &a [*a]\n", "refers to the value that contains it"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("a: 1" + "0" * 5000 + "\n", "integer string conversion"),
    ("? [a, b]\n: 1\n", "not valid YAML"),
    ("name: \"a\\0b\"\x00\n", "not valid YAML"),
], ids=["recursive-alias", "deep-nesting", "5000-digit-int", "list-key", "nul-character"])
def test_yaml_that_python_cannot_hold_is_a_y6_error(recipe_file, text, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe_file(text))
    (problem,) = info.value.problems
    assert problem.rule == "Y6" and message in problem.message


def test_a_bad_set_value_names_the_set_item():
    with pytest.raises(RecipeError) as info:
        parse_overrides(["name=foo: bar"])
    (problem,) = info.value.problems
    assert problem.fields == {"--set": "name=foo: bar"} and "not valid YAML" in problem.message
    assert "<string>" not in str(problem)


def test_a_preset_that_is_not_a_word_is_an_unknown_preset():
    with pytest.raises(RecipeError) as info:
        make_recipe("model.preset=[1, 2]")
    assert "M4" in rule_ids(info.value)


@pytest.mark.parametrize("name", ["../../x", "a/b", ".hidden", "-rf", "a b", "a\0b", "x" * 101,
                                  "x" * 300, ""])
def test_a_recipe_name_must_be_a_plain_file_name(name):
    with pytest.raises(RecipeError) as info:
        make_recipe(f"name={json.dumps(name)}")
    (problem,) = info.value.problems
    assert problem.rule == "N1" and problem.fields == {"name": name}
    assert "use e.g. name: " in problem.fix and len(str(problem)) < 900


@pytest.mark.parametrize("name", ["tiny", "7b_1gpu", "a.b-c_d", "x" * 100])
def test_plain_names_are_accepted(name):
    assert make_recipe(f"name={name}").name == name


def test_a_bad_name_is_reported_with_the_other_problems():
    with pytest.raises(RecipeError) as info:
        make_recipe("name=../x", "train.lr=fast")
    assert rule_ids(info.value) == {"N1", "Y2"}


def test_a_file_name_that_is_no_recipe_name_names_the_file(recipe_file):
    path = recipe_file(GOOD.replace("name: demo\n", ""), name="my recipe.yaml")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    (problem,) = info.value.problems
    assert problem.rule == "N1" and problem.fields == {"recipe": str(path)}
    assert "writes no name:" in problem.message and "name: my_recipe" in problem.fix


def test_values_in_problems_are_shortened():
    with pytest.raises(RecipeError) as info:
        make_recipe("train.lr=" + json.dumps([list(range(1000))] * 5))
    assert len(str(info.value)) < 300
