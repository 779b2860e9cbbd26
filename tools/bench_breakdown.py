"""What the step breakdown costs: the same job with the breakdown on and off, paired.

Each layout runs once (benchmarks/overhead/breakdown_rank.py on DeepSpeed's launcher): its
steps alternate in pairs, one with the breakdown and one without (on-off, off-on, ...). The
figure is the median over pairs of (step with) / (step without), with a distribution-free
95% interval for that median. Alongside, the direct cost, free of the machine's noise: the
clock's host time per mark (taking it and reading it back, measured here in a loop on the same
device) times the marks a step took, plus the fixed cost per step the rank measured on its
engine (hooks installed and removed, clock started, stopped and read, phases written), as a
share of the step.

    python tools/bench_breakdown.py --json benchmarks/overhead/breakdown.json

On a GPU machine the same command uses CUDA events; `--recipe R --layouts as-is --world-size N`
measures a recipe unchanged (e.g. recipes/7b_1gpu.yaml). DSFORGE_BREAKDOWN=gathers in the
environment measures that mode (ZeRO-3's per-module gathers marked too) against none.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dsforge.launch.local import free_port, run_job
from dsforge.runtime.rank import threads_per_rank

ROOT = Path(__file__).resolve().parents[1]
RANK_PROGRAM = ROOT / "benchmarks" / "overhead" / "breakdown_rank.py"
LAYOUTS = {
    # name: (world size, --set overrides on the recipe)
    "dp2-zero1": (2, ["parallel.dp=2", "zero.stage=1"]),
    "dp2-zero3": (2, ["parallel.dp=2", "zero.stage=3"]),
    "pp2-1f1b-full-ckpt": (2, ["parallel.dp=1", "parallel.pp=2",
                               "train.activation_checkpointing=full"]),
    "1rank-zero3-full-ckpt": (1, ["parallel.dp=1", "zero.stage=3",
                                  "train.activation_checkpointing=full"]),
    "as-is": (None, []),  # the recipe unchanged, on --world-size ranks
}


def run_layout(layout: str, args) -> dict:
    world, overrides = LAYOUTS[layout]
    world = world or args.world_size
    with tempfile.TemporaryDirectory(prefix="bench-breakdown-") as tmp:
        out = Path(tmp) / "steps.json"
        command = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(world),
                   "--master_port", str(free_port()), str(RANK_PROGRAM), "--recipe", str(args.recipe),
                   "--steps", str(args.steps), "--out", str(out)]
        for item in overrides:
            command += ["--set", item]
        # Both sides share one process, so one thread setting: the user's OMP_NUM_THREADS, or
        # dsforge's own for this many ranks. On a busy machine 1 avoids OpenMP threads spinning
        # against other processes (steps 30x slower at random).
        threads = os.environ.get("OMP_NUM_THREADS") or str(threads_per_rank({"LOCAL_SIZE": str(world)}))
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        code = run_job(command, timeout_s=args.timeout, env=env, log_path=Path(tmp) / "job.log")
        if code != 0:
            raise SystemExit(f"{layout}: exit {code}\n{(Path(tmp) / 'job.log').read_text()[-3000:]}")
        measured = json.loads(out.read_text())
    return summarise(layout, measured, args.skip)


def pairs(steps: list[dict], skip: int) -> list[tuple[float, float]]:
    """(seconds with, seconds without) of each pair whose steps both come after `skip`."""
    kept = [s for s in steps if s["step"] >= skip]
    by_pair: dict[int, dict[bool, float]] = {}
    for s in kept:
        by_pair.setdefault(s["step"] // 2, {})[s["on"]] = s["seconds"]
    return [(p[True], p[False]) for p in by_pair.values() if len(p) == 2]


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median (order statistics)."""
    ordered, n = sorted(values), len(values)
    half = 1.96 * math.sqrt(n) / 2
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return ordered[low], ordered[high]


def cost_per_mark(device_name: str, marks: int = 2000) -> float:
    """Host seconds per mark: taking it inside a step, and reading it back after the step."""
    import torch

    from dsforge.runtime.loop.breakdown import StepClock

    clock = StepClock(torch.device(device_name))
    for _ in range(3):  # the first rounds allocate (events, lists)
        clock.start()
        started = time.perf_counter()
        for _ in range(marks // 2):
            clock.enter("forward")
            clock.exit()
        clock.stop().read(step_time_s=1.0)
        seconds = time.perf_counter() - started
    return seconds / (marks + 2)


def summarise(layout: str, measured: dict, skip: int) -> dict:
    paired = pairs(measured["steps"], skip)
    ratios = [on / off for on, off in paired]
    marks = [s["marks"] for s in measured["steps"] if s["on"] and s["step"] >= skip]
    on_s = statistics.median(on for on, _ in paired)
    per_mark = cost_per_mark("cuda" if measured["device"].startswith("cuda") else "cpu")
    direct = statistics.median(marks) * per_mark + measured["fixed_s"]
    from dsforge.runtime.loop.breakdown import mode

    label = layout if mode() == "on" else f"{layout} ({mode()})"
    return {"layout": label, "device": measured["device"], "pairs": len(paired),
            "on_ms": on_s * 1e3, "off_ms": statistics.median(off for _, off in paired) * 1e3,
            "ratio": statistics.median(ratios), "ratio_95": median_interval(ratios),
            "marks_per_step": statistics.median(marks), "us_per_mark": per_mark * 1e6,
            "us_fixed": measured["fixed_s"] * 1e6, "direct_share": direct / on_s}


def table(results: list[dict]) -> str:
    lines = ["| layout | device | pairs | ms/step on | ms/step off | on/off (median of pairs) | "
             "95% interval | marks/step | us/mark | us/step fixed | direct share of the step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        low, high = r["ratio_95"]
        lines.append(f"| {r['layout']} | {r['device']} | {r['pairs']} | {r['on_ms']:.2f} | "
                     f"{r['off_ms']:.2f} | {r['ratio']:.4f} | {low:.4f}-{high:.4f} | "
                     f"{r['marks_per_step']:.0f} | {r['us_per_mark']:.2f} | {r['us_fixed']:.1f} | "
                     f"{r['direct_share']:.3%} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="dp2-zero1,dp2-zero3,pp2-1f1b-full-ckpt,1rank-zero3-full-ckpt",
                        help="comma-separated: " + ", ".join(LAYOUTS))
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "tiny.yaml")
    parser.add_argument("--world-size", type=int, default=1, help="ranks for the as-is layout")
    parser.add_argument("--steps", type=int, default=300, help="steps per layout (pairs: half)")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out (warmup)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    unknown = [name for name in args.layouts.split(",") if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if (args.steps - args.skip) // 2 < 3:
        parser.error(f"--steps {args.steps} with --skip {args.skip} leaves too few pairs")
    results = []
    for layout in args.layouts.split(","):
        results.append(run_layout(layout, args))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
