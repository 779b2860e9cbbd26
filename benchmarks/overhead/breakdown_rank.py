"""One rank of the step-breakdown overhead benchmark; tools/bench_breakdown.py launches it with
DeepSpeed's launcher, like dsforge launches its ranks:

    python -m deepspeed.launcher.runner --num_gpus 2 benchmarks/overhead/breakdown_rank.py \
        --recipe recipes/tiny.yaml --steps 100 --out /tmp/breakdown.json

dsforge's own Trainer trains the recipe; consecutive steps form pairs, one step with the
step breakdown (runtime/loop/breakdown.py) and one without, in alternating order (on-off, off-on,
...), so drift in the machine's speed hits both sides alike. A step's time is its whole
`train_step` as the loop sees it: the engine hooks installed and removed, the marks, reading
them, the metrics record. The reporting rank (its step ends with the loss's .item(), so on a
GPU its time includes the device's work) writes the times and each measured step's marks.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher adds it
    return parser.parse_args()


def breakdown_on(step: int) -> bool:
    """Pairs (0, 1), (2, 3), ...: on first in even pairs, off first in odd ones."""
    return (step % 2 == 0) == ((step // 2) % 2 == 0)


def main() -> None:
    args = parse_args()
    import torch

    from dsforge.job.run_dir import RunDir
    from dsforge.recipe import resolve_file
    from dsforge.runtime.loop.trainer import Trainer
    from dsforge.runtime.rank import pick_device, threads_per_rank

    threads = threads_per_rank()
    if threads is not None:
        torch.set_num_threads(threads)
    device, backend = pick_device("auto", "auto")
    resolved = resolve_file(args.recipe, [*args.overrides, f"train.steps={args.steps}"],
                            world_size=int(os.environ["WORLD_SIZE"]))
    with tempfile.TemporaryDirectory(prefix="breakdown-bench-") as run_dir:
        trainer = Trainer(resolved, device=device, backend=backend, run_dir=RunDir(run_dir),
                          collective_timeout_s=600)
        clock = trainer.meter.clock
        rows = [_timed_step(trainer, step, clock) for step in range(args.steps)]
        fixed = fixed_cost(trainer, clock)
    if trainer.reporter:
        Path(args.out).write_text(json.dumps({"device": str(device), "steps": rows,
                                              "fixed_s": fixed}) + "\n")


def _timed_step(trainer, step: int, clock) -> dict:
    on = breakdown_on(step)
    trainer.meter.clock = clock if on else None
    started = time.perf_counter()
    trainer.train_step(step)
    seconds = time.perf_counter() - started
    reading = trainer.meter.timings.readings.get(step) if on else None
    return {"step": step, "on": on, "seconds": seconds,
            "marks": reading.marks if reading else None}


def fixed_cost(trainer, clock, rounds: int = 500) -> float:
    """Host seconds per step that the breakdown costs besides its marks, on this engine:
    installing and removing its hooks, starting and stopping the clock, reading a step
    without marks and writing its phases into the record's JSON."""
    from dsforge.runtime.loop.breakdown import StepTimings
    from dsforge.runtime.loop.phase_hooks import marking

    timings = StepTimings()
    started = time.perf_counter()
    for step in range(rounds):
        clock.start()
        with marking(clock, trainer.engine, trainer.chunks):
            pass
        reading = timings.add(step, clock.stop(), step_time_s=1.0)
        json.dumps(reading.phases)
    return (time.perf_counter() - started) / rounds


if __name__ == "__main__":
    main()
