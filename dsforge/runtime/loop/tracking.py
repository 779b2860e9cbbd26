"""Experiment tracking: each step's metrics to TensorBoard and/or Weights & Biases.

RUN_DIR/metrics.jsonl is the run's record; a tracker mirrors it into dashboards and is opened
by the rank that writes metrics.jsonl (the reporting rank). So a tracker never stops
training: when a backend fails (a full disk, a W&B outage, no W&B login), the tracker warns
once, saying what failed and that metrics.jsonl still has every step, and that backend stays
off for the rest of the run while the other one goes on (docs/tracking.md).

tensorboard and wandb are optional extras (dsforge[tensorboard], dsforge[wandb]; rule X1
checks them before launch) and are imported only when the recipe asks for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from dsforge.files import write_atomic
from dsforge.job.run_dir import RunDir

if TYPE_CHECKING:  # a type only: importing metrics would import torch
    from dsforge.runtime.loop.metrics import StepRecord

Warn = Callable[[str], None]
Scalars = dict[str, float]

WANDB_ID_FILE = "dsforge-run-id"  # in RUN_DIR/wandb: the W&B run a resumed run continues
WANDB_STEP = "step"  # the x axis of every W&B chart: the training step, as in metrics.jsonl


class Backend(Protocol):
    name: str

    def log(self, step: int, scalars: Scalars) -> None: ...

    def close(self) -> None: ...


def step_scalars(record: StepRecord) -> Scalars:
    """One step's scalars by name. Values a step does not have (the loss scale without fp16,
    MFU/HFU without a known peak, a missing grad norm) are left out, not logged as 0."""
    values = {
        "train/loss": record.loss, "train/lr": record.lr, "train/grad_norm": record.grad_norm,
        "train/loss_scale": record.loss_scale,
        "perf/tokens_per_s": record.tokens_per_s, "perf/tflops_per_gpu": record.tflops_per_gpu,
        "perf/mfu": record.mfu, "perf/hfu": record.hfu, "perf/step_time_s": record.step_time_s,
        "perf/mfu_documents": record.mfu_documents, "perf/attention_share": record.attention_share,
        "memory/peak_bytes": record.peak_memory_bytes,
        # the step breakdown (docs/breakdown.md), one scalar per phase
        **{f"time/{phase}_s": seconds for phase, seconds in (record.breakdown_s or {}).items()},
    }
    return {name: float(value) for name, value in values.items() if value is not None}


class Tracker:
    """Sends steps and validation losses to its backends; with none it does nothing."""

    def __init__(self, backends: list[Backend], *, run_dir: RunDir, warn: Warn):
        self._backends = list(backends)
        self._run_dir, self._warn = run_dir, warn

    @property
    def backends(self) -> list[str]:
        """The names of the backends still on."""
        return [backend.name for backend in self._backends]

    def log_step(self, record: StepRecord) -> None:
        scalars = step_scalars(record)
        self._each(lambda backend: backend.log(record.step, scalars))

    def log_eval(self, step: int, val_loss: float) -> None:
        self._each(lambda backend: backend.log(step, {"val/loss": float(val_loss)}))

    def close(self) -> None:
        """Flushes and ends every backend (W&B's run and its service process). Idempotent."""
        while self._backends:
            backend = self._backends.pop(0)
            try:
                backend.close()
            except Exception as exc:  # tracking must not end the run
                self._warn(failure_text(backend.name, "closing it", exc, self._run_dir))

    def _each(self, call: Callable[[Backend], None]) -> None:
        for backend in list(self._backends):
            try:
                call(backend)
            except Exception as exc:  # tracking must not end the run
                self._drop(backend, exc)

    def _drop(self, backend: Backend, exc: Exception) -> None:
        self._backends.remove(backend)
        self._warn(failure_text(backend.name, "logging", exc, self._run_dir))
        # Still release what it holds (W&B's service process); its own errors were told above.
        with contextlib.suppress(Exception):
            backend.close()


def failure_text(name: str, doing: str, exc: BaseException, run_dir: RunDir) -> str:
    hint = f" (pip install 'dsforge[{name}]')" if isinstance(exc, ImportError) else ""
    detail = str(exc).rstrip(". ")
    return (f"tracking: {name} failed while {doing}: {type(exc).__name__}: {detail}{hint}. "
            f"{name} is off for the rest of this run; training goes on and "
            f"{run_dir.metrics} still has every step")


def open_tracker(recipe, run_dir: RunDir, *, resumed_at: int | None = None,
                 warn: Warn | None = None) -> Tracker:
    """The tracker recipe.tracking asks for, writing under run_dir.

    resumed_at: the step a resumed run trains next (None for a new run). TensorBoard hides
    the earlier attempt's events from that step on and W&B continues the same run.
    warn: where a backend failure is told (default: a line on stderr).
    """
    warn = warn or _warn_on_stderr
    tracking = recipe.tracking
    openers: list[tuple[str, Callable[[], Backend]]] = []
    if tracking.tensorboard:
        openers.append(("tensorboard", lambda: TensorBoardBackend(run_dir.tensorboard,
                                                                  resumed_at=resumed_at)))
    if tracking.wandb:
        openers.append(("wandb", lambda: WandbBackend.open(recipe, run_dir, resumed_at=resumed_at,
                                                           warn=warn)))
    backends = []
    for name, opener in openers:
        try:
            backends.append(opener())
        except Exception as exc:  # tracking must not end the run
            warn(failure_text(name, "opening it", exc, run_dir))
    return Tracker(backends, run_dir=run_dir, warn=warn)


def _warn_on_stderr(text: str) -> None:
    print(f"dsforge: warning: {text}", file=sys.stderr, flush=True)


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, log_dir: Path, *, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the earlier attempt's events of the steps trained
        # again, as metrics.jsonl drops their records on resume.
        self._writer = SummaryWriter(str(log_dir), purge_step=resumed_at)

    def log(self, step: int, scalars: Scalars) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    name = "wandb"

    def __init__(self, run: Any, wandb: Any):
        self._run, self._wandb = run, wandb

    @classmethod
    def open(cls, recipe, run_dir: RunDir, *, resumed_at: int | None, warn: Warn) -> WandbBackend:
        tracking = recipe.tracking
        if tracking.wandb_mode == "offline":
            _no_error_reports()
        import wandb

        try:
            with _stdin_not_a_terminal():
                run = _wandb_init(wandb, recipe, run_dir, resumed_at)
            run.define_metric(WANDB_STEP)
            run.define_metric("*", step_metric=WANDB_STEP)
        except Exception:
            with contextlib.suppress(Exception):
                wandb.teardown()  # ends a run init started and the service process with it
            raise
        if run.settings.mode != tracking.wandb_mode:
            warn(_mode_text(run.settings.mode, tracking.wandb_mode))
        return cls(run, wandb)

    def log(self, step: int, scalars: Scalars) -> None:
        # The step is a logged value, not wandb's own step: a resumed run logs the steps
        # after its checkpoint again, and wandb drops a step lower than one it has seen.
        self._run.log({WANDB_STEP: step, **scalars})

    def close(self) -> None:
        try:
            self._run.finish()
        finally:
            # finish() leaves W&B's service process (wandb-core) running for a next run in
            # this process; there is none, and no process may outlive the rank's work.
            self._wandb.teardown()


def _wandb_init(wandb: Any, recipe, run_dir: RunDir, resumed_at: int | None) -> Any:
    tracking = recipe.tracking
    return wandb.init(project=tracking.wandb_project, entity=tracking.wandb_entity,
                      mode=tracking.wandb_mode, dir=str(run_dir), name=recipe.name,
                      config=dataclasses.asdict(recipe), resume="allow",
                      id=_wandb_run_id(run_dir.wandb, resumed_at),
                      # console="off": the rank's stdout carries dsforge's marked lines, which
                      # W&B's capture would wrap.
                      settings=wandb.Settings(console="off"))


@contextlib.contextmanager
def _stdin_not_a_terminal() -> Iterator[None]:
    """Without credentials, W&B asks for an API key when stdin and stderr are a terminal. A
    rank reads no input and, under `dsforge run`, its output reaches only the job log: the
    prompt would hold the whole job at its first collective, unseen. With stdin no terminal
    W&B fails at once ("No API key configured"), which the tracker tells."""
    stdin, sys.stdin = sys.stdin, io.StringIO()
    try:
        yield
    finally:
        sys.stdin = stdin


def _no_error_reports() -> None:
    """Offline means no network call: wandb-core otherwise sends its own errors to Sentry
    (it starts with --no-observability only when WANDB_ERROR_REPORTING is false). Read when
    the service starts, so set before wandb.init."""
    os.environ["WANDB_ERROR_REPORTING"] = "false"


def _wandb_run_id(wandb_dir: Path, resumed_at: int | None) -> str:
    """The W&B run id: on resume the one stored in wandb_dir, else a new one stored there
    (made here: wandb's own id helper has moved between releases)."""
    path = wandb_dir / WANDB_ID_FILE
    if resumed_at is not None and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)  # W&B run ids: letters and digits, unique per project
    wandb_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, run_id + "\n")
    return run_id


def _mode_text(got: str, asked: str) -> str:
    where = ("runs offline: its files stay under RUN_DIR/wandb (wandb sync them later)"
             if got == "offline" else "is disabled and records nothing")
    return (f"tracking: wandb_mode is {asked} but W&B {where}. Is this machine logged in to "
            "W&B? Run `wandb login` or set WANDB_API_KEY on every node before the run, or set "
            "tracking.wandb_mode: offline")
