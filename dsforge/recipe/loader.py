"""Strict recipe loading: YAML file -> overrides -> preset -> typed, frozen Recipe.

Strict means: a safe YAML loader; duplicate keys are an error (PyYAML keeps the last one
silently); unknown keys are an error at every level, with a did-you-mean; every field is
type-checked, and numbers PyYAML leaves as strings (`3e-4` is a string in YAML 1.1) are
converted only where the field is a float. Every problem is collected before raising.
Documents are bounded: UTF-8 text of at most 1 MiB holding at most 10,000 values with every
alias expanded, so no input turns into a traceback, a hang or a gigabyte error message.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Hashable, Iterable, Literal, Union

import yaml

from dsforge.data.tokenizers import BYTES as BYTES_TOKENIZER
from dsforge.problems import Problem, RecipeError, did_you_mean, read_text, shorten
from dsforge.recipe.presets import PRESETS, apply_preset
from dsforge.schema import SYNTHETIC, Recipe, name_problems

_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Read, override and build a recipe; raises RecipeError with every problem found."""
    path = Path(path)
    raw = apply_overrides(read_yaml(path), parse_overrides(overrides))
    if "name" in raw:
        recipe = build_recipe(raw)
    else:
        recipe = _named_after_file(raw, path)
    return _with_data_relative_to(recipe, path.parent)


def _named_after_file(raw: dict[str, Any], path: Path) -> Recipe:
    """A recipe that writes no name: is named after its file; a file name that is no valid
    recipe name is reported as such (the user wrote no name: to fix)."""
    try:
        return build_recipe({**raw, "name": path.stem})
    except RecipeError as exc:
        raise RecipeError([
            dataclasses.replace(p, fields={"recipe": str(path)},
                                message=f"the recipe writes no name:, so it is named after its "
                                        f"file, {shorten(path.stem)}, which {p.message}",
                                fix=f"add a name: line ({p.fix}), or rename the file")
            if p.rule == "N1" else p for p in exc.problems]) from None


def _with_data_relative_to(recipe: Recipe, directory: Path) -> Recipe:
    """Relative data paths (source, each blend path, tokenizer, cache_dir) and
    model.init_from mean relative to the recipe's own directory, so a recipe runs the same
    from any working directory."""
    def absolute(path: str | None) -> str | None:
        if path is None or path in (SYNTHETIC, BYTES_TOKENIZER) or Path(path).is_absolute():
            return path
        return str((directory / path).resolve())

    d = recipe.data
    source = (absolute(d.source) if isinstance(d.source, str) else
              tuple(dataclasses.replace(part, path=absolute(part.path)) for part in d.source))
    data = dataclasses.replace(d, source=source, tokenizer=absolute(d.tokenizer),
                               cache_dir=absolute(d.cache_dir))
    model = dataclasses.replace(recipe.model, init_from=absolute(recipe.model.init_from))
    return dataclasses.replace(recipe, data=data, model=model)


def dump_recipe(recipe: Recipe) -> str:
    """YAML that load_recipe reads back into an equal Recipe (every field explicit)."""
    return yaml.safe_dump(_lists(dataclasses.asdict(recipe)), sort_keys=False)


def _lists(value: Any) -> Any:
    """asdict's tuples (a blend) as YAML lists: safe_dump writes no tuples."""
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(item) for item in value]
    return value


MAX_YAML_BYTES = 1 << 20  # a recipe or study is a few KB: read_text's default limit
MAX_YAML_NODES = 10_000  # values in the document with every alias expanded
_EXAMPLES = {"recipe": "recipes/smoke.yaml", "study": "recipes/bench/zero_study_cpu.yaml"}


def read_yaml(path: Path, what: str = "recipe") -> dict[str, Any]:
    """The mapping in the YAML file at `path` (a recipe, study or profile: `what`); a missing
    file, a directory, an unreadable or non-UTF-8 file and bad YAML are RecipeErrors (Y6)."""
    text = read_text(path, what, rule="Y6", example=_EXAMPLES.get(what, f"{what}.yaml"))
    return parse_yaml(text, source=str(path), what=what)


def parse_yaml(text: str, source: str = "<string>", what: str = "recipe") -> dict[str, Any]:
    """Parse a YAML mapping with a safe loader that reports every duplicate key (rule Y1) and
    refuses documents whose aliases expand to more than MAX_YAML_NODES values (Y6)."""
    try:
        data = load_yaml_value(text)
    except _YamlFailure as exc:
        raise RecipeError([Problem(rule="Y6", fields={what: source}, message=exc.message,
                                   fix=exc.fix)]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError([Problem(rule="Y6", fields={what: source},
                                   message=f"a {what} must be a YAML mapping of sections",
                                   fix="start with keys such as name:, model:, train:"
                                       if what == "recipe" else "see the shipped examples")])
    return data


class _YamlFailure(Exception):
    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


def load_yaml_value(text: str) -> Any:
    """The value of one YAML document; _YamlFailure says why there is none, RecipeError
    lists duplicate keys (Y1)."""
    if len(text) > MAX_YAML_BYTES:
        raise _YamlFailure(f"longer than {MAX_YAML_BYTES} characters", "write a shorter document")
    loader = None
    try:
        loader = _StrictLoader(text)  # its reader refuses unprintable characters
        node = loader.get_single_node()
        if node is not None:
            _check_expanded_size(node)
            data = loader.construct_document(node)
        else:
            data = None
    except yaml.YAMLError as exc:
        raise _YamlFailure(f"not valid YAML: {exc}", "fix the YAML syntax at the line shown") from None
    except RecursionError:
        raise _YamlFailure("nested too deeply", "write a recipe of sections and fields") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise _YamlFailure(f"a value cannot be read: {exc}".split("; use sys.")[0],
                           "write plain numbers, strings and mappings") from None
    finally:
        if loader is not None:
            loader.dispose()
    if loader.duplicates:
        raise RecipeError(loader.duplicates)
    return data


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand to more than MAX_YAML_NODES values (a few lines
    of anchors can stand for gigabytes: every later copy, message or dump would expand them)
    or refer to themselves."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _YamlFailure("an alias refers to the value that contains it",
                               "write the value out instead of the alias")
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise _YamlFailure(f"holds more than {MAX_YAML_NODES} values (an alias, *name, "
                                   "counts as all the values it repeats)",
                                   "write only the sections and fields the documentation lists")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


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
            if not isinstance(key, Hashable):
                continue  # the base constructor reports it as a YAML error
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
            parsed.append((key, load_yaml_value(f"v: {text}")["v"]))
        except _YamlFailure as exc:
            syntax = exc.message.startswith("not valid YAML")
            problems.append(Problem(rule="Y6", fields={"--set": item},
                                    message=f"the value after '=': {exc.message}",
                                    fix="quote it as YAML, e.g. --set 'name=\"my run\"'"
                                        if syntax else exc.fix))
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
    if recipe is None and isinstance(raw.get("name"), str) and not any(p.rule == "N1" for p in problems):
        problems.extend(name_problems(raw["name"]))  # also when a section failed to build
    if any(p.rule == "M4" for p in problems):  # the preset's fields are missing because of it
        problems = [p for p in problems if not (p.rule == "Y5" and _in_model(p))]
    if problems:
        raise RecipeError(problems)
    return recipe


