"""A rank's training: the parts from engine.build_rank, the data, steps with metrics, and
`train_loop`, the loop both `dsforge run`'s ranks and the distributed tests' worker run.

The Trainer wires its parts and runs the step; each part owns its state and takes values:
  checkpointer.py  Checkpointer  resume, save, prune
  reporter.py      Reporter      metrics.jsonl, the tracker, progress, manifest, summary.json
                                 (on the reporting rank only)
  bad_steps.py     BadSteps      the guard's state: the judge, a dropped update, the halt
  meter.py         StepMeter     the step breakdown, FLOPs for MFU, censuses, the rank summary
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, replace
from typing import Callable

import torch

from dsforge.job.console import RankConsole
from dsforge.job.run_dir import RunDir
from dsforge.recipe import Resolved
from dsforge.runtime.assemble.compile import CompileReport
from dsforge.runtime.assemble.engine import build_rank
from dsforge.runtime.guard import health
from dsforge.runtime.guard.preempt import Stopped, Stopper
from dsforge.runtime.loop import breakdown
from dsforge.runtime.loop import data as data_mod
from dsforge.runtime.loop import step as step_mod
from dsforge.runtime.loop.bad_steps import BadSteps, Halted
from dsforge.runtime.loop.checkpointer import Checkpointer, Resumed
from dsforge.runtime.loop.manifest import run_manifest
from dsforge.runtime.loop.meter import StepMeter
from dsforge.runtime.loop.metrics import loss_scale
from dsforge.runtime.loop.phase_hooks import marking
from dsforge.runtime.loop.profiler import open_profiler
from dsforge.runtime.loop.reporter import Reporter
from dsforge.runtime.loop.save_interval import SaveInterval
from dsforge.runtime.startup import StartupClock


class Trainer:
    def __init__(self, resolved: Resolved, *, device: torch.device, backend: str, run_dir: RunDir,
                 collective_timeout_s: float, resume: bool = False, census: bool = False,
                 console: RankConsole | None = None, startup: StartupClock | None = None,
                 restarts: list[dict] | None = None):
        # Without a clock from runtime/rank.py (the distributed tests' worker), start-up is
        # counted from here.
        self.startup = startup or StartupClock()
        self.resolved, self.device, self.run_dir = resolved, device, run_dir
        self.restarts = restarts or []  # the job's restarts before this attempt (summary.json)
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
        self.rank = torch.distributed.get_rank()
        self.checkpointer = Checkpointer(self.engine, resolved, run_dir=run_dir, device=device,
                                         console=self.console, rank=self.rank)
        self.resumed: Resumed | None = self.checkpointer.resume() if resume else None
        self.start_step = self.resumed.after_step if self.resumed else 0
        if resume:
            self.startup.mark("resume")
        self.meter = StepMeter(resolved, device=device, census=census,
                               first_timed_step=self.start_step + recipe.train.timing_warmup,
                               warn=lambda text: self.console.say(
                                   f"dsforge: warning: {text} (rank {self.rank})"))
        say = self.console.say if self.rank == 0 else None
        self.save_interval = SaveInterval(resolved, device=device.type, say=say,
                                          first_timed_step=self.meter.first_timed_step)
        self.compiled = CompileReport() if recipe.model.compile == "layers" else None
        self.profiler = open_profiler(recipe.tracking.profile_range, run_dir=run_dir,
                                      start_step=self.start_step, device=device,
                                      say=self.console.say)
        self._adds_loss, reporting = self._loss_roles()
        self.bad_steps = BadSteps(recipe.train, run_dir=run_dir, device=device, say=self.console.say,
                                  rank=self.rank, reporting=reporting,
                                  step_data=lambda step: data_mod.step_data(
                                      self.sources.train, step, resolved.layout.global_batch))
        self.reporter = Reporter(resolved, run_dir=run_dir, console=self.console,
                                 resumed_at=self.start_step if resume else None) \
            if reporting else None
        if self.reporter:
            self.reporter.manifest(run_manifest(
                resolved, device=device, optimizer=self.engine.optimizer, kernels=self.kernels,
                experts=self.experts, resumed=asdict(self.resumed) if self.resumed else None))
            self.console.say(f"dsforge: {self.startup.line()}")

    @property
    def halted(self) -> Halted | None:
        """Set when the ranks stop because the training went bad (train_loop ends there)."""
        return self.bad_steps.halted

    def save_checkpoint(self, steps_done: int, fault=None, final: bool = False) -> bool:
        """The checkpoint of `steps_done` steps (Checkpointer.save; `final`: the run ends on
        it); whether it was written. A save refused for non-finite weights halts the run."""
        outcome = self.checkpointer.save(steps_done, after_bad_step=self.bad_steps.last_step_bad,
                                         fault=fault, final=final)
        if isinstance(outcome, Halted):
            self.bad_steps.halt(outcome)
        return outcome is True

    def _loss_roles(self) -> tuple[bool, bool]:
        """(adds to the mean loss, reports): one rank per data-parallel (and context-parallel)
        replica adds its loss to the mean, on the last pipeline stage, tensor-parallel rank 0
        (its tp peers hold the same loss); the first replica's reports the run."""
        from megatron.core import parallel_state as ps

        adds = ps.is_pipeline_last_stage(ignore_virtual=True) and \
            ps.get_tensor_model_parallel_rank() == 0
        return adds, adds and ps.get_data_parallel_rank(with_context_parallel=True) == 0

    def _batches(self, source, index: int) -> list[data_mod.Microbatch]:
        return data_mod.rank_microbatches(source, index, self.resolved, eod=self.sources.eod,
                                          device=self.device)

    def train_step(self, step: int) -> None:
        with self.profiler.step(step) if self.profiler else contextlib.nullcontext():
            self._train_step(step)

    def _train_step(self, step: int) -> None:
        clock = self.meter.clock or breakdown.OFF
        start = time.perf_counter()  # the step's time includes making its batches
        clock.start()
        with clock.phase("data"):
            batches = self._batches(self.sources.train, step)
        data_time = time.perf_counter() - start
        lr = self.engine.get_lr()[0]  # the rate this step's update uses
        census = self.meter.census_hook(step, self.start_step, self.engine)
        with marking(self.meter.clock, self.engine, self.chunks) if self.meter.clock \
                else contextlib.nullcontext():
            loss = self._forward_backward_update(batches, census, clock)
        with clock.phase("guard"):
            reduced = health.reduce_step(health.loss_share(loss, adds_loss=self._adds_loss,
                                                           device=self.device),
                                         writing=self.checkpointer.writing(),
                                         last_step_s=self.save_interval.last_step_s,
                                         score_pairs=data_mod.score_pairs(batches) * self._adds_loss)
        marked = clock.stop()
        layout = self.resolved.layout
        seen = health.view(reduced, replicas=layout.dp * layout.cp, cp=layout.cp,  # a host sync
                           grad_norm=self.engine.get_global_grad_norm(),
                           applied=self.engine.was_step_applied())
        elapsed = self.save_interval.last_step_s = time.perf_counter() - start
        ended_at = time.time()
        self.checkpointer.after_step(health.ranks_writing(reduced))  # publishes a finished save
        self.save_interval.measured(step - 1, health.mean_last_step_s(reduced, layout.world_size))
        phases = self.meter.phases(step, marked, elapsed)
        bad = self.bad_steps.judge(step, seen)
        if self.compiled is not None:
            self._after_compiled_step(step)
        if self.reporter:
            record = self.meter.record(step, seen, lr=lr, elapsed=elapsed, ended_at=ended_at,
                                       data_time=data_time, phases=phases,
                                       loss_scale=loss_scale(self.engine.optimizer,
                                                             self.resolved.recipe.train.precision))
            evaluated = eval_due(self.resolved.recipe.train, step) and \
                (bad is None or bad.action != "stop")
            self.reporter.step(record, show=not evaluated)  # an evaluation shows it, with its loss
        if bad is not None:
            self.bad_steps.handle(bad, loss)

    def _after_compiled_step(self, step: int) -> None:
        """The compile time joins the start-up breakdown; a recompile after the warm-up is
        said once, by the rank it happened on (runtime/assemble/compile.py)."""
        said = self.compiled.after_step(step, warm=step >= self.meter.first_timed_step)
        if self.compiled.compile_s is not None:
            self.startup.phases["compile"] = self.compiled.compile_s
        if said and (self.reporter or said.startswith("warning")):
            self.console.say(f"dsforge: {said} (rank {self.rank})")

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
                    losses.append((loss, data_mod.batch_weight(batches)))
        finally:
            for chunk in self.chunks:
                chunk.train()
            if self.compiled is not None:  # evaluation's graphs (no grad) are not recompiles
                self.compiled.rebaseline()
        if losses:
            val_loss = health.mean_over_replicas(step_mod.validation_mean(losses))
            if self.reporter:
                self.reporter.evaluation(step, val_loss)

    def finish(self, closing_line: bool = True) -> None:
        """The rank's summary and, on the reporting rank, the run's; rank 0's report when the
        training went bad. `closing_line`: say the summary (a run that stopped early leaves
        that to `dsforge run`, which says why and how to go on)."""
        self.checkpointer.finish()  # a save still in flight is written and published
        if self.profiler is not None:
            self.profiler.close()  # a run stopped before the last traced step
        self.meter.write_rank_summary(self.run_dir, self.engine)
        self.bad_steps.report(skipped_updates=self.engine.skipped_steps,
                              fp16=self.resolved.recipe.train.precision == "fp16")
        if self.reporter:
            self.reporter.finish(startup_s=self.startup.phases, restarts=self.restarts,
                                 checkpoints=self.checkpointer.measured(),
                                 closing_line=closing_line)


