"""What a checkpoint costs the training loop: background saves against saves in the loop.

    python benchmarks/checkpoints/save_stall.py [--ranks 1] [--steps 12] [--every 3]
        [--parts-gb 0.25] [--workdir /tmp/dsforge-save-bench]
        [--out benchmarks/checkpoints/save_stall.json]

Runs `dsforge run recipes/tiny.yaml` twice at an ~89 M-parameter size (hidden 1024, 8 layers,
FFN 2816, 16 heads, vocabulary 256, fp32, ZeRO-1, global batch 2 of 128 tokens: ~1.06 GB of
optimizer state, so a save takes seconds on a CPU), once with `train.checkpoint_async: true`,
once with false, and once in the background staged in parts of `--parts-gb`
(`train.checkpoint_staging_gb`), saving every `--every` steps and after the last. Prints, from
each run's
summary.json (`checkpoints`, the reporting rank's saves) and metrics.jsonl:
  - bytes a checkpoint takes on disk against the state it holds (12 bytes a parameter);
  - the training loop's stall per save: background (the snapshot, and any wait for the save
    before) against in the loop (snapshot + write + publish), and their ratio;
  - the step time right after a background save (its write running) against the other steps
    (medians), and the write's rate;
  - the stall of a background save staged in parts, beside `dsforge plan`'s estimate of it.
README.md beside this file has the predictions, written before the run, and the results.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = ["model.hidden_size=1024", "model.num_layers=8", "model.ffn_hidden_size=2816",
         "model.num_attention_heads=16", "train.global_batch=2", "train.micro_batch=2",
         "train.warmup_steps=0", "train.timing_warmup=1"]


def run(workdir: Path, name: str, *, ranks: int, steps: int, every: int, background: bool,
        parts_gb: float | None = None) -> dict:
    run_dir = workdir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = MODEL + [f"parallel.dp={ranks}", f"train.steps={steps}",
                    f"train.checkpoint_every={every}",
                    f"train.checkpoint_async={'true' if background else 'false'}"]
    if parts_gb is not None:
        sets.append(f"train.checkpoint_staging_gb={parts_gb}")
    args = [sys.executable, "-m", "dsforge", "run", str(REPO / "recipes" / "tiny.yaml"),
            "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    started = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_s = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = {r["step"]: r["step_time_s"] for r in steps_s if "step_time_s" in r}
    checkpoints = sorted((run_dir / "checkpoints").glob("step*"))
    on_disk = [sum(f.stat().st_size for f in c.rglob("*") if f.is_file()) for c in checkpoints]
    return {"wall_s": time.monotonic() - started, "checkpoints": summary["checkpoints"],
            "step_time_s": step_times, "bytes_on_disk": on_disk,
            "median_step_s": summary.get("median_step_time_s")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--parts-gb", type=float, default=0.25)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dsforge-save-bench"))
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("save_stall.json"))
    a = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from dsforge.estimate.save_cost import STATE_BYTES_PER_PARAM, save_cost
    from dsforge.estimate.params import count_params
    from dsforge.recipe import resolve_file

    resolved = resolve_file(REPO / "recipes" / "tiny.yaml", MODEL + [f"parallel.dp={a.ranks}"],
                            world_size=a.ranks)
    params = count_params(resolved.recipe.model).total
    state = STATE_BYTES_PER_PARAM * params
    in_parts = resolve_file(REPO / "recipes" / "tiny.yaml",
                            MODEL + [f"parallel.dp={a.ranks}", f"train.checkpoint_every={a.every}",
                                     f"train.checkpoint_staging_gb={a.parts_gb}"],
                            world_size=a.ranks)
    planned_parts = save_cost(in_parts, device="cpu", step_s=None)  # before the runs
    results = {name: run(a.workdir, f"{name}-{a.ranks}", ranks=a.ranks, steps=a.steps,
                         every=a.every, background=name != "foreground",
                         parts_gb=a.parts_gb if name == "parts" else None)
               for name in ("background", "foreground", "parts")}
    parts = results["parts"]["checkpoints"]["background"]
    back = results["background"]["checkpoints"]["background"]
    fore = results["foreground"]["checkpoints"]["foreground"]
    times = results["background"]["step_time_s"]
    # Steps (0-based) that start right after a background save: its write runs beside them.
    saved_after = {s for s in range(a.every, a.steps, a.every)}
    writing = [t for s, t in times.items() if s in saved_after]
    quiet = [t for s, t in times.items() if s not in saved_after and s >= 1]
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
        "python": platform.python_version(), "ranks": a.ranks, "params": params,
        "state_bytes": state, "bytes_on_disk": results["background"]["bytes_on_disk"],
        "disk_over_state": max(results["background"]["bytes_on_disk"]) / state,
        "stall_background_s": back["stall_s"], "stall_foreground_s": fore["stall_s"],
        "stall_ratio": back["stall_s"] / fore["stall_s"],
        "snapshot_s": back["snapshot_s"], "write_background_s": back["write_s"],
        "write_foreground_s": fore["write_s"], "write_gbps_foreground": fore["write_gbps"],
        "snapshot_gbps": back["bytes"] / back["snapshot_s"] / 1e9,
        "parts_gb": a.parts_gb, "stall_parts_s": parts["stall_s"],
        "stall_parts_planned_s": planned_parts.stall_s, "write_parts_s": parts["write_s"],
        "step_s_while_writing": statistics.median(writing) if writing else None,
        "step_s_otherwise": statistics.median(quiet) if quiet else None,
        "runs": results,
    }
    if writing and quiet:
        report["step_ratio_while_writing"] = report["step_s_while_writing"] / report["step_s_otherwise"]
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    for key in ("params", "state_bytes", "disk_over_state", "stall_background_s",
                "stall_foreground_s", "stall_ratio", "snapshot_s", "snapshot_gbps",
                "write_background_s", "write_foreground_s", "write_gbps_foreground",
                "parts_gb", "stall_parts_s", "stall_parts_planned_s", "write_parts_s",
                "step_s_while_writing", "step_s_otherwise", "step_ratio_while_writing"):
        value = report.get(key)
        print(f"{key:28s} {value:,.4g}" if isinstance(value, (int, float)) else f"{key:28s} {value}")


if __name__ == "__main__":
    main()
