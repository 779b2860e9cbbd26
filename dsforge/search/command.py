"""What `dsforge plan --search` does between parsing options and printing: the base recipe
from a model name or a recipe file, the search space, and the text and JSON outputs."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from dsforge.bench.run import Interrupted
from dsforge.bench.study import Measure
from dsforge.cost.fit import LEAVE_ONE_OUT_MIN
from dsforge.cost.profile import ClusterProfile, load_profile
from dsforge.files import write_atomic
from dsforge.problems import EXIT_INVALID, Problem, RecipeError, did_you_mean, print_problems
from dsforge.recipe.loader import build_recipe, dump_recipe, load_recipe
from dsforge.recipe.presets import PRESETS
from dsforge.schema import Recipe
from dsforge.search.explain import format_duration, zero_pipeline_note
from dsforge.search.explorer import write_explorer
from dsforge.search.measure import (measure_top, refit_from_trials, refit_json, render_refit,
                                    render_trials, verdict)
from dsforge.search.search import Ranked, SearchResult, search
from dsforge.search.space import Space
from dsforge.units import GiB

DEFAULT_BATCH_TOKENS = 2**20  # ~1M tokens per optimizer step
DEFAULT_SEQ_LEN = 4096


@dataclass(frozen=True)
class SearchRequest:
    target: str  # a preset name or a recipe path
    gpus: int | None
    gpu: str | None
    global_batch_tokens: int | None
    seq_len: int | None
    overrides: tuple[str, ...] = ()


def base_recipe(request: SearchRequest) -> Recipe:
    """The recipe whose model and training settings the search keeps (layout fields vary)."""
    path = Path(request.target)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        recipe = load_recipe(path, request.overrides)
    elif request.target in PRESETS:
        recipe = build_recipe({"name": f"{request.target}-search", "model": {"preset": request.target},
                               "train": {"seq_len": DEFAULT_SEQ_LEN, "steps": 1000, "lr": 3e-4,
                                         "warmup_steps": 100, "precision": "bf16"}})
    else:
        raise RecipeError([Problem(
            rule="S1", fields={"MODEL_OR_RECIPE": request.target},
            message="neither a recipe file nor a model preset",
            fix=f"give a recipe path or one of: {', '.join(PRESETS)}."
                f"{did_you_mean(request.target, PRESETS)}")])
    seq_len = request.seq_len or min(recipe.train.seq_len, recipe.model.max_seq_len)
    return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, seq_len=seq_len))


def search_space(base: Recipe, request: SearchRequest, profile: ClusterProfile) -> Space:
    gpus = request.gpus or (base.cluster.world_size if base.cluster else None)
    if gpus is None:
        raise RecipeError([Problem(rule="S1", fields={"--gpus": None},
                                   message="the number of GPUs to search for is needed",
                                   fix="pass --gpus N (or a recipe with a cluster section)")])
    seq_len = base.train.seq_len
    tokens = request.global_batch_tokens
    if tokens is None:
        given = base.train.global_batch
        tokens = given * seq_len if given and not request.seq_len else DEFAULT_BATCH_TOKENS
    sequences, remainder = divmod(tokens, seq_len)
    if remainder or not sequences:
        nearest = max(1, round(tokens / seq_len)) * seq_len
        raise RecipeError([Problem(rule="S2", fields={"--global-batch-tokens": tokens, "--seq-len": seq_len},
                                   message="the global batch is not a whole number of sequences",
                                   fix=f"use --global-batch-tokens {nearest}")])
    return Space(gpus=gpus, gpus_per_node=profile.gpus_per_node, global_batch=sequences,
                 gpu=profile.gpu.key)


def write_recipe(result: SearchResult, path: Path) -> Path:
    winner = result.ranked[0].resolved.recipe
    recipe = dataclasses.replace(winner, name=path.stem)
    header = (f"# Written by `dsforge plan --search`: the fastest predicted layout for "
              f"{result.space.gpus} x {result.profile.gpu.name}.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, header + dump_recipe(recipe))
    return path


def result_json(result: SearchResult, top: int) -> dict[str, Any]:
    profile = dataclasses.asdict(result.profile)
    profile["gpu"] = result.profile.gpu.key
    return {
        "space": dataclasses.asdict(result.space), "profile": profile,
        "counts": {"considered": result.considered, "valid": result.valid, "fit": result.fit,
                   "ranked": len(result.ranked), "batch_exact": result.batch_exact},
        "seconds": result.seconds,
        "prediction_error": result.profile.prediction_error,
        "tied_layouts": tied_layouts(result),
        "tie_note": tie_note(result),
        "candidates": [{**r.to_dict(), "zero_pipeline_note": zero_pipeline_note(r, result.ranked, result.profile)}
                       for r in result.ranked[:top]],
        "nearest_memory": result.nearest_memory.to_dict() if result.nearest_memory else None,
    }


_COLUMNS = ("#", "tp", "cp", "pp", "vpp", "ep", "dp", "zero", "mb", "accum", "ckpt", "sp",
            "mem GiB", "step s", "band s", "tie", "tok/s/GPU", "MFU")


def tied_layouts(result: SearchResult) -> int:
    """How many layouts tie with the fastest (listed first; search.rank)."""
    return sum(1 for r in result.ranked if r.tied)


def tie_note(result: SearchResult) -> str | None:
    """What the tie means for the answer, and how to settle it on this hardware: measuring the
    tied layouts (`--measure --top K`, K = the number tied) would change the answer whenever a
    tied layout other than #1 measures faster. None when nothing ties."""
    k = tied_layouts(result)
    if k < 2:
        return None
    fastest = min(result.ranked[:k], key=lambda r: r.time.total)
    first = result.ranked[0]
    pick = ("#1 is also the fastest predicted" if fastest is first else
            f"#1 is predicted {first.time.total / fastest.time.total - 1:.1%} slower than "
            f"#{result.ranked.index(fastest) + 1} and ranks first as the simpler layout")
    return (f"{k} layouts tie within the model's +-{result.profile.prediction_error:.1%} error "
            f"(#1-#{k}, bands overlapping the fastest one's); {pick}. The model cannot settle "
            f"this: --measure --top {k} would, on this hardware")


