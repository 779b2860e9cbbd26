"""How a rank measures its steps: the step breakdown's clock and timings (breakdown.py), the
FLOPs that MFU counts, the live-tensor censuses `dsforge bench` asks for, and what only this
rank knows at the end (RUN_DIR/ranks/rankNNNNN.json: its memory, bubble and breakdown).
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from dsforge.data.documents import attention_share
from dsforge.estimate.flops import flops_per_token
from dsforge.files import write_atomic
from dsforge.hardware import gpu_for_device_name
from dsforge.job.metrics_file import median_breakdown
from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text
from dsforge.recipe import Resolved
from dsforge.runtime.loop import breakdown
from dsforge.runtime.loop.metrics import StepRecord, make_record
from dsforge.runtime.loop.timers import median_bubble


class StepMeter:
    def __init__(self, resolved: Resolved, *, device: torch.device, census: bool,
                 first_timed_step: int, warn: Callable[[str], None]):
        """`first_timed_step`: the first step of this process's timings (its first
        train.timing_warmup steps warm it up, a resumed run's as a new run's: its allocator,
        caches and kernels are cold). `census`: take the live-tensor censuses (dsforge
        bench). `warn`: where a measurement problem is said, once."""
        recipe = resolved.recipe
        # The step breakdown, in every run unless DSFORGE_BREAKDOWN=off; None turns it off
        # for the steps that follow (the overhead benchmark alternates).
        marks = breakdown.mode()
        self.clock = None if marks == "off" else breakdown.StepClock(device, gathers=marks == "gathers")
        self.timings = breakdown.StepTimings()
        self.flops = flops_per_token(recipe.model, recipe.train.seq_len,
                                     recipe.train.activation_checkpointing)
        gpu = gpu_for_device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        # None: MFU not shown. Under train.fp8 the GEMMs run against float8's peak and the rest
        # against bf16's, so no one peak makes a meaningful figure (torchtitan hides it too).
        self.peak_flops = gpu.peak_bf16_flops if gpu and recipe.train.fp8 == "none" else None
        self.resolved, self.device = resolved, device
        self.census, self.first_timed_step = census, first_timed_step
        self.censuses: dict[str, dict[str, int]] = {}  # point of the step -> live tensor bytes
        self._warn, self._warned = warn, False

    def phases(self, step: int, marked, elapsed: float) -> dict[str, float] | None:
        """The step's breakdown from the clock's marks (None when it was not measured)."""
        if marked is None:
            if self.clock is not None:
                self.warn(f"step breakdown: {step_text(step)} not measured: {self.clock.problem}")
            return None
        reading = self.timings.add(step, marked, elapsed)
        if self.timings.problem:
            self.warn(self.timings.problem)
        return reading.phases if reading else None

    def record(self, step: int, seen, *, lr: float, elapsed: float, ended_at: float,
               data_time: float, phases: dict[str, float] | None,
               loss_scale: float | None) -> StepRecord:
        """The step's metrics record from what every rank saw of it (health.StepView)."""
        layout, train = self.resolved.layout, self.resolved.recipe.train
        within = self._within_documents(seen.score_pairs)
        # A skipped update's norm is DeepSpeed's overflow sentinel (inf), not a measurement.
        return make_record(
            step=step, warmup=step < self.first_timed_step, loss=seen.loss,
            grad_norm=None if seen.skipped else seen.grad_norm, lr=lr, skipped=seen.skipped,
            step_time_s=elapsed, tokens_per_step=layout.global_batch * train.seq_len,
            world_size=layout.world_size, flops_per_token=self.flops.model,
            hardware_flops_per_token=self.flops.hardware, peak_flops=self.peak_flops,
            device=self.device, ended_at=ended_at, loss_scale=loss_scale,
            data_time_s=data_time, breakdown_s=phases, **within)

    def _within_documents(self, score_pairs: float) -> dict:
        """With documents masked, the step's share of the score matrices within its
        documents and the model FLOPs a token counting attention there (make_record's
        arguments); {} otherwise. `mfu` keeps the whole sequences' count (docs/flops.md)."""
        recipe = self.resolved.recipe
        if not recipe.data.document_masking:
            return {}
        share = attention_share(score_pairs, self.resolved.layout.global_batch,
                                recipe.train.seq_len)
        flops = flops_per_token(recipe.model, recipe.train.seq_len,
                                recipe.train.activation_checkpointing, attention_share=share)
        return {"attention_share": share, "document_flops_per_token": flops.model}

    def warn(self, problem: str) -> None:
        """Once per run: what went wrong measuring a step (a measurement bug, not training's):
        marks that do not pair up, or phases adding up to more than the step."""
        if not self._warned:
            self._warned = True
            self._warn(problem)

    def census_hook(self, step: int, start_step: int, engine) -> Callable[[str], None] | None:
        """The census inside step `step`, with `census`: on the last step left out of the
        timings (walking every live object takes longer than a tiny step), else the first."""
        if not self.census or step != max(start_step, self.first_timed_step - 1):
            return None
        from dsforge.runtime.loop.tensor_census import live_tensor_bytes

        def take(point: str) -> None:
            census = live_tensor_bytes(engine, self.device)
            # A point may repeat (ZeRO-3 steps the optimizer once per sub-group): keep its largest.
            if census["total"] >= self.censuses.get(point, {}).get("total", -1):
                self.censuses[point] = census
        return take

    def write_rank_summary(self, run_dir: RunDir, engine) -> None:
        """RUN_DIR/ranks/rankNNNNN.json: what only this rank knows (its memory, its bubble)."""
        from megatron.core import parallel_state as ps

        from dsforge.runtime.guard.oom import peak_memory

        memory, source = peak_memory(self.device)
        readings = self._timed_readings()
        summary = {"rank": torch.distributed.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                   "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank(),
                   "peak_memory_bytes": memory, "memory_source": source,
                   "bubble_share": median_bubble(readings),
                   "breakdown_s": median_breakdown(r.phases for r in readings),
                   "tensor_bytes": self._tensor_census(engine),
                   **{f"tensor_bytes_{point}": census for point, census in self.censuses.items()}}
        path = run_dir.rank_summary(summary["rank"])
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, json.dumps(summary) + "\n")

    def _timed_readings(self) -> list[breakdown.Reading]:
        """This rank's step breakdowns after the warmup steps (all of them if every step was
        one), once the device has finished the last step."""
        self.timings.finish()
        readings = self.timings.readings
        if self.timings.problem:  # readings made late (a rank without the loss) included
            self.warn(self.timings.problem)
        return [r for step, r in readings.items() if step >= self.first_timed_step] \
            or list(readings.values())

    def _tensor_census(self, engine) -> dict[str, int] | None:
        """Live model-state tensors after training, for `dsforge bench` (tensor_census.py)."""
        if not self.census:
            return None
        from dsforge.runtime.loop.tensor_census import live_tensor_bytes

        return live_tensor_bytes(engine, self.device)
