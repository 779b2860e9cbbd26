"""dsforge's own overhead per training step: `dsforge run` against a hand-written script.

Both train the same tiny model with the same layout, `dsforge run` through its launcher and
the hand-written side (benchmarks/overhead/handwritten.py) through DeepSpeed's; how the ranks
start is outside the figure compared (below). Runs alternate (A B, B A, ...)
in one invocation so drift in the machine's speed hits both sides alike. The figure compared
is the loop period: the time between the ends of consecutive steps, so everything dsforge does
per step (data, metrics, heartbeat, watchdog, progress bar) is inside it.

    python tools/bench_overhead.py --repeats 3 --json benchmarks/overhead/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from dsforge.job.metrics_file import read_metrics
from dsforge.job.run_dir import RunDir
from dsforge.launch.local import free_port, run_job
from dsforge.runtime.rank import threads_per_rank

ROOT = Path(__file__).resolve().parents[1]
HANDWRITTEN = ROOT / "benchmarks" / "overhead" / "handwritten.py"
LAYOUTS = {
    # name: (dsforge --set overrides on recipes/tiny.yaml, handwritten.py arguments)
    "dp2-zero1": ([], ["--pp", "1", "--zero", "1"]),
    "pp2-1f1b-zero1": (["parallel.pp=2", "parallel.dp=1"], ["--pp", "2", "--zero", "1"]),
}


def run_group(command: list[str], log: Path, timeout_s: float) -> None:
    """Run through dsforge's own job runner: its own process group, killed on timeout or Ctrl-C.

    Both sides get the same OMP_NUM_THREADS (the thread count dsforge gives each of 2 local
    ranks), so dsforge choosing it by itself is not what is compared."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank({"LOCAL_SIZE": "2"}))}
    code = run_job(command, timeout_s=timeout_s, env=env, log_path=log)
    if code == 124:
        raise SystemExit(f"timed out after {timeout_s:.0f}s: {' '.join(command)} (log: {log})")
    if code != 0:
        raise SystemExit(f"exit {code}: {' '.join(command)}\n{log.read_text()[-3000:]}")


def periods(end_times: list[float], skip: int) -> list[float]:
    """Step-to-step periods, leaving out the first `skip` steps (warmup, first-use costs)."""
    ends = end_times[skip:]
    return [b - a for a, b in zip(ends, ends[1:])]


def run_dsforge(work: Path, overrides: list[str], steps: int, timeout_s: float) -> list[float]:
    run_dir = work / "dsforge"
    command = [sys.executable, "-m", "dsforge", "run", str(ROOT / "recipes" / "tiny.yaml"), "--world-size", "2",
               "--run-dir", str(run_dir), "--set", f"train.steps={steps}"]
    for item in overrides:
        command += ["--set", item]
    run_group(command, work / "dsforge.log", timeout_s)
    records, _ = read_metrics(RunDir(run_dir).metrics)
    return [r["ended_at"] for r in records]


def run_handwritten(work: Path, arguments: list[str], steps: int, timeout_s: float) -> list[float]:
    out = work / "handwritten.json"
    command = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
               "--master_port", str(free_port()), str(HANDWRITTEN), "--steps", str(steps),
               "--out", str(out), *arguments]
    run_group(command, work / "handwritten.log", timeout_s)
    return json.loads(out.read_text())["step_end_times"]


def measure(layout: str, args) -> dict:
    overrides, arguments = LAYOUTS[layout]
    sides = {"dsforge": [], "handwritten": []}
    per_repeat = []
    for repeat in range(args.repeats):
        order = ["dsforge", "handwritten"] if repeat % 2 == 0 else ["handwritten", "dsforge"]
        medians = {}
        for side in order:
            with tempfile.TemporaryDirectory(prefix=f"overhead-{side}-") as tmp:
                if side == "dsforge":
                    ends = run_dsforge(Path(tmp), overrides, args.steps, args.timeout)
                else:
                    ends = run_handwritten(Path(tmp), arguments, args.steps, args.timeout)
            measured = periods(ends, args.skip)
            sides[side] += measured
            medians[side] = statistics.median(measured)
        per_repeat.append(medians)
        print(f"{layout} repeat {repeat}: dsforge {medians['dsforge'] * 1e3:.1f} ms, "
              f"hand-written {medians['handwritten'] * 1e3:.1f} ms", flush=True)
    dsforge, handwritten = statistics.median(sides["dsforge"]), statistics.median(sides["handwritten"])
    return {"layout": layout, "dsforge_ms": dsforge * 1e3, "handwritten_ms": handwritten * 1e3,
            "ratio": dsforge / handwritten, "per_repeat": per_repeat,
            "steps_measured": len(sides["dsforge"])}


def table(results: list[dict]) -> str:
    lines = ["| layout | dsforge ms/step | hand-written ms/step | ratio | per-repeat ratios |",
             "|---|---|---|---|---|"]
    for r in results:
        ratios = ", ".join(f"{m['dsforge'] / m['handwritten']:.3f}" for m in r["per_repeat"])
        lines.append(f"| {r['layout']} | {r['dsforge_ms']:.1f} | {r['handwritten_ms']:.1f} | "
                     f"{r['ratio']:.3f} | {ratios} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the figures")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side per layout")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    unknown = [name for name in args.layouts.split(",") if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.steps - args.skip < 3:
        parser.error(f"--steps {args.steps} with --skip {args.skip} leaves too few steps to time")
    results = [measure(layout, args) for layout in args.layouts.split(",")]
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
