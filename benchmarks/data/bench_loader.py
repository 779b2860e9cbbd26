#!/usr/bin/env python3
"""What making the microbatches of a step costs when training on an indexed blend
(benchmarks/data/README.md, "Loader cost per step").

    python benchmarks/data/bench_loader.py [--copies 50] [--steps 60] [--runs 1]
                                           [--direct-steps 200] [--work DIR]

Makes in DIR (a temporary folder, removed at the end, unless given):
- tempest50.jsonl: data/tempest.jsonl (784 speeches) repeated --copies times, prepared with
  `dsforge data prepare ... --tokenizer bytes` into the dataset tempest50 (B);
then, with A = the shipped data/tempest dataset:
1. trains recipes/smoke.yaml (2 CPU ranks, dp 2, 16 x 128-token sequences per step, micro
   batch 4, so 2 microbatches of 4 per rank per step) on the blend 0.7 A + 0.3 B, --runs times:
       dsforge run recipes/smoke.yaml --device cpu --set 'data.source=[{path: A, weight: 0.7},
           {path: B, weight: 0.3}]' --set train.steps=60 --set data.cache_dir=DIR/cache
           --run-dir DIR/run-N
   and reads DIR/run-N/metrics.jsonl (dsforge.job.metrics_file.read_metrics): for every measured
   (non-warmup) step, data_time_s / step_time_s (data_time_s is the reporting rank's time to
   make its microbatches, inside step_time_s); prints the median and p90 of that share and the
   medians of both times;
2. in this process, with no process group and no model: the same blend built as the runtime
   builds it (dsforge.data.samples.build_splits + MegatronSamples, the recipe's seed, split,
   seq_len and a --direct-steps step run), then times dsforge.runtime.loop.data.microbatches for
   --direct-steps steps of dp rank 0 (the reporting rank's share of a step); the same for
   dataset A alone and for synthetic tokens, for comparison.
Prints the figures and writes results_loader.json beside this script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ENV, RECIPE, REPO, TEMPEST, loadavg  # noqa: E402 (beside this script)


def dsforge(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dsforge", *args]
    done = subprocess.run(command, env=ENV, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def quantile(values: list[float], q: float) -> float:
    """The q-quantile, linear between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def prepare_b(work: Path, copies: int) -> Path:
    jsonl = work / f"tempest{copies}.jsonl"
    text = (REPO / "data" / "tempest.jsonl").read_text()
    jsonl.write_text(text * copies)
    prefix = work / f"tempest{copies}"
    done = dsforge("data", "prepare", str(jsonl), "--tokenizer", "bytes", "--output", str(prefix),
                   "--no-progress", "--overwrite")
    print(done.stdout.strip() or done.stderr.strip())
    return prefix


def blend_override(a: Path, b: Path) -> str:
    return f"data.source=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]"


def train(work: Path, a: Path, b: Path, steps: int, run: int) -> dict:
    from dsforge.job.metrics_file import read_metrics
    from dsforge.job.run_dir import RunDir

    run_dir = work / f"run-{run}"
    shutil.rmtree(run_dir, ignore_errors=True)
    before = loadavg()
    started = time.perf_counter()
    done = dsforge("run", str(RECIPE), "--device", "cpu", "--set", blend_override(a, b),
                   "--set", f"train.steps={steps}", "--set", f"data.cache_dir={work / 'cache'}",
                   "--run-dir", str(run_dir))
    wall = time.perf_counter() - started
    after = loadavg()
    records, validations = read_metrics(RunDir(run_dir).metrics)
    measured = [r for r in records if not r["warmup"]]
    shares = [r["data_time_s"] / r["step_time_s"] for r in measured]
    data_line = next((line for line in (done.stdout + done.stderr).splitlines()
                      if line.startswith("dsforge: data:")), "")
    # The line names the index cache inside WORK, a scratch folder of this machine: the
    # record says <work> instead, as the GPU kit's records do.
    data_line = data_line.replace(str(work), "<work>")
    return {"run": run, "steps": len(records), "measured_steps": len(measured),
            "validations": len(validations),
            "share_median": statistics.median(shares), "share_p90": quantile(shares, 0.9),
            "share_max": max(shares),
            "data_time_ms_median": 1e3 * statistics.median(r["data_time_s"] for r in measured),
            "data_time_ms_p90": 1e3 * quantile([r["data_time_s"] for r in measured], 0.9),
            "step_time_ms_median": 1e3 * statistics.median(r["step_time_s"] for r in measured),
            "wall_s": wall, "loadavg_before": before, "loadavg_after": after,
            "data_line": data_line}


