"""Step time against microbatches per step, ZeRO 1/2/3 under 1F1B on CPU, next to the
planner's extra data-parallel traffic (dsforge/cost/step_time.py `dp_traffic`).

    dsforge bench recipes/bench/zero_microbatch_study_cpu.yaml --out benchmarks/zero_microbatch_cpu
    python benchmarks/zero_microbatch_cpu/analyse.py benchmarks/zero_microbatch_cpu/results.db

For each stage: the least-squares slope of the median step time over m (seconds per
microbatch), and the extra over ZeRO-1's slope. The planner's extra per microbatch is
`dp_traffic(stage, m)`'s per-microbatch units (ZeRO-2: 1, ZeRO-3: 3) x (d-1)/d x the bytes of
the pipeline rank's gradients (fp32 here), at the bandwidth this machine's gloo measures for a
ring all-reduce of those bytes between two local processes (an all-reduce moves 2 (d-1)/d of
them, a reduce-scatter or all-gather one). ZeRO-1 reduces once per step, so its slope is the
compute and pipeline cost of a microbatch, which the other stages pay too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsforge.bench.report import aggregate
from dsforge.bench.store import Store
from dsforge.cost.step_time import dp_traffic

def gradient_bytes(cells: list[dict]) -> float:
    """The worst pipeline rank's gradient bytes as the planner counts them for ZeRO-1 (whole
    gradients in the training dtype): the bytes ZeRO-2 reduce-scatters after every backward."""
    return max(c["prediction"]["memory_bytes"]["grads"] for c in cells
               if c["axes"]["zero.stage"] == 1 and c["prediction"])


def _all_reduce_worker(rank: int, init: str, numel: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    tensor = torch.ones(numel)
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times[2:]))
    dist.destroy_process_group()


def all_reduce_seconds(nbytes: float, repeats: int = 20) -> float:
    """Median time of a gloo all-reduce of `nbytes` of fp32 between two local processes."""
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [context.Process(target=_all_reduce_worker, args=(r, init, int(nbytes // 4), repeats, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        seconds = out.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    return seconds


def slopes(cells: list[dict]) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """Per ZeRO stage: (seconds per microbatch, [(m, median step seconds)])."""
    points: dict[int, list[tuple[int, float]]] = {}
    for cell in cells:
        if cell["status"] != "ok":
            continue
        m = cell["axes"]["train.global_batch"] // 2  # dp 2, micro-batch 1
        points.setdefault(cell["axes"]["zero.stage"], []).append((m, cell["step_time_median"]))
    fitted = {}
    for stage, pts in sorted(points.items()):
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in pts) / sum((x - mean_x) ** 2 for x in xs)
        fitted[stage] = (slope, pts)
    return fitted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", type=Path)
    args = parser.parse_args()
    cells = aggregate(Store(args.db).rows())
    fitted = slopes(cells)
    if 1 not in fitted:
        print("no ok ZeRO-1 cells in the study", file=sys.stderr)
        return 1
    grads = gradient_bytes(cells)
    all_reduce = all_reduce_seconds(grads)
    one_pass = all_reduce / 2  # a reduce-scatter or all-gather: half a ring all-reduce's bytes
    print(f"pipeline rank gradients (planner, ZeRO-1): {grads / 2**20:.2f} MiB fp32; gloo all-reduce of them: "
          f"{all_reduce * 1e3:.2f} ms (median of 20), so one reduce-scatter ~ {one_pass * 1e3:.2f} ms")
    print("| ZeRO | step ms at m = " + ", ".join(str(m) for m, _ in fitted[1][1])
          + " | ms per microbatch | extra over ZeRO-1 | planner's extra | measured / planner |")
    print("|---|---|---|---|---|---|")
    for stage, (slope, pts) in fitted.items():
        per_microbatch, _ = dp_traffic(stage, 1)
        predicted = per_microbatch * one_pass
        extra = slope - fitted[1][0]
        ratio = f"{extra / predicted:.2f}" if predicted else "-"
        print(f"| {stage} | " + ", ".join(f"{t * 1e3:.1f}" for _, t in pts)
              + f" | {slope * 1e3:.2f} | {extra * 1e3:+.2f} | {predicted * 1e3:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
