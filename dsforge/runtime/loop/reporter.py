"""The reporting rank's account of a run: metrics.jsonl, the tracker, the progress line, the
manifest and summary.json.

One rank reports (rank 0 of the last pipeline stage's first tensor-parallel and data-parallel
replica: it has the loss, runtime/loop/metrics.py); the Trainer makes a Reporter there only and
hands it values (a step's record, a validation loss), never its own state. The progress line
of a step that an evaluation follows waits for that evaluation, so each step is shown once,
with the validation loss measured after it.
"""

from __future__ import annotations

import json
from typing import Any

from dsforge.files import write_atomic
from dsforge.job.console import RankConsole
from dsforge.job.metrics_file import json_text
from dsforge.job.run_dir import RunDir
from dsforge.recipe import Resolved
from dsforge.runtime.loop.metrics import (MetricsWriter, StepRecord, format_breakdown,
                                          format_summary)
from dsforge.runtime.loop.tracking import open_tracker
from dsforge.units import MiB


class Reporter:
    def __init__(self, resolved: Resolved, *, run_dir: RunDir, console: RankConsole,
                 resumed_at: int | None):
        """`resumed_at`: the first step a resumed run trains (its later records are dropped:
        they will be trained again); None for a new run."""
        recipe = resolved.recipe
        self.name, self.steps = recipe.name, recipe.train.steps
        self.run_dir, self.console = run_dir, console
        self.metrics = MetricsWriter(run_dir.metrics)
        if resumed_at is not None:
            self.metrics.keep_steps_before(resumed_at)
        self.tracker = open_tracker(recipe, run_dir, resumed_at=resumed_at,
                                    warn=lambda text: console.say(f"dsforge: warning: {text}"))

    def step(self, record: StepRecord, *, show: bool) -> None:
        """A step's record; `show`: its progress line now (False when an evaluation follows,
        which shows it)."""
        self.metrics.write(record)
        self.tracker.log_step(record)
        if show:
            self.show(record.step)

    def evaluation(self, step: int, val_loss: float) -> None:
        """The validation loss measured after `step`, and that step's progress line."""
        self.metrics.write_eval(step, val_loss)
        self.tracker.log_eval(step, val_loss)
        self.show(step)

    def show(self, step: int) -> None:
        self.console.progress(name=self.name, step=step + 1, steps=self.steps,
                              postfix=postfix(self.metrics.records[-1], self.metrics.last_eval()))

    def manifest(self, manifest: dict[str, Any]) -> None:
        write_atomic(self.run_dir.manifest, json.dumps(manifest, indent=2) + "\n")

    def finish(self, *, startup_s: dict[str, float], restarts: list[dict],
               checkpoints: dict | None, closing_line: bool) -> None:
        """summary.json: the run's medians (metrics.py), its start-up, the job's restarts
        before this attempt and what this rank's checkpoints cost (Checkpointer.measured).
        `closing_line`: say the summary (a run that stopped early leaves that to `dsforge
        run`, which says why and how to go on)."""
        self.console.close()
        self.tracker.close()
        summary = {**self.metrics.summary(), "startup_s": startup_s,
                   "restarts": len(restarts), "restart_causes": restarts,
                   "checkpoints": checkpoints}
        write_atomic(self.run_dir.summary, json_text(summary, indent=2) + "\n")
        if not closing_line:
            return
        self.console.say(format_summary(summary))
        if summary["median_breakdown_s"] is not None:
            self.console.say(format_breakdown(summary))


def postfix(r: StepRecord, last_eval: tuple[int, float] | None) -> str:
    mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
    norm = f"{r.grad_norm:.3f}" if r.grad_norm is not None else "n/a"
    # the step it followed, as the line counts steps (from 1): later lines repeat it
    val = f" | val {last_eval[1]:.4f} (step {last_eval[0] + 1})" if last_eval is not None else ""
    if r.skipped:
        norm = "n/a, update skipped"
    return (f"loss {r.loss:.4f}{val} | gnorm {norm} | lr {r.lr:.2e} | {r.step_time_s * 1e3:.0f} ms | "
            f"{r.tokens_per_s:,.0f} tok/s | MFU {mfu} | mem {r.peak_memory_bytes / MiB:,.0f} MiB")