def direct(work: Path, a: Path, b: Path, steps: int) -> list[dict]:
    """microbatches() of dp rank 0 for `steps` steps, in this process, per source."""
    import torch

    from dsforge.data.indexed import inspect_dataset
    from dsforge.data.samples import MegatronSamples, build_splits
    from dsforge.recipe import resolve_file
    from dsforge.runtime.loop.data import SyntheticTokens, microbatches

    torch.set_num_threads(1)  # a rank of the smoke run has one core
    results = []
    for name, override in (("blend 0.7 A + 0.3 B", blend_override(a, b)),
                           ("A alone (data/tempest)", f"data.source={a}"),
                           ("synthetic", "data.source=synthetic")):
        resolved = resolve_file(RECIPE, [override, f"train.steps={steps}", "data.tokenizer=null"]
                                if override.endswith("synthetic") else
                                [override, f"train.steps={steps}"])
        recipe, layout = resolved.recipe, resolved.layout
        train, data = recipe.train, recipe.data
        build_s = 0.0
        if data.kind == "synthetic":
            source = SyntheticTokens(seq_len=train.seq_len, vocab_size=recipe.model.vocab_size,
                                     seed=train.seed)
        else:
            parts = [(part.path, part.weight) for part in data.blend]
            started = time.perf_counter()
            splits = build_splits(
                parts, split=data.split, seq_len=train.seq_len, seed=train.seed,
                train_samples=train.steps * layout.global_batch,
                validation_samples=train.eval_iters * layout.global_batch,
                identity=inspect_dataset(parts[0][0]).identity, cache_dir=work / "cache-direct")
            build_s = time.perf_counter() - started
            source = MegatronSamples(splits.train, what="training samples")
        times = []
        for step in range(steps):
            started = time.perf_counter()
            microbatches(source, step=step, global_batch=layout.global_batch,
                         micro_batch=layout.micro_batch, grad_accum=layout.grad_accum, dp=layout.dp,
                         dp_rank=0, vocab_size=recipe.model.vocab_size)
            times.append(time.perf_counter() - started)
        samples = layout.grad_accum * layout.micro_batch
        results.append({"source": name, "steps": steps, "samples_per_step": samples,
                        "build_splits_s": build_s,
                        "first_step_ms": 1e3 * times[0],
                        "median_ms": 1e3 * statistics.median(times),
                        "p90_ms": 1e3 * quantile(times, 0.9),
                        "median_us_per_sample": 1e6 * statistics.median(times) / samples})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=50)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--direct-steps", type=int, default=200)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="dsforge-bench-loader-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"load average at start: {loadavg()} ({os.cpu_count()} CPUs)")
        b = prepare_b(work, args.copies)
        runs = [train(work, TEMPEST, b, args.steps, run) for run in range(1, args.runs + 1)]
        print("\n1. dsforge run recipes/smoke.yaml on the blend 0.7 data/tempest + 0.3 "
              f"tempest x{args.copies} ({args.steps} steps, CPU, dp 2):")
        for r in runs:
            print(f"   run {r['run']}: {r['measured_steps']} measured steps: data_time/step_time "
                  f"median {100 * r['share_median']:.2f}%, p90 {100 * r['share_p90']:.2f}%, "
                  f"max {100 * r['share_max']:.2f}%; median data_time {r['data_time_ms_median']:.2f} "
                  f"ms (p90 {r['data_time_ms_p90']:.2f}), median step_time "
                  f"{r['step_time_ms_median']:.1f} ms; load {r['loadavg_before']} -> "
                  f"{r['loadavg_after']}")
            print(f"   {r['data_line']}")
        before = loadavg()
        isolated = direct(work, TEMPEST, b, args.direct_steps)
        after = loadavg()
        print(f"\n2. microbatches() alone, dp rank 0 (2 microbatches x 4 samples x 129 tokens), "
              f"{args.direct_steps} steps, one thread; load {before} -> {after}:")
        for r in isolated:
            built = f", build_splits {r['build_splits_s']:.2f} s" if r["build_splits_s"] else ""
            print(f"   {r['source']:<24} median {r['median_ms']:.3f} ms/step (p90 {r['p90_ms']:.3f}, "
                  f"first {r['first_step_ms']:.2f}), {r['median_us_per_sample']:.1f} us/sample{built}")
        results = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                   "python": platform.python_version(), "copies": args.copies,
                   "runs": runs, "direct": isolated, "direct_loadavg": [before, after]}
        out = Path(__file__).with_name("results_loader.json")
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nraw figures: {out}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
