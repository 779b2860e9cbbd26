"""A benchmark study: a base recipe, a world, axes to sweep, and how to measure each cell.

```yaml
name: zero_study_cpu
recipe: ../tiny.yaml            # relative to the study file
world_size: 2                   # or hostfile: ...
set: {parallel.dp: -1}          # overrides applied to every cell (dp: what the world leaves)
axes:                           # the cartesian product is the set of cells
  zero.stage: [0, 1, 2, 3]
  schedule: [none, 1f1b, interleaved:2]    # pipeline schedule; needs pipeline_stages
pipeline_stages: 2              # pp of the 1f1b / interleaved cells
measure: {warmup_steps: 2, steps: 5, repeats: 2, timeout_s: 300}
```
Any recipe field can be an axis by its dotted name; `schedule` is the one special axis.

A cell's identity (`Cell.key`) is a hash of its overrides and of the study's base: the base
recipe as loaded with the study's `set` (every field explicit), the world and the device
(`study_identity`). Editing the base recipe or the world gives every cell a new key, so results
measured for the old recipe are kept but no longer count as finished.

`check_study` finds what would make every cell invalid (a base recipe that does not load, an
axis or `set` field the recipe does not have, an axis value of the wrong type) so that `dsforge
bench` refuses the study before any cell runs; what only some axis combinations break is a
`rejected` cell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dsforge.problems import Checks, Problem, RecipeError
from dsforge.recipe.loader import build_dataclass, dump_recipe, load_recipe, read_yaml

# Rules of the strict loader (docs/validation.md): a field's name, type or choice, the YAML
# itself. They depend on one field at a time, so an axis value that breaks one breaks every
# cell it is in; the section and cross-section rules can depend on the other axes.
LOADER_RULES = frozenset({"Y1", "Y2", "Y3", "Y5", "Y6", "Z6", "M4"})


@dataclass(frozen=True, kw_only=True)
class Measure:
    warmup_steps: int = 2  # left out of every figure
    steps: int = 5  # measured steps per repeat
    repeats: int = 1
    timeout_s: float = 600.0  # wall-clock limit per cell and repeat
    step_timeout_s: float = 120.0  # a step slower than this is a hang

    def __post_init__(self) -> None:
        c = Checks()
        for name in ("steps", "repeats", "timeout_s", "step_timeout_s"):
            c.require(getattr(self, name) > 0, "S1", {f"measure.{name}": getattr(self, name)},
                      "must be > 0", f"set measure.{name} to a positive value")
        c.require(self.warmup_steps >= 0, "S1", {"measure.warmup_steps": self.warmup_steps},
                  "must be >= 0", "use 0 or more")
        c.raise_if_any()


@dataclass(frozen=True, kw_only=True)
class Study:
    name: str
    recipe: str
    world_size: int | None = None
    hostfile: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    set: dict[str, Any] = field(default_factory=dict)
    axes: dict[str, list] = field(default_factory=dict)
    pipeline_stages: int | None = None
    measure: Measure = Measure()
    peak_tflops: float | None = None  # overrides the GPU table's peak in the report

    def __post_init__(self) -> None:
        c = Checks()
        c.require(bool(self.axes), "S2", {"axes": self.axes}, "a study needs at least one axis",
                  "add e.g. axes: {zero.stage: [0, 1, 2, 3]}")
        for name, values in self.axes.items():
            c.require(isinstance(values, list) and len(values) > 0, "S2", {f"axes.{name}": values},
                      "an axis is a non-empty list of values", f"e.g. {name}: [1, 2]")
        for value in self.axes.get("schedule", []):
            c.require(_schedule_ok(value), "S3", {"axes.schedule": value},
                      "unknown schedule", "use none, 1f1b or interleaved:V (V virtual stages)")
        if any(v != "none" for v in self.axes.get("schedule", [])):
            c.require(bool(self.pipeline_stages and self.pipeline_stages > 1), "S3",
                      {"pipeline_stages": self.pipeline_stages},
                      "1f1b and interleaved cells need a pipeline size",
                      "set pipeline_stages: 2 (or more)")
        c.raise_if_any()


@dataclass(frozen=True)
class Cell:
    key: str  # stable id: hash of the canonical overrides and the study's base identity
    axes: dict[str, Any]  # the axis values of this cell, for tables and plots
    overrides: tuple[str, ...]  # --set items that make the cell's recipe


def load_study(path: str | Path) -> tuple[Study, Path]:
    """The study and the path of its base recipe (relative to the study file)."""
    path = Path(path)
    raw = read_yaml(path, what="study")
    raw.setdefault("name", path.stem)
    study = build_dataclass(Study, raw)
    if study.hostfile:  # relative to the study file, like the recipe
        study = dataclasses.replace(study, hostfile=str((path.parent / study.hostfile).resolve()))
    return study, (path.parent / study.recipe).resolve()


def expand(study: Study, base: str = "") -> list[Cell]:
    """Every combination of the axes, in axis order, as recipe overrides; `base` is the
    study's identity (study_identity), part of every cell's key."""
    names = list(study.axes)
    cells = []
    for values in itertools.product(*(study.axes[n] for n in names)):
        axes = dict(zip(names, values))
        cells.append(make_cell(axes, {**_base_settings(study), **_axis_settings(study, axes)},
                               base=base))
    return cells


def _base_settings(study: Study) -> dict[str, Any]:
    return {**study.set, **timing(study.measure)}


def _axis_settings(study: Study, axes: dict[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for name, value in axes.items():
        settings.update(_schedule(value, study.pipeline_stages) if name == "schedule" else {name: value})
    return settings


def make_cell(axes: dict[str, Any], settings: dict[str, Any], *, base: str = "") -> Cell:
    """The cell whose recipe is the base with `settings` (dotted names) applied; its key is
    stable across runs of the same study on the same base, so a study run again finds the
    rows it already has. Without `base` the key hashes the overrides alone."""
    overrides = _overrides(settings)
    identity = json.dumps(overrides) if not base else json.dumps({"overrides": overrides, "base": base})
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return Cell(key=key, axes=axes, overrides=overrides)


def study_identity(study: Study, recipe_path: Path) -> str:
    """What the study's cells are measured on besides their overrides: the base recipe loaded
    with the study's `set` (every field explicit, so comments and layout of the file do not
    count, values do), the world size or hostfile content, and the device. RecipeError if the
    base does not load."""
    recipe = load_recipe(recipe_path, _overrides(_base_settings(study)))
    hostfile = Path(study.hostfile).read_text() if study.hostfile and Path(study.hostfile).is_file() else None
    return json.dumps({"recipe": dump_recipe(recipe), "world_size": study.world_size,
                       "hostfile": hostfile, "device": study.device}, sort_keys=True)


def check_study(study: Study, recipe_path: Path) -> list[Problem]:
    """Every problem that makes the whole study invalid (see the module docstring): the
    hostfile, the base recipe with the study's `set`, and each axis value on that base."""
    problems: list[Problem] = []
    if study.hostfile:
        from dsforge.recipe.hostfile import read_hostfile

        problems += _problems_of(lambda: read_hostfile(study.hostfile))
    base = _base_settings(study)
    loaded = _problems_of(lambda: load_recipe(recipe_path, _overrides(base)))
    if loaded:
        return problems + [_noted(p, "the study's base recipe with its set: and measure:")
                           for p in loaded]
    seen: set[str] = set()
    for name, values in study.axes.items():
        for value in values:
            settings = {**base, **_axis_settings(study, {name: value})}
            for p in _problems_of(lambda: load_recipe(recipe_path, _overrides(settings))):
                # An unknown name once per axis; a wrong value once per value.
                key = f"Z6 {tuple(p.fields)}" if p.rule == "Z6" else str(p)
                if p.rule in LOADER_RULES and key not in seen:
                    seen.add(key)
                    problems.append(_noted(p, f"axis {name}"))
    return problems


def _problems_of(action) -> list[Problem]:
    try:
        action()
    except RecipeError as exc:
        return list(exc.problems)
    return []


def _noted(problem: Problem, where: str) -> Problem:
    return dataclasses.replace(problem, message=f"{problem.message} (in {where})")


def _overrides(settings: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{k}={_yaml(v)}" for k, v in sorted(settings.items()))


def timing(measure: Measure) -> dict[str, Any]:
    return {"train.steps": measure.warmup_steps + measure.steps,
            "train.timing_warmup": measure.warmup_steps, "train.checkpoint_every": 0}


def _schedule_ok(value: Any) -> bool:
    if value in ("none", "1f1b"):
        return True
    kind, _, vpp = str(value).partition(":")
    return kind == "interleaved" and vpp.isdigit() and int(vpp) > 1


def _schedule(value: str, stages: int | None) -> dict[str, Any]:
    if value == "none":
        return {"parallel.pp": 1, "parallel.vpp": 1}
    vpp = int(value.partition(":")[2]) if value.startswith("interleaved") else 1
    return {"parallel.pp": stages, "parallel.vpp": vpp}


def _yaml(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value
