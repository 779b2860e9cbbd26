"""One dsforge against another on the same run: the step time of two checkouts, paired.

Each side is a dsforge source tree (a `git worktree add DIR COMMIT` of the commit to compare);
runs alternate (A B, A B, ...) so drift in the machine's speed hits both alike. Printed per side:
the median step time and loop period (time between the ends of consecutive steps) over every
measured step of every repeat, the median of each step-breakdown phase, and each repeat's
median step time, the ratio of each pair last.

    git worktree add /tmp/before 150444d
    python tools/step_time_ab.py /tmp/before . --repeats 4 -- recipes/tiny.yaml --set train.steps=80
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dsforge.job.metrics_file import PHASES, read_metrics
from dsforge.job.run_dir import RunDir

PHASES_SHOWN = [p for p in PHASES if p != "data"]


def run_side(tree: Path, run_args: list[str], run_dir: Path) -> list[dict]:
    """One `dsforge run` with `tree`'s dsforge first on the path, started outside both trees
    (`python -m` puts the working directory first); its measured step records."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
    args = [str(Path(a).resolve()) if Path(a).is_file() else a for a in run_args]
    done = subprocess.run([sys.executable, "-m", "dsforge", "run", *args, "--run-dir",
                           str(run_dir)], env=env, capture_output=True, text=True, timeout=1800,
                          cwd=run_dir.parent)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: dsforge run exited {done.returncode}:\n{done.stderr[-2000:]}")
    return [r for r in read_metrics(RunDir(run_dir).metrics)[0] if not r["warmup"]]


def summary(repeats: list[list[dict]]) -> dict:
    steps = [r for records in repeats for r in records]
    periods = [b["ended_at"] - a["ended_at"] for records in repeats
               for a, b in zip(records, records[1:])]
    phases = {p: statistics.median((r["breakdown_s"] or {}).get(p, 0.0) for r in steps)
              for p in PHASES_SHOWN}
    return {"step_ms": statistics.median(r["step_time_s"] for r in steps) * 1e3,
            "period_ms": statistics.median(periods) * 1e3,
            "phases_ms": {p: s * 1e3 for p, s in phases.items()},
            "repeats_ms": [statistics.median(r["step_time_s"] for r in records) * 1e3
                           for records in repeats]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the first dsforge tree")
    parser.add_argument("b", type=Path, help="the second dsforge tree")
    parser.add_argument("--repeats", type=int, default=4)
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        parser.error("give the run after --: -- RECIPE [--set k=v ...]")
    split = argv.index("--")
    args, run_args = parser.parse_args(argv[:split]), argv[split + 1:]
    results: dict[str, list[list[dict]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for side, tree in (("a", args.a), ("b", args.b)):
                run_dir = Path(scratch) / f"{side}{repeat}"
                results[side].append(run_side(tree, run_args, run_dir))
    sides = {side: summary(repeats) for side, repeats in results.items()}
    for side, tree in (("a", args.a), ("b", args.b)):
        s = sides[side]
        print(f"{side} ({tree}): step {s['step_ms']:.2f} ms, loop period {s['period_ms']:.2f} ms; "
              + ", ".join(f"{p} {ms:.2f}" for p, ms in s["phases_ms"].items())
              + "; repeats " + ", ".join(f"{ms:.2f}" for ms in s["repeats_ms"]))
    ratios = [b / a for a, b in zip(sides["a"]["repeats_ms"], sides["b"]["repeats_ms"])]
    print(f"b / a: step {sides['b']['step_ms'] / sides['a']['step_ms']:.3f}, loop period "
          f"{sides['b']['period_ms'] / sides['a']['period_ms']:.3f}; per repeat "
          + ", ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
