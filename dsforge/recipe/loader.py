"""Strict recipe loading: YAML file -> overrides -> preset -> typed, frozen Recipe.

Strict means: a safe YAML loader; duplicate keys are an error (PyYAML keeps the last one
silently); unknown keys are an error at every level, with a did-you-mean; every field is
type-checked, and numbers PyYAML leaves as strings (`3e-4` is a string in YAML 1.1) are
converted only where the field is a float. Every problem is collected before raising.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Union

import yaml

from dsforge.recipe.presets import PRESETS, apply_preset
from dsforge.problems import Problem, RecipeError, did_you_mean
from dsforge.recipe.schema import Recipe

_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Read, override and build a recipe; raises RecipeError with every problem found."""
    path = Path(path)
    raw = read_yaml(path)
    raw.setdefault("name", path.stem)
    recipe = build_recipe(apply_overrides(raw, parse_overrides(overrides)))
    return _with_data_relative_to(recipe, path.parent)


def _with_data_relative_to(recipe: Recipe, directory: Path) -> Recipe:
    """A relative token-file path means relative to the recipe's own directory, so a recipe
    runs the same from any working directory."""
    source = recipe.data.source
    if source == "synthetic" or Path(source).is_absolute():
        return recipe
    data = dataclasses.replace(recipe.data, source=str((directory / source).resolve()))
    return dataclasses.replace(recipe, data=data)


def dump_recipe(recipe: Recipe) -> str:
    """YAML that load_recipe reads back into an equal Recipe (every field explicit)."""
    return yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False)


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RecipeError([Problem(rule="Y6", fields={"recipe": str(path)},
                                   message="recipe file not found",
                                   fix="check the path, e.g. recipes/smoke.yaml")])
    return parse_yaml(path.read_text(), source=str(path))


def parse_yaml(text: str, source: str = "<string>") -> dict[str, Any]:
    """Parse YAML with a safe loader that reports every duplicate key (rule Y1)."""
    loader = _StrictLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise RecipeError([Problem(rule="Y6", fields={"recipe": source},
                                   message=f"not valid YAML: {exc}",
                                   fix="fix the YAML syntax at the line shown")]) from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise RecipeError(loader.duplicates)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError([Problem(rule="Y6", fields={"recipe": source},
                                   message="a recipe must be a YAML mapping of sections",
                                   fix="start with keys such as name:, model:, train:")])
    return data


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream: str):
        super().__init__(stream)
        self.duplicates: list[Problem] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges are allowed to be overridden by explicit keys
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                self.duplicates.append(Problem(
                    rule="Y1", fields={"key": key},
                    message=f"duplicate key at line {line} (first at line {first_line[key]}); "
                            "YAML would silently keep only the last value",
                    fix="keep one of them"))
            else:
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _StrictLoader.construct_mapping)


def parse_overrides(items: Iterable[str]) -> list[tuple[str, Any]]:
    """`section.field=value` strings; values are read as YAML, so typed like the file."""
    parsed, problems = [], []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not _OVERRIDE_KEY.match(key):
            problems.append(Problem(rule="Y6", fields={"--set": item},
                                    message="an override must look like section.field=value",
                                    fix="e.g. --set train.micro_batch=2"))
            continue
        try:
            parsed.append((key, parse_yaml(f"v: {text}")["v"]))
        except RecipeError as exc:
            problems.extend(exc.problems)
    if problems:
        raise RecipeError(problems)
    return parsed


