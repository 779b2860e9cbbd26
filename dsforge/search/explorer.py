"""`dsforge plan --search ... --html out.html`: one self-contained page to see why.

The page shows, for the chosen layout and the runners-up: per-GPU memory as stacked bars
against the usable memory, the predicted step-time breakdown, the rank grid (which ranks
form which tensor/pipeline/data-parallel groups, node boundaries) and the candidate table.

Its controls (model, GPU count, ZeRO stage) switch between scenarios that dsforge computed
when it wrote the page, with the same search, memory model and step-time model as the
command line: the browser only draws, so the page can never disagree with `dsforge plan`.
Rank groups come from Megatron-Core's RankGenerator (dsforge/translate/groups.py).
No server and no network: data, script and style are inline. The URL fragment selects a
scenario (`out.html#model=llama3-70b&gpus=64&zero=3`), so a view can be shared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dsforge.files import write_atomic
from dsforge.problems import RecipeError
from dsforge.recipe.loader import build_dataclass
from dsforge.recipe.presets import apply_preset
from dsforge.schema import ModelConfig, Recipe
from dsforge.search.search import Ranked, SearchResult, search
from dsforge.translate.groups import rank_groups

PER_STAGE = 6  # candidates kept per ZeRO stage (and overall) in each scenario
COMPARED_MODELS = ("llama2-7b", "llama3-8b", "llama2-13b", "llama3-70b", "mixtral-8x7b")


def _rank_coordinates(r: Ranked) -> dict[str, list[int]]:
    """Each rank's position in its tp, cp, pp, dp (and ep) group, from Megatron's RankGenerator."""
    world = r.resolved.layout.world_size
    coords: dict[str, list[int]] = {}
    for name, groups in rank_groups(r.resolved.layout).items():
        if name not in ("tp", "cp", "pp", "dp", "ep"):
            continue
        position = [0] * world
        for group in groups:
            for index, rank in enumerate(group):
                position[rank] = index
        coords[name] = position
    return coords


def _shown(result: SearchResult) -> list[Ranked]:
    keep: list[Ranked] = list(result.ranked[:PER_STAGE])
    for stage in range(4):
        keep += [r for r in result.ranked if r.resolved.recipe.zero.stage == stage][:PER_STAGE]
    unique, seen = [], set()
    position = {id(r): i for i, r in enumerate(result.ranked)}  # the command line's order (ties first)
    for r in sorted(keep, key=lambda r: position[id(r)]):
        if id(r) not in seen:
            seen.add(id(r))
            unique.append(r)
    return unique


def scenario(result: SearchResult, model_name: str) -> dict[str, Any]:
    space, profile = result.space, result.profile
    shown = _shown(result)
    return {
        "model": model_name, "gpus": space.gpus, "gpus_per_node": profile.gpus_per_node,
        "gpu": profile.gpu.name, "usable_bytes": profile.usable_memory_bytes,
        "gpu_bytes": profile.gpu.memory_bytes, "global_batch": space.global_batch,
        "counts": {"considered": result.considered, "valid": result.valid, "fit": result.fit,
                   "ranked": len(result.ranked)},
        "candidates": [{**r.to_dict(), "rank": result.ranked.index(r) + 1,
                        "coords": _rank_coordinates(r)} for r in shown],
    }


def _gpu_counts(gpus: int) -> list[int]:
    return sorted({g for g in (gpus // 4, gpus // 2, gpus, gpus * 2, gpus * 4) if g >= 1})


def build_scenarios(base: Recipe, result: SearchResult) -> list[dict[str, Any]]:
    """The searched model at a range of GPU counts, and other published models at this one."""
    name = base.model.preset or base.name
    scenarios = [scenario(result, name)]
    for gpus in _gpu_counts(result.space.gpus):
        if gpus != result.space.gpus:
            space = dataclasses.replace(result.space, gpus=gpus)
            scenarios.append(scenario(search(base, space, result.profile), name))
    for preset in COMPARED_MODELS:
        if preset == base.model.preset:
            continue
        other = _with_preset(base, preset)
        if other is not None:
            scenarios.append(scenario(search(other, result.space, result.profile), preset))
    return scenarios


def _with_preset(base: Recipe, preset: str) -> Recipe | None:
    try:
        model = build_dataclass(ModelConfig, apply_preset({"preset": preset}, preset))
    except RecipeError:
        return None
    if model.max_seq_len < base.train.seq_len:
        return None
    return dataclasses.replace(base, model=model)


def write_explorer(base: Recipe, result: SearchResult, path: Path) -> Path:
    data = {"scenarios": build_scenarios(base, result),
            "initial": {"model": base.model.preset or base.name, "gpus": result.space.gpus}}
    # `</` must not appear inside the inline script: escape it in the JSON.
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    html = (Path(__file__).with_name("explorer.html").read_text()
            .replace("/*DATA*/null", payload))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, html)
    return path
