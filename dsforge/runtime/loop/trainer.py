"""A rank's training: the parts from engine.build_rank, the data, steps with metrics, and
`train_loop`, the loop both `dsforge run`'s ranks and the distributed tests' worker run."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, replace
from typing import Callable

import torch

from dsforge.ckpt.trust import CheckpointError, latest_complete, resumed_changes
from dsforge.estimate.flops import flops_per_token
from dsforge.files import write_atomic
from dsforge.hardware import gpu_for_device_name
from dsforge.job.console import RankConsole
from dsforge.job.metrics_file import median_breakdown
from dsforge.job.run_dir import RunDir
from dsforge.recipe import Resolved
from dsforge.runtime.assemble.engine import build_rank
from dsforge.runtime.checkpoint import save_load as checkpoint
from dsforge.runtime.guard import health
from dsforge.runtime.guard.preempt import Stopped, Stopper
from dsforge.runtime.loop import bad_steps, breakdown
from dsforge.runtime.loop import data as data_mod
from dsforge.runtime.loop import step as step_mod
from dsforge.runtime.loop.bad_steps import Halted
from dsforge.runtime.loop.metrics import (MetricsWriter, format_breakdown, format_summary,
                                          make_record)
from dsforge.runtime.loop.phase_hooks import marking
from dsforge.runtime.loop.profiler import open_profiler
from dsforge.runtime.loop.timers import median_bubble
from dsforge.runtime.loop.tracking import open_tracker
from dsforge.runtime.assemble.compile import CompileReport
from dsforge.translate.compiled import compiled_with
from dsforge.runtime.startup import StartupClock
from dsforge.units import MiB


class Trainer:
    def __init__(self, resolved: Resolved, *, device: torch.device, backend: str, run_dir: RunDir,
                 collective_timeout_s: float, resume: bool = False, census: bool = False,
                 console: RankConsole | None = None, startup: StartupClock | None = None,
                 restarts: list[dict] | None = None):
        # Without a clock from runtime/rank.py (the distributed tests' worker), start-up is
        # counted from here.
        self.startup = startup or StartupClock()
        self.resolved, self.device, self.run_dir = resolved, device, run_dir
        self.census = census  # take the live-tensor censuses (dsforge bench)
        self.restarts = restarts or []  # the job's restarts before this attempt (summary.json)
        self.censuses: dict[str, dict[str, int]] = {}  # point of the step -> live tensor bytes
        self.console = console or RankConsole(marked=False)
        recipe = resolved.recipe
        # Before the process group exists: dataset indices are built once per node under a
        # file lock, in a private world (dsforge/data/samples.py).
        self.sources = data_mod.open_sources(resolved)
        if self.sources.note and int(os.environ.get("RANK", 0)) == 0:
            self.console.say(f"dsforge: {self.sources.note}")
        self.startup.mark("data")
        parts = build_rank(resolved, device=device, backend=backend, timeout_s=collective_timeout_s,
                           startup=self.startup)
        self.chunks, self.engine, self.kernels = parts.chunks, parts.engine, parts.kernels
        self.experts = parts.experts
        # The step breakdown (runtime/loop/breakdown.py), in every run unless DSFORGE_BREAKDOWN=off;
        # None turns it off for the steps that follow (the overhead benchmark alternates).
        marks = breakdown.mode()
        self.clock = None if marks == "off" else breakdown.StepClock(device, gathers=marks == "gathers")
        self.timings = breakdown.StepTimings()
        self._breakdown_warned = False
        self.flops = flops_per_token(recipe.model, recipe.train.seq_len,
                                     recipe.train.activation_checkpointing)
        gpu = gpu_for_device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.peak_flops = gpu.peak_bf16_flops if gpu else None  # None: MFU not available
        self.guard = health.Guard(recipe.train)
        self.compiled = CompileReport() if recipe.model.compile == "layers" else None
        self.halted: Halted | None = None  # set when the ranks stop because training went bad
        self.last_step_bad = False  # the last step was non-finite (its update dropped)
        self.resumed: dict | None = None  # the checkpoint's record and what changed, on resume
        self.start_step = self._resume() if resume else 0
        if resume:
            self.startup.mark("resume")
        self.profiler = open_profiler(recipe.tracking.profile_range, run_dir=run_dir,
                                      start_step=self.start_step, device=device,
                                      say=self.console.say)
        self.reporter = self._is_reporter()
        self._adds_loss = self._adds_to_mean_loss()
        self.metrics = MetricsWriter(run_dir.metrics) if self.reporter else None
        if self.reporter and resume:
            self.metrics.keep_steps_before(self.start_step)
        self.tracker = open_tracker(recipe, run_dir, resumed_at=self.start_step if resume else None,
                                    warn=lambda text: self.console.say(f"dsforge: warning: {text}")) \
            if self.reporter else None
        if self.reporter:
            self._write_manifest()
            self.console.say(f"dsforge: {self.startup.line()}")

    def _resume(self) -> int:
        root = self.run_dir.checkpoints
        record = latest_complete(root)
        if record is None:
            raise CheckpointError(f"no complete checkpoint under {root}")
        rank = torch.distributed.get_rank()
        recipe = asdict(self.resolved.recipe)
        step = checkpoint.load(self.engine, root, record["tag"], rank, recipe=recipe,
                               world_size=self.resolved.layout.world_size,
                               say=self.console.say if rank == 0 else None)
        self.resumed = {"after_step": step, "checkpoint": record["tag"],
                        "changes": resumed_changes(record["recipe"], recipe)}
        line = checkpoint.continue_schedule(self.engine, self.resolved.recipe.train,
                                            record["recipe"].get("train") or {})
        if line and rank == 0:
            self.console.say(line)
        return step

    def save_checkpoint(self, steps_done: int, fault=None) -> bool:
        """The checkpoint of `steps_done` steps; whether it was written. Not right after a bad
        step (its update was dropped: a resume must not start inside a run of bad steps), and
        not when a weight on some rank is not finite (the run then stops: `halted`)."""
        root = self.run_dir.checkpoints
        rank = torch.distributed.get_rank()
        if self.last_step_bad:
            if rank == 0:
                self.console.say(f"dsforge: no checkpoint after step {steps_done}: the update "
                                 "of its last step was skipped (non-finite); `latest` stays")
            return False
        bad_ranks = health.ranks_where(not health.weights_finite(self.engine.module), self.device)
        if bad_ranks:
            self.halted = Halted(step=steps_done - 1, kind="weights", ranks=bad_ranks,
                                 what=f"non-finite weights before the save of step {steps_done}"
                                      "; the checkpoint was not written")
            return False
        try:
            checkpoint.save(self.engine, root, step=steps_done, recipe=asdict(self.resolved.recipe),
                            world_size=self.resolved.layout.world_size,
                            rank=torch.distributed.get_rank(), fault=fault)
        except (OSError, RuntimeError) as exc:
            # torch's serializer reports a full disk as "basic_ios::clear", without a path.
            raise CheckpointError(
                f"could not write the checkpoint of step {steps_done} under {root}: {exc}. Is the "
                f"disk full? (df -h {root}); the previous complete checkpoint stays the latest"
            ) from exc
        return True

    def _adds_to_mean_loss(self) -> bool:
        """One rank per data-parallel (and context-parallel) replica adds its loss to the mean:
        on the last pipeline stage, tensor-parallel rank 0 (its tp peers hold the same loss)."""
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True) and \
            ps.get_tensor_model_parallel_rank() == 0

    def _is_reporter(self) -> bool:
        from megatron.core import parallel_state as ps

        return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank(with_context_parallel=True) == 0)

    def _batches(self, source, index: int) -> list[data_mod.Microbatch]:
        from megatron.core import parallel_state as ps

        layout = self.resolved.layout
        return data_mod.microbatches(source, step=index, global_batch=layout.global_batch,
                                     micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
                                     dp=layout.dp, dp_rank=ps.get_data_parallel_rank(),
                                     cp=layout.cp, cp_rank=ps.get_context_parallel_rank(),
                                     vocab_size=self.resolved.recipe.model.vocab_size)

    def _mean_over_replicas(self, loss: torch.Tensor) -> float:
        """The mean of a loss over the data-parallel replicas and the context-parallel shards
        (each the mean over as many tokens): one host sync."""
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group(with_context_parallel=True)
        torch.distributed.all_reduce(loss, group=group)
        return loss.item() / torch.distributed.get_world_size(group)

    def train_step(self, step: int) -> None:
        with self.profiler.step(step) if self.profiler else contextlib.nullcontext():
            self._train_step(step)

    def _train_step(self, step: int) -> None:
        clock = self.clock or breakdown.OFF
        start = time.perf_counter()  # the step's time includes making its batches
        clock.start()
        with clock.phase("data"):
            batches = self._batches(self.sources.train, step)
        data_time = time.perf_counter() - start
        lr = self.engine.get_lr()[0]  # the rate this step's update uses
        census = self._census_inside_step if self._takes_census(step) else None
        with marking(self.clock, self.engine, self.chunks) if self.clock else contextlib.nullcontext():
            loss = self._forward_backward_update(batches, census, clock)
        with clock.phase("guard"):
            reduced = health.reduce_step(health.loss_share(loss, adds_loss=self._adds_loss,
                                                           device=self.device))
        marked = clock.stop()
        if marked is None and self.clock is not None:
            self._warn_breakdown(f"step breakdown: step {step} not measured: {self.clock.problem}")
        layout = self.resolved.layout
        seen = health.view(reduced, replicas=layout.dp * layout.cp,  # waits for the device
                           grad_norm=self.engine.get_global_grad_norm(),
                           applied=self.engine.was_step_applied())
        elapsed = time.perf_counter() - start
        ended_at = time.time()
        reading = self.timings.add(step, marked, elapsed) if marked is not None else None
        if self.timings.problem:
            self._warn_breakdown(self.timings.problem)
        bad = self.guard.judge(step, seen)
        self.last_step_bad = bad is not None and bad.kind == "nonfinite"
        if self.compiled is not None:
            self._after_compiled_step(step)
        if self.reporter:
            self._report(step, seen, lr, elapsed, ended_at, data_time,
                         reading.phases if reading else None)
        if bad is not None:
            self._on_bad_step(bad, loss)

    def _after_compiled_step(self, step: int) -> None:
        """The compile time joins the start-up breakdown; a recompile after the warm-up is
        said once, by the rank it happened on (runtime/assemble/compile.py)."""
        said = self.compiled.after_step(step, warm=step >= self._first_timed_step())
        if self.compiled.compile_s is not None:
            self.startup.phases["compile"] = self.compiled.compile_s
        if said and (self.reporter or said.startswith("warning")):
            self.console.say(f"dsforge: {said} (rank {torch.distributed.get_rank()})")

    def _on_bad_step(self, bad: health.BadStep, loss: torch.Tensor | None) -> None:
        """Which ranks' losses were not finite (every rank takes part), then the reporting
        rank's line and record, and the stop when the run stops here."""
        ranks = health.ranks_where(not health.finite(loss), self.device) \
            if bad.kind == "nonfinite" else []
        data = None
        if self.reporter or (bad.action == "stop" and torch.distributed.get_rank() == 0):
            data = data_mod.step_data(self.sources.train, bad.step,
                                      self.resolved.layout.global_batch)
        if self.reporter:
            bad_steps.append_record(self.run_dir, bad_steps.record(bad, ranks, data))
            if bad.action != "stop":
                self.console.say(bad_steps.line(bad, ranks, data, self.guard.max_in_a_row))
        if bad.action == "stop":
            self.halted = Halted(step=bad.step, what=bad.what, kind=bad.kind, ranks=ranks,
                                 data=data, in_a_row=bad.in_a_row)

    def _warn_breakdown(self, problem: str) -> None:
        """Once per run: what went wrong measuring a step (a measurement bug, not training's):
        marks that do not pair up, or phases adding up to more than the step."""
        if not self._breakdown_warned:
            self._breakdown_warned = True
            self.console.say(f"dsforge: warning: {problem} (rank {torch.distributed.get_rank()})")

    def _forward_backward_update(self, batches, census, clock) -> torch.Tensor | None:
        layout, train = self.resolved.layout, self.resolved.recipe.train
        if layout.pp == 1:
            return step_mod.step_unpipelined(self.engine, batches, self.device, census=census,
                                             clock=clock)
        return step_mod.step_pipelined(self.engine, self.chunks, batches, seq_len=train.seq_len,
                                       micro_batch=layout.micro_batch, device=self.device,
                                       census=census, clock=clock)

    def evaluate(self, step: int, before_batch: Callable[[int], None] | None = None) -> None:
        """The validation loss after `step`: train.eval_iters global batches of held-out samples
        through forward passes only, on every rank (pipeline ranks run the forward-only
        schedule together). Changes no state training reads: no gradients, no update, no
        random numbers (eval mode), so training losses are the same with or without it."""
        layout, train = self.resolved.layout, self.resolved.recipe.train
        losses = []
        for chunk in self.chunks:
            chunk.eval()
        try:
            for index in range(train.eval_iters):
                if before_batch is not None:
                    before_batch(step)
                batches = self._batches(self.sources.validation, index)
                if layout.pp == 1:
                    loss = step_mod.eval_unpipelined(self.engine, batches, self.device)
                else:
                    loss = step_mod.eval_pipelined(self.chunks, batches, seq_len=train.seq_len,
                                                   micro_batch=layout.micro_batch, device=self.device)
                if loss is not None:
                    losses.append(loss)
        finally:
            for chunk in self.chunks:
                chunk.train()
            if self.compiled is not None:  # evaluation's graphs (no grad) are not recompiles
                self.compiled.rebaseline()
        if not losses:
            return
        val_loss = self._mean_over_replicas(torch.stack(losses).mean())
        if self.reporter:
            self.metrics.write_eval(step, val_loss)
            self.tracker.log_eval(step, val_loss)
            self.console.progress(name=self.resolved.recipe.name, step=step + 1,
                                  steps=train.steps, postfix=self._postfix())

    def _report(self, step: int, seen: health.StepView, lr: float, elapsed: float,
                ended_at: float, data_time: float, phases: dict[str, float] | None) -> None:
        recipe, layout = self.resolved.recipe, self.resolved.layout
        # A skipped update's norm is DeepSpeed's overflow sentinel (inf), not a measurement.
        record = make_record(
            step=step, warmup=step < self._first_timed_step(), loss=seen.loss,
            grad_norm=None if seen.skipped else seen.grad_norm, lr=lr, skipped=seen.skipped,
            step_time_s=elapsed, tokens_per_step=layout.global_batch * recipe.train.seq_len,
            world_size=layout.world_size, flops_per_token=self.flops.model,
            hardware_flops_per_token=self.flops.hardware, peak_flops=self.peak_flops,
            device=self.device, ended_at=ended_at, loss_scale=self._loss_scale(),
            data_time_s=data_time, breakdown_s=phases)
        self.metrics.write(record)
        self.tracker.log_step(record)
        self.console.progress(name=recipe.name, step=step + 1, steps=recipe.train.steps,
                              postfix=self._postfix())

    def _loss_scale(self) -> float | None:
        """fp16's dynamic loss scale (DeepSpeed's optimizer wrapper holds it); None otherwise."""
        if self.resolved.recipe.train.precision != "fp16":
            return None
        scale = getattr(self.engine.optimizer, "cur_scale", None)
        return None if scale is None else float(scale)

    def _postfix(self) -> str:
        return _postfix(self.metrics.records[-1], self.metrics.last_eval())

    def _write_manifest(self) -> None:
        from dsforge.runtime.loop.manifest import environment_manifest, implementations

        model = self.resolved.recipe.model
        used = implementations(self.engine.optimizer, kernels=self.kernels.impl,
                               kernels_why=self.kernels.why, sdpa_backend=model.sdpa_backend,
                               experts=self.experts, compiled=compiled_with(model.compile),
                               fp8=self.resolved.recipe.train.fp8)
        manifest = environment_manifest(self.device, asdict(self.resolved.layout), used)
        if self.resumed is not None:  # the checkpoint continued and the recipe's changes
            manifest["resumed"] = self.resumed
        write_atomic(self.run_dir.manifest, json.dumps(manifest, indent=2) + "\n")

    def finish(self, closing_line: bool = True) -> None:
        """The rank's summary and, on the reporting rank, the run's; rank 0's report when the
        training went bad. `closing_line`: say the summary (a run that stopped early leaves
        that to `dsforge run`, which says why and how to go on)."""
        self._write_rank_summary()
        if self.halted is not None and torch.distributed.get_rank() == 0:
            bad_steps.report_halt(self.halted, run_dir=self.run_dir,
                                  skipped_updates=self.engine.skipped_steps,
                                  fp16=self.resolved.recipe.train.precision == "fp16",
                                  say=self.console.say)
        if not self.reporter:
            return
        self.console.close()
        self.tracker.close()
        summary = self._write_summary()
        if not closing_line:
            return
        self.console.say(format_summary(summary))
        if summary["median_breakdown_s"] is not None:
            self.console.say(format_breakdown(summary))

    def _write_summary(self) -> dict:
        """RUN_DIR/summary.json: the run's medians (metrics.py) and its start-up."""
        summary = {**self.metrics.summary(), "startup_s": self.startup.phases,
                   "restarts": len(self.restarts), "restart_causes": self.restarts}
        write_atomic(self.run_dir.summary, json.dumps(summary, indent=2) + "\n")
        return summary

    def _write_rank_summary(self) -> None:
        """RUN_DIR/ranks/rankNNNNN.json: what only this rank knows (its memory, its bubble)."""
        from megatron.core import parallel_state as ps

        from dsforge.runtime.guard.oom import peak_memory

        memory, source = peak_memory(self.device)
        if self.profiler is not None:
            self.profiler.close()  # a run stopped before the last traced step
        readings = self._timed_readings()
        summary = {"rank": torch.distributed.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                   "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank(),
                   "peak_memory_bytes": memory, "memory_source": source,
                   "bubble_share": median_bubble(readings),
                   "breakdown_s": median_breakdown(r.phases for r in readings),
                   "tensor_bytes": self._tensor_census(),
                   **{f"tensor_bytes_{point}": census for point, census in self.censuses.items()}}
        path = self.run_dir.rank_summary(summary["rank"])
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, json.dumps(summary) + "\n")

    def _timed_readings(self) -> list[breakdown.Reading]:
        """This rank's step breakdowns after the warmup steps (all of them if every step was
        one), once the device has finished the last step."""
        self.timings.finish()
        warmup = self._first_timed_step()
        readings = self.timings.readings
        if self.timings.problem:  # readings made late (a rank without the loss) included
            self._warn_breakdown(self.timings.problem)
        return [r for step, r in readings.items() if step >= warmup] or list(readings.values())

    def _takes_census(self, step: int) -> bool:
        """With `census`, the census inside a step runs on the last step left out of the
        timings (walking every live object takes longer than a tiny step), else the first."""
        return self.census and step == max(self.start_step, self._first_timed_step() - 1)

    def _first_timed_step(self) -> int:
        """The first step of this process's timings: its own first `timing_warmup` steps warm
        it up, a resumed run's as a new run's (its allocator, caches and kernels are cold)."""
        return self.start_step + self.resolved.recipe.train.timing_warmup

    def _census_inside_step(self, point: str) -> None:
        from dsforge.runtime.loop.tensor_census import live_tensor_bytes

        census = live_tensor_bytes(self.engine, self.device)
        # A point may repeat (ZeRO-3 steps the optimizer once per sub-group): keep its largest.
        if census["total"] >= self.censuses.get(point, {}).get("total", -1):
            self.censuses[point] = census

    def _tensor_census(self) -> dict[str, int] | None:
        """Live model-state tensors after training, for `dsforge bench` (tensor_census.py)."""
        if not self.census:
            return None
        from dsforge.runtime.loop.tensor_census import live_tensor_bytes

        return live_tensor_bytes(self.engine, self.device)