def apply_overrides(raw: dict[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of `raw` with each dotted key set; missing or null sections are created."""
    result = copy.deepcopy(raw)
    for key, value in overrides:
        *parents, leaf = key.split(".")
        node = result
        for i, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                where = ".".join(parents[: i + 1])
                raise RecipeError([Problem(rule="Y2", fields={"--set": key},
                                           message=f"{where} is not a section",
                                           fix=f"set {where} itself, e.g. --set {where}=...")])
            node = node[part]
        node[leaf] = value
    return result


def build_recipe(raw: dict[str, Any]) -> Recipe:
    """Typed construction of every section; raises RecipeError with all problems."""
    problems: list[Problem] = []
    raw = dict(raw)
    if isinstance(raw.get("model"), dict):
        raw["model"] = _with_preset(raw["model"], problems)
    recipe = _build(Recipe, raw, "", problems)
    if problems:
        raise RecipeError(problems)
    return recipe


def _with_preset(raw_model: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    preset = raw_model.get("preset")
    if preset is None:
        return raw_model
    if preset not in PRESETS:
        problems.append(Problem(rule="M4", fields={"model.preset": preset},
                                message="unknown model preset",
                                fix=f"use one of {', '.join(PRESETS)}.{did_you_mean(str(preset), PRESETS)}"))
        return {k: v for k, v in raw_model.items() if k != "preset"}
    return apply_preset(raw_model, preset)


def build_dataclass(cls: type, raw: Any) -> Any:
    """Strictly build any dsforge config dataclass from a parsed mapping (RecipeError if not)."""
    problems: list[Problem] = []
    result = _build(cls, raw, "", problems)
    if problems:
        raise RecipeError(problems)
    return result


def _build(cls: type, raw: Any, path: str, problems: list[Problem]) -> Any:
    """Build dataclass `cls` from a mapping, appending every problem found to `problems`."""
    label = path or "recipe"
    if not isinstance(raw, dict):
        problems.append(Problem(rule="Y2", fields={label: raw}, message="must be a mapping",
                                fix=f"write {label} as a block of key: value lines"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            problems.append(Problem(rule="Z6", fields={where: raw[key]}, message="unknown key",
                                    fix=f"remove it.{did_you_mean(str(key), fields)} "
                                        f"Known keys here: {', '.join(fields)}"))
    # Unknown keys do not stop the section's own rules from running: all problems at once.
    before = len(problems)
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], where, problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(Problem(rule="Y5", fields={where: None}, message="required field missing",
                                    fix=f"add {name}: to {label}"))
    if len(problems) > before:
        return None
    try:
        return cls(**kwargs)
    except RecipeError as exc:
        problems.extend(exc.problems)
        return None


def _coerce(value: Any, tp: Any, where: str, problems: list[Problem]) -> Any:
    """`value` checked (and, for floats written as strings, converted) against type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        tp, origin = options[0], typing.get_origin(options[0])
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, problems)
    if origin is Literal:
        return _coerce_choice(value, typing.get_args(tp), where, problems)
    if origin in (dict, list):
        if isinstance(value, origin) and (origin is list or all(isinstance(k, str) for k in value)):
            return value
        problems.append(Problem(rule="Y2", fields={where: value},
                                message=f"expected a {'mapping' if origin is dict else 'list'}",
                                fix="see the documented example"))
        return value
    checked = _coerce_scalar(value, tp)
    if checked is _INVALID:
        problems.append(Problem(rule="Y2", fields={where: value},
                                message=f"expected {_TYPE_WORDS[tp]}, got {type(value).__name__}",
                                fix=_TYPE_FIXES[tp]))
    return checked


_INVALID = object()
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_TYPE_FIXES = {int: "write a whole number such as 8", float: "write a number such as 3.0e-4",
               bool: "write true or false", str: "quote the value"}
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _coerce_scalar(value: Any, tp: type) -> Any:
    if tp is bool:
        return value if isinstance(value, bool) else _INVALID
    if isinstance(value, bool):
        return _INVALID  # bool is an int subclass: `tp: true` must not mean tp=1
    if tp is int:
        return value if isinstance(value, int) else _INVALID
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
        return _INVALID
    if tp is str:
        return value if isinstance(value, str) else _INVALID
    raise TypeError(f"unsupported recipe field type {tp!r}")


def _coerce_choice(value: Any, choices: tuple, where: str, problems: list[Problem]) -> Any:
    if isinstance(value, str) and value in choices:
        return value
    problems.append(Problem(rule="Y3", fields={where: value},
                            message=f"must be one of {', '.join(map(str, choices))}",
                            fix=f"pick one of {', '.join(map(str, choices))}."
                                f"{did_you_mean(str(value), choices)}"))
    return value
