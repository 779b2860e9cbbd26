"""Run a study: validate every cell, run the valid ones as jobs, record every outcome.

Each cell and repeat is its own `dsforge` job (DeepSpeed's launcher, its own process group,
reaped afterwards) with a wall-clock timeout. Outcomes: ok, oom, timeout, crashed (read from
the exit code and the logs), or rejected (invalid recipe, never started). Rows already in the
store are skipped; failed ones are run again with `retry_failed`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Callable

from dsforge.bench.store import FAILED, Row, Store
from dsforge.bench.study import Cell, Study, expand
from dsforge.launch.job import JobSpec, Placement, launch_command
from dsforge.launch.local import free_port, run_job
from dsforge.problems import RecipeError, errors
from dsforge.recipe import Resolved, resolve_file
from dsforge.recipe.loader import dump_recipe
from dsforge.recipe.tiny import tiny_resolved
from dsforge.runtime import failure

# Exit codes of a launcher whose rank the kernel killed (SIGKILL: usually its OOM killer).
_KILLED = (-9, 137)


def run_study(study: Study, recipe_path: Path, store: Store, out_dir: Path, *,
              retry_failed: bool = False, tiny: bool = False,
              log: Callable[[str], None] = print) -> None:
    cells = expand(study)
    log(f"study {study.name}: {len(cells)} cells x {study.measure.repeats} repeats")
    for index, cell in enumerate(cells, start=1):
        for repeat in range(study.measure.repeats):
            previous = store.status(study.name, cell.key, repeat)
            if previous is not None and not (retry_failed and previous in FAILED):
                continue
            row = run_cell(study, recipe_path, cell, repeat, out_dir, tiny=tiny)
            store.write(row)
            log(f"[{index}/{len(cells)}] {_label(cell)} repeat {repeat}: {row.status}"
                + (f" ({row.reason})" if row.reason else ""))


def _label(cell: Cell) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell.axes.items())


def run_cell(study: Study, recipe_path: Path, cell: Cell, repeat: int, out_dir: Path, *,
             tiny: bool = False) -> Row:
    base = dict(study=study.name, cell=cell.key, repeat=repeat, axes=cell.axes)
    try:
        resolved = _resolve_cell(study, recipe_path, cell, tiny)
    except RecipeError as exc:
        reason = "; ".join(str(p) for p in errors(exc.problems))
        return Row(**base, status="rejected", reason=reason)
    run_dir = out_dir / "cells" / cell.key / f"repeat{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an attempt that never recorded a row
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    code = _launch(study, resolved, run_dir, device="cpu" if tiny else study.device)
    status, reason = classify(code, run_dir)
    return Row(**base, status=status, reason=reason, seconds=time.monotonic() - started,
               recipe=dump_recipe(resolved.recipe), manifest=_read_json(run_dir / "manifest.json"),
               figures=figures(run_dir) if status == "ok" else None,
               prediction=prediction(resolved))


def _resolve_cell(study: Study, recipe_path: Path, cell: Cell, tiny: bool = False) -> Resolved:
    resolved = resolve_file(recipe_path, cell.overrides, world_size=study.world_size,
                            hostfile=study.hostfile)
    return tiny_resolved(resolved, cell.overrides) if tiny else resolved


def _launch(study: Study, resolved: Resolved, run_dir: Path, device: str) -> int:
    job = JobSpec(recipe_yaml=dump_recipe(resolved.recipe), run_dir=str(run_dir.resolve()),
                  device=device, step_timeout_s=study.measure.step_timeout_s, measure=True)
    placement = Placement(world_size=resolved.layout.world_size, hostfile=study.hostfile,
                          master_port=free_port())
    return run_job(launch_command(placement, job), timeout_s=study.measure.timeout_s,
                   log_path=run_dir / "job.log")


def classify(code: int, run_dir: Path) -> tuple[str, str | None]:
    """ok / timeout / oom / crashed from the launcher's exit code and the ranks' failure
    records (runtime/failure.py): a hang ended by a rank's watchdog is a timeout of one step."""
    if code == 0 and (run_dir / "summary.json").exists():
        return "ok", None
    if code == 124:
        return "timeout", "exceeded the cell's wall-clock limit"
    first = failure.first(run_dir)
    if first is not None:
        status = {"hang": "timeout", "oom": "oom"}.get(first.kind, "crashed")
        return status, first.headline()
    if code in _KILLED:
        return "oom", "a rank was killed (out of memory?)"
    return "crashed", f"exit code {code}; see {run_dir / 'job.log'}"


def figures(run_dir: Path) -> dict:
    """Measured figures of one repeat: per-step times of the measured steps, throughput,
    MFU/HFU medians, peak memory max over ranks, measured bubble per pipeline stage."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if not r["warmup"]]
    ranks = [_read_json(p) for p in sorted((run_dir / "ranks").glob("rank*.json"))]
    bubbles: dict[int, list[float]] = {}
    for r in ranks:
        if r["bubble_share"] is not None:
            bubbles.setdefault(r["pp_rank"], []).append(r["bubble_share"])
    median = lambda key: statistics.median(r[key] for r in measured) if all(r[key] is not None for r in measured) else None
    return {
        "step_times_s": [r["step_time_s"] for r in measured],
        "tokens_per_s": median("tokens_per_s"), "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"),
        "mfu": median("mfu"), "hfu": median("hfu"), "final_loss": records[-1]["loss"],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        "memory_source": ranks[0]["memory_source"],
        "bubble_share_by_stage": {str(k): statistics.median(v) for k, v in sorted(bubbles.items())},
        "tensor_bytes": largest_census(r.get("tensor_bytes") for r in ranks),
    }


def largest_census(censuses) -> dict | None:
    """The live-tensor census holding the most (runtime/tensor_census.py); None if there is none."""
    present = [c for c in censuses if c]
    return max(present, key=lambda c: c["total"]) if present else None


def prediction(resolved: Resolved) -> dict:
    """What `dsforge plan` predicts for the cell (memory per GPU, bubble)."""
    from dsforge.estimate.bubble import bubble_fraction, bubble_share_of_step
    from dsforge.estimate.flops import flops_per_token
    from dsforge.estimate.memory import estimate_memory

    r, lay = resolved.recipe, resolved.layout
    memory = estimate_memory(model=r.model, train=r.train, zero=r.zero, layout=lay)
    flops = flops_per_token(r.model, r.train.seq_len, r.train.activation_checkpointing)
    return {"memory_bytes": memory.to_dict(), "layout": dataclasses.asdict(lay),
            "bubble_fraction": bubble_fraction(lay.pp, lay.vpp, lay.num_microbatches),
            "bubble_share_of_step": bubble_share_of_step(lay.pp, lay.vpp, lay.num_microbatches),
            "flops_per_token": flops.model, "hardware_flops_per_token": flops.hardware}


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None