def train_loop(trainer: Trainer, *, before_step: Callable[[int], None] | None = None,
               after_step: Callable[[int], None] | None = None,
               after_steps: Callable[[], None] | None = None,
               save_fault: Callable[[int, int], None] | None = None,
               stopper: Stopper | None = None) -> Stopped | Halted | None:
    """Steps trainer.start_step .. train.steps - 1 with a checkpoint every
    train.checkpoint_every steps and after the last (as Megatron-LM and torchtitan save the
    final state), then the summaries (`Trainer.finish`). Returns None; `Halted` when the
    training went bad (runtime/guard/health.py: the loop ends at that step, before its
    evaluation and any save); or with a `stopper` (runtime/guard/preempt.py) `Stopped` when
    the ranks agreed after a step to stop early (a signal, train.time_limit): that step's
    checkpoint is then saved, unless the step was bad (`Stopped.saved`).

    runtime/rank.py adds what only a launched rank needs: `before_step(step)` arms its
    watchdog, beats its heartbeat and runs the fault drills (also before each validation
    batch, so a long evaluation is not taken for a hang); `after_step(step)` runs the drill
    that spoils weights between a step and its save; `after_steps()` disarms the watchdog;
    `save_fault(rank, steps_done)` is the drill that dies while saving; `stopper` agrees on
    stopping once per step (one all-reduce). tests/distributed/worker.py runs the same loop
    without them.
    """
    train = trainer.resolved.recipe.train
    every = train.checkpoint_every
    timed = stopper.note if stopper is not None else None
    stopped = None
    for step in range(trainer.start_step, train.steps):
        if before_step is not None:
            before_step(step)
        _timed(timed, "step", trainer.train_step, step)
        if after_step is not None:
            after_step(step)
        if trainer.halted:
            break
        if eval_due(train, step):  # before the save: a resumed run has this step's eval
            _timed(timed, "eval", trainer.evaluate, step, before_batch=before_step)
        due = every and ((step + 1) % every == 0 or step + 1 == train.steps)
        saved = due and _timed(timed, "save", save_and_prune, trainer, step + 1, save_fault)
        if trainer.halted:
            break
        if stopper is not None and step + 1 < train.steps:
            stopped = stopper.agree(step + 1, next_evaluates=eval_due(train, step + 1))
            if stopped is not None:
                if not due:
                    saved = save_and_prune(trainer, step + 1, save_fault)
                stopped = replace(stopped, saved=bool(saved))
                break
    if after_steps is not None:
        after_steps()
    trainer.finish(closing_line=stopped is None and trainer.halted is None)
    return trainer.halted or stopped