def train_loop(trainer: Trainer, *, before_step: Callable[[int], None] | None = None,
               after_step: Callable[[int], None] | None = None,
               after_steps: Callable[[], None] | None = None,
               save_fault: Callable[[int, int], None] | None = None,
               stopper: Stopper | None = None) -> Stopped | Halted | None:
    """Steps trainer.start_step .. train.steps - 1 with a checkpoint when `save_interval` says
    (every train.checkpoint_every steps, or auto, and after the last, as Megatron-LM and
    torchtitan save), then the summaries (`Trainer.finish`). Returns None; `Halted` when the
    training went bad (runtime/guard/health.py: the loop ends at that step, before its
    evaluation and any save); or with a `stopper` (runtime/guard/preempt.py) `Stopped` when
    the ranks agreed after a step to stop early (a signal, train.time_limit): that step's
    checkpoint is then saved, unless the step was bad (`Stopped.saved`).

    runtime/rank.py adds what only a launched rank needs: `before_step(step)` arms its
    watchdog, beats its heartbeat and runs the fault drills (also before each validation
    batch, so a long evaluation is not taken for a hang); `after_step(step)` runs the drill
    that spoils weights between a step and its save; `after_steps()` disarms the watchdog;
    `save_fault(rank, steps_done)` is the drill that dies while saving; `stopper` agrees on
    stopping once per step (one all-reduce). tests/distributed/worker.py runs without them."""
    train = trainer.resolved.recipe.train
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
        due = trainer.save_interval.due(step)
        saved = due and trainer.save_checkpoint(step + 1, save_fault,
                                                final=step + 1 == train.steps)
        if timed is not None and trainer.checkpointer.slowest_s is not None:
            timed("save", trainer.checkpointer.slowest_s)  # snapshot to published
        if trainer.halted:
            break
        if stopper is not None and step + 1 < train.steps:
            stopped = stopper.agree(step + 1, next_evaluates=eval_due(train, step + 1))
            if stopped is not None:
                if not due:
                    saved = trainer.save_checkpoint(step + 1, save_fault, final=True)
                stopped = replace(stopped, saved=bool(saved))  # published by finish()
                break
    trainer.checkpointer.finish()  # the save in flight published while the watchdog watches
    if after_steps is not None:
        after_steps()
    trainer.finish(closing_line=stopped is None and trainer.halted is None)
    return trainer.halted or stopped


def _timed(note: Callable[[str, float], None] | None, kind: str, function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    if note is not None:
        note(kind, time.perf_counter() - start)
    return result


def eval_due(train, step: int) -> bool:
    """Evaluate after every train.eval_every steps and after the last step."""
    return train.eval_every > 0 and ((step + 1) % train.eval_every == 0 or step + 1 == train.steps)