def render(result: SearchResult, top: int, model_name: str) -> str:
    space, profile = result.space, result.profile
    lines = [
        f"search: {model_name} on {space.gpus} x {profile.gpu.name} ({profile.gpus_per_node} per node), "
        f"global batch {space.global_batch} sequences",
        f"profile: intra-node {profile.intra_node_gbps:g} GB/s, inter-node {profile.inter_node_gbps:g} GB/s "
        f"per GPU, compute efficiency {profile.compute_efficiency:.3g}, memory headroom "
        f"{profile.memory_margin:.0%} (usable {profile.usable_memory_bytes / GiB:.1f} GiB), step-time "
        f"band +-{profile.prediction_error:.1%} ({_band_source(profile)})",
        f"1. valid:  {result.valid} of {result.considered} layouts pass the recipe validator",
        f"2. fit:    {result.fit} fit in memory",
        f"3. batch:  {len(result.ranked)} reach the global batch "
        + ("exactly" if result.batch_exact or not result.fit
           else "nearest to the target (none that fit reach it exactly)"),
        f"searched in {result.seconds:.2f} s", ""]
    if not result.ranked:
        lines.append("no layout fits: " + _nearest_memory_text(result))
        return "\n".join(lines)
    ties = tied_layouts(result) >= 2  # #1 alone is no tie: its column stays empty
    rows = [_COLUMNS] + [_row(i + 1, r, ties) for i, r in enumerate(result.ranked[:top])]
    widths = [max(len(str(row[c])) for row in rows) for c in range(len(_COLUMNS))]
    for row in rows:
        lines.append("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    lines += ["", "why each beat the next:"]
    shown = result.ranked[:top]
    for i, r in enumerate(shown):
        if r.reason:
            lines.append(f"  {i + 1} over {i + 2}: {r.reason}")
    notes = [(i + 1, zero_pipeline_note(r, result.ranked, profile)) for i, r in enumerate(shown)]
    notes = [(i, n) for i, n in notes if n]
    if notes:
        lines += ["", "ZeRO-2/3 with pipelines (collectives every microbatch, docs/search.md):"]
        lines += [f"  {i}: {n}" for i, n in notes]
    note = tie_note(result)
    lines += ["", note if note else (
        "no tie: no other layout's band overlaps #1's (rows of #1's own layout with another "
        "ZeRO stage, micro-batch or checkpointing are its variants, ordered by step time)")]
    best = shown[0]
    lines += ["", "step time of #1: " + ", ".join(
        f"{k} {format_duration(v)}" for k, v in best.time.to_dict().items() if v > 0 or k == "total")]
    return "\n".join(lines)


def _band_source(profile: ClusterProfile) -> str:
    """Where the band comes from, and whether the profile was measured anywhere."""
    if profile.measured_runs >= LEAVE_ONE_OUT_MIN:
        return f"leave-one-out over {profile.measured_runs} trials on {profile.measured_on}"
    published = "the model's median error on published runs"
    if profile.measured_on:
        return (f"{published}; coefficients measured on {profile.measured_on}"
                + (f" from {profile.measured_runs} trial(s)" if profile.measured_runs else "")
                + f", the band not: --measure --top {LEAVE_ONE_OUT_MIN} refits it from trials")
    return (f"{published}; this profile's coefficients were never measured: dsforge calibrate, "
            "or --measure, measures them here")


def _row(rank: int, r: Ranked, ties: bool) -> tuple:
    x = r.layout_row()
    return (rank, x["tp"], x["cp"], x["pp"], x["vpp"], x["ep"], x["dp"], x["zero"], x["micro_batch"],
            x["grad_accum"], x["checkpointing"], "y" if x["sequence_parallel"] else "n",
            f"{r.memory.total / GiB:.1f}", f"{r.time.total:.2f}", _band(r), "tie" if ties and r.tied else "",
            f"{r.tokens_per_s / r.resolved.layout.world_size:,.0f}", f"{r.mfu:.1%}")


def _band(r: Ranked) -> str:
    low, high = r.band
    digits = 2 if high >= 0.1 else 4
    return f"{low:.{digits}f}-{high:.{digits}f}"


def _nearest_memory_text(result: SearchResult) -> str:
    r = result.nearest_memory
    if r is None:
        return "no valid layout for this model and GPU count."
    x = r.layout_row()
    return (f"the smallest needs {r.memory.total / GiB:.1f} GiB per GPU (tp {x['tp']}, cp {x['cp']}, "
            f"pp {x['pp']}, ZeRO-{x['zero']}, checkpointing {x['checkpointing']}); "
            f"{_inside_the_headroom(r, result.profile)}"
            f"use more GPUs, GPUs with more memory, or a shorter --seq-len (CPU offload is not searched: "
            f"try zero.offload_optimizer in a recipe and `dsforge plan` it)")


def _inside_the_headroom(nearest: Ranked, profile: ClusterProfile) -> str:
    """When the smallest layout fits the GPU and only the headroom refuses it, the largest
    whole-percent headroom that admits it, and what that leaves for the allocator."""
    needed, gpu_bytes = nearest.memory.total, profile.gpu.memory_bytes
    if needed > gpu_bytes:
        return ""
    headroom = math.floor(100 * (1 - needed / gpu_bytes)) / 100
    return (f"it fits the GPU's {gpu_bytes / GiB:.1f} GiB inside the {profile.memory_margin:.0%} "
            f"headroom kept for the allocator: --memory-headroom {headroom:g} admits it, leaving "
            f"{(gpu_bytes - needed) / GiB:.1f} GiB for fragmentation; or ")


def run_search_command(target: str, *, overrides, as_json: bool, top: int, gpus, gpus_per_node,
                       gpu, global_batch_tokens, seq_len, write, html, profile, measure=False,
                       measure_out=None, memory_headroom=None) -> None:
    """The whole `dsforge plan --search`: problems are printed together, exit 2."""
    request = SearchRequest(target=target, gpus=gpus, gpu=gpu, global_batch_tokens=global_batch_tokens,
                            seq_len=seq_len, overrides=tuple(overrides))
    try:
        base = base_recipe(request)
        cluster = base.cluster
        cluster_profile = load_profile(profile, gpu or (cluster.gpu if cluster else None),
                                       gpus_per_node or (cluster.gpus_per_node if cluster else None),
                                       memory_headroom)
        space = search_space(base, request, cluster_profile)
    except RecipeError as exc:
        print_problems(target, exc.problems)
        sys.exit(EXIT_INVALID)
    result = search(base, space, cluster_profile)
    if write:
        click.echo(f"wrote {write_recipe(result, write)}" if result.ranked
                   else f"nothing written to {write}: no layout fits", err=True)
    if html:  # the rank grids come from Megatron-Core's import: seconds, after a search of one
        click.echo(f"dsforge: writing {html} (imports Megatron-Core for the rank grids)", err=True)
        click.echo(f"wrote {write_explorer(base, result, html)}", err=True)
    out = measure_out or _default_out(base)
    trials = _measure(base, result, top, out) if measure and result.ranked else None
    refit = refit_from_trials(base, result, trials, out) if trials else None
    if as_json:
        data = result_json(result, top)
        if trials is not None:
            data["measured"] = [{"predicted_rank": t.predicted_rank, "layout": t.candidate.layout_row(),
                                 "predicted_step_s": t.candidate.time.total,
                                 "measured_step_s": t.measured_step_s, "status": t.status,
                                 "reason": t.reason} for t in trials]
            data["measured_verdict"] = verdict(trials)
        if refit is not None:
            data["refit"] = refit_json(refit, top)
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(render(result, top, base.model.preset or base.name))
        if trials is not None:
            click.echo("\n" + render_trials(trials))
        if refit is not None:
            click.echo("\n" + render_refit(refit, top))


def _default_out(base: Recipe) -> Path:
    return Path("runs") / f"search-{base.model.preset or base.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _measure(base: Recipe, result: SearchResult, top: int, out: Path):
    click.echo(f"measuring the top {min(top, len(result.ranked))} layouts on this machine; "
               f"results in {out}/results.db", err=True)
    try:
        return measure_top(base, result, top, out, Measure(), log=lambda line: click.echo(line, err=True))
    except Interrupted as stop:  # Ctrl-C or SIGTERM: the interrupted trial has no result
        click.echo(f"dsforge: stopped; finished trials are in {out}/results.db", err=True)
        sys.exit(stop.code)

