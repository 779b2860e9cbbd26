"""A torch profiler trace of training steps A to B of rank 0: `tracking.profile: "A:B"`, or
`dsforge run ... --profile A:B` (docs/tracking.md#profiler-traces).

Steps are numbered as metrics.jsonl numbers them (0-based). The profiler starts one step
before A when the run has one (a warm-up step whose events are dropped: the profiler's own
start-up does not land in step A), records A..B with CPU activity and, on a GPU, CUDA kernels,
and writes one Chrome-trace file, gzipped, that both TensorBoard's profiler plugin and Perfetto
open: RUN_DIR/profile/rank0-stepsA-B.pt.trace.json.gz. Each step is a range named
"dsforge step N" in the trace. Shapes and Python stacks are not recorded (small files).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

from dsforge.files import fsync_directory
from dsforge.job.run_dir import RunDir


def trace_path(run_dir: RunDir, first: int, last: int) -> Path:
    return run_dir.profile / f"rank0-steps{first}-{last}.pt.trace.json.gz"


def open_profiler(steps: tuple[int, int] | None, *, run_dir: RunDir, start_step: int,
                  device: torch.device, say: Callable[[str], None]) -> "StepProfiler | None":
    """The profiler of this rank: None unless it is rank 0 and the run trains a traced step."""
    if steps is None or torch.distributed.get_rank() != 0:
        return None
    first, last = steps
    if last < start_step:
        say(f"dsforge: tracking.profile {first}:{last}: this run starts at step {start_step}, "
            "after the traced steps; no trace is written")
        return None
    return StepProfiler(max(first, start_step), last, start_step=start_step, run_dir=run_dir,
                        device=device, say=say)


class StepProfiler:
    """`with profiler.step(n): <train step n>` for every step of the run."""

    def __init__(self, first: int, last: int, *, start_step: int, run_dir: RunDir,
                 device: torch.device, say: Callable[[str], None]):
        self.first, self.last, self.run_dir, self.say = first, last, run_dir, say
        self._warmup = 1 if first > start_step else 0
        self._cuda = device.type == "cuda"
        self._profile: torch.profiler.profile | None = None
        self._done: int | None = None  # the last step finished under the profiler

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        if n == self.first - self._warmup:
            self._start()
        if self._profile is None:
            yield
            return
        with torch.profiler.record_function(f"dsforge step {n}"):
            yield
        self._done = n
        self._profile.step()  # after step B this writes the trace (the schedule's end)
        if n == self.last:
            self.close()

    def close(self) -> None:
        """Stop profiling (at step B, or at the end of a run stopped before it)."""
        if self._profile is not None:
            profile, self._profile = self._profile, None
            profile.stop()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no warmup" when step A is the run's first
            schedule = torch.profiler.schedule(wait=0, warmup=self._warmup,
                                               active=self.last - self.first + 1, repeat=1)
        self._profile = torch.profiler.profile(activities=activities, schedule=schedule,
                                               on_trace_ready=self._write, record_shapes=False,
                                               with_stack=False, profile_memory=False)
        self._profile.start()

    def _write(self, profile: torch.profiler.profile) -> None:
        if self._done is None or self._done < self.first:
            return  # stopped before a traced step finished
        path = trace_path(self.run_dir, self.first, self._done)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.parent / f"{path.stem}.partial.gz"  # the .gz tells torch to compress
        profile.export_chrome_trace(str(partial))
        os.replace(partial, path)
        fsync_directory(path.parent)
        self.say(f"dsforge: profiler trace of steps {self.first}-{self._done} (rank 0): {path} "
                 f"(open it at ui.perfetto.dev, or: pip install torch-tb-profiler; "
                 f"tensorboard --logdir {path.parent})")