def save_and_prune(trainer: Trainer, steps_done: int, fault=None) -> bool:
    """The checkpoint of `steps_done` steps; then, with train.keep_last, rank 0 deletes the
    complete checkpoints beyond the newest keep_last (ckpt/retention.py). Whether it was
    written (Trainer.save_checkpoint: not after a bad step, nor with non-finite weights)."""
    if not trainer.save_checkpoint(steps_done, fault=fault):
        return False
    keep_last = trainer.resolved.recipe.train.keep_last
    if keep_last and torch.distributed.get_rank() == 0:
        from dsforge.ckpt.retention import prune

        prune(trainer.run_dir.checkpoints, keep_last,
              warn=lambda text: trainer.console.say(f"dsforge: warning: {text}"))
    return True


def _timed(note: Callable[[str, float], None] | None, kind: str, function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    if note is not None:
        note(kind, time.perf_counter() - start)
    return result


def eval_due(train, step: int) -> bool:
    """Evaluate after every train.eval_every steps and after the last step."""
    return train.eval_every > 0 and ((step + 1) % train.eval_every == 0 or step + 1 == train.steps)


def _postfix(r, last_eval: tuple[int, float] | None) -> str:
    mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
    norm = f"{r.grad_norm:.3f}" if r.grad_norm is not None else "n/a"
    val = f" | val {last_eval[1]:.4f}" if last_eval is not None else ""
    if r.skipped:
        norm = "n/a, update skipped"
    return (f"loss {r.loss:.4f}{val} | gnorm {norm} | lr {r.lr:.2e} | {r.step_time_s * 1e3:.0f} ms | "
            f"{r.tokens_per_s:,.0f} tok/s | MFU {mfu} | mem {r.peak_memory_bytes / MiB:,.0f} MiB")