def _in_model(problem: Problem) -> bool:
    return any(str(name).startswith("model.") for name in problem.fields)


def _with_preset(raw_model: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    preset = raw_model.get("preset")
    if preset is None:
        return raw_model
    if not isinstance(preset, str) or preset not in PRESETS:
        problems.append(Problem(rule="M4", fields={"model.preset": preset},
                                message="unknown model preset",
                                fix=f"use one of {', '.join(PRESETS)}."
                                    f"{did_you_mean(_word(preset), PRESETS)}"))
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
        problems.extend(_numbered(problem, path) for problem in exc.problems)
        return None


def _numbered(problem: Problem, path: str) -> Problem:
    """A list item's own rules name their fields generically (data.source[].weight); say which
    item: data.source[1].weight."""
    generic = re.sub(r"\[\d+\]", "[]", path)
    if generic == path:
        return problem
    fields = {(path + key[len(generic):] if key.startswith(generic) else key): value
              for key, value in problem.fields.items()}
    return dataclasses.replace(problem, fields=fields)


def _coerce(value: Any, tp: Any, where: str, problems: list[Problem]) -> Any:
    """`value` checked (and, for floats written as strings, converted) against type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        tp = _union_option(value, [a for a in typing.get_args(tp) if a is not type(None)])
        origin = typing.get_origin(tp)
    if origin is tuple:  # tuple[X, ...]: a YAML list of X
        if not isinstance(value, (list, tuple)):
            problems.append(Problem(rule="Y2", fields={where: value}, message="expected a list",
                                    fix="see the documented example"))
            return value
        item = typing.get_args(tp)[0]
        return tuple(_coerce(v, item, f"{where}[{i}]", problems) for i, v in enumerate(value))
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
    elif checked is _NOT_FINITE:
        problems.append(Problem(rule="Y2", fields={where: value},
                                message="NaN and infinities are not allowed (nor numbers beyond "
                                        "a float's range)", fix=_TYPE_FIXES[tp]))
    elif checked is _OUT_OF_RANGE:
        problems.append(Problem(rule="Y2", fields={where: value},
                                message="integer out of range: -2**63 <= value < 2**63",
                                fix=_TYPE_FIXES[tp]))
    return checked


def _union_option(value: Any, options: list[Any]) -> Any:
    """The option of a union type a written value means: a list for a tuple option (a blend),
    a choice among a Literal option's, a scalar option of the value's own type (int | str: 3600
    or "1h"), else the first option (str | tuple[...] reads a string as the string)."""
    if isinstance(value, (list, tuple)):
        for option in options:
            if typing.get_origin(option) is tuple:
                return option
    for option in options:  # int | Literal["auto"]: "auto" is the choice
        if typing.get_origin(option) is Literal and value in typing.get_args(option):
            return option
    return next((option for option in options if option is type(value)), options[0])


_INVALID, _NOT_FINITE, _OUT_OF_RANGE = object(), object(), object()
_INT64 = 1 << 63  # torch, numpy and DeepSpeed's JSON readers take 64-bit integers
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
        if not isinstance(value, int):
            return _INVALID
        return value if -_INT64 <= value < _INT64 else _OUT_OF_RANGE
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        if not isinstance(value, (int, float)):
            return _INVALID
        try:
            value = float(value)
        except OverflowError:  # an integer beyond a float's range
            return _NOT_FINITE
        return value if math.isfinite(value) else _NOT_FINITE
    if tp is str:
        return value if isinstance(value, str) else _INVALID
    raise TypeError(f"unsupported recipe field type {tp!r}")


def _coerce_choice(value: Any, choices: tuple, where: str, problems: list[Problem]) -> Any:
    if isinstance(value, str) and value in choices:
        return value
    problems.append(Problem(rule="Y3", fields={where: value},
                            message=f"must be one of {', '.join(map(str, choices))}",
                            fix=f"pick one of {', '.join(map(str, choices))}."
                                f"{did_you_mean(_word(value), choices)}"))
    return value


def _word(value: Any) -> str:
    """A value to look for a close choice to: short strings as they are (no quotes)."""
    return value if isinstance(value, str) and len(value) <= 100 else shorten(value)
