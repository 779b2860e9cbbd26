"""Per-step metrics: computed on every rank, written by the reporting rank.

The reporting rank is rank 0 of the last pipeline stage (tp rank 0, dp rank 0): it has the
loss. Step records go to metrics.jsonl as they happen; warmup steps carry `"warmup": true`
and are left out of the summary (medians over the measured steps of this process: a resumed
run's earlier steps may have run on another layout or machine). A validation loss is a
line of its own, `{"step": s, "val_loss": x}`, after the record of step s (the step it
follows); dsforge/job/metrics_file.py's `read_metrics` splits a file into the two kinds.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsforge.estimate.flops import mfu
from dsforge.files import write_atomic
from dsforge.job.metrics_file import (PHASES, VALIDATION_KEY, is_validation, json_text,
                                      median_breakdown)
from dsforge.runtime.guard.oom import peak_memory


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    step: int
    warmup: bool
    loss: float
    grad_norm: float | None
    lr: float
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float  # model TFLOP/s per rank (the FLOPs MFU counts)
    mfu: float | None  # None: no known peak (CPU or an unknown GPU)
    hfu: float | None
    peak_memory_bytes: int
    memory_source: str  # what peak_memory_bytes measures
    # Unix time at which the step's work ended (loss known). Differences between steps give
    # the loop's period, everything included (data, metrics, heartbeat): see
    # benchmarks/overhead.
    ended_at: float | None = None
    loss_scale: float | None = None  # fp16's dynamic loss scale after the step; None otherwise
    data_time_s: float | None = None  # building this rank's microbatches (inside step_time_s)
    # Seconds per phase of the step (metrics_file.PHASES, docs/breakdown.md), summing to
    # step_time_s; None when the run measures no breakdown (DSFORGE_BREAKDOWN=off).
    breakdown_s: dict[str, float] | None = None
    # DeepSpeed did not apply this step's update: its gradients were not finite (the guard's
    # bad steps, runtime/guard/health.py) or, in fp16, the loss scaler overflowed.
    skipped: bool = False
    # data.document_masking: the share of the step's full seq x seq score matrices that lies
    # within documents (data/documents.py), and MFU with attention counted there only
    attention_share: float | None = None
    mfu_documents: float | None = None


def make_record(*, step: int, warmup: bool, loss: float, grad_norm, lr: float, step_time_s: float,
                tokens_per_step: int, world_size: int, flops_per_token: float,
                hardware_flops_per_token: float, peak_flops: float | None,
                device: torch.device, ended_at: float | None = None,
                loss_scale: float | None = None, data_time_s: float | None = None,
                breakdown_s: dict[str, float] | None = None, skipped: bool = False,
                attention_share: float | None = None,
                document_flops_per_token: float | None = None) -> StepRecord:
    """`document_flops_per_token`: the model FLOPs with attention counted within the step's
    documents (`attention_share` of the full count), for `mfu_documents`."""
    tokens_per_s = tokens_per_step / step_time_s
    per_gpu = tokens_per_s / world_size
    memory, source = peak_memory(device)
    return StepRecord(step=step, warmup=warmup, loss=loss,
                      grad_norm=None if grad_norm is None else float(grad_norm), lr=lr,
                      step_time_s=step_time_s, tokens_per_s=tokens_per_s,
                      tokens_per_s_per_gpu=per_gpu,
                      tflops_per_gpu=per_gpu * flops_per_token / 1e12, mfu=mfu(per_gpu, flops_per_token, peak_flops),
                      hfu=mfu(per_gpu, hardware_flops_per_token, peak_flops),
                      peak_memory_bytes=memory, memory_source=source, ended_at=ended_at,
                      loss_scale=loss_scale, data_time_s=data_time_s, breakdown_s=breakdown_s,
                      skipped=skipped, attention_share=attention_share,
                      mfu_documents=None if document_flops_per_token is None else
                      mfu(per_gpu, document_flops_per_token, peak_flops))


def loss_scale(optimizer, precision: str) -> float | None:
    """fp16's dynamic loss scale (DeepSpeed's optimizer wrapper holds it: its `loss_scale`,
    at ZeRO 0 as at 1-3, where `cur_scale` exists at 1-3 only); None otherwise."""
    if precision != "fp16":
        return None
    scale = getattr(optimizer, "loss_scale", None)
    return None if scale is None else float(scale)


@dataclass(frozen=True)
class EvalRecord:
    step: int  # the training step this evaluation follows
    val_loss: float


def _parse(line: str) -> StepRecord | EvalRecord:
    data = json.loads(line)
    # A loss that was not finite is written as null (json_text); in memory it is NaN again.
    key = VALIDATION_KEY if is_validation(data) else "loss"
    data = {**data, key: math.nan if data[key] is None else data[key]}
    return EvalRecord(**data) if is_validation(data) else StepRecord(**data)


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = path
        self.records: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self.first_step = 0  # this process's first step (a resumed run's earlier ones are read back)

    def keep_steps_before(self, step: int) -> None:
        """On resume: drop records of steps that will be trained again (after the checkpoint)."""
        self.first_step = step
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if json.loads(line)["step"] < step]
        parsed = [_parse(line) for line in kept]
        self.records = [r for r in parsed if isinstance(r, StepRecord)]
        self.evals = [r for r in parsed if isinstance(r, EvalRecord)]
        write_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: StepRecord) -> None:
        self.records.append(record)
        self._append(asdict(record))

    def write_eval(self, step: int, val_loss: float) -> None:
        record = EvalRecord(step=step, val_loss=val_loss)
        self.evals.append(record)
        self._append(asdict(record))

    def last_eval(self) -> tuple[int, float] | None:
        return (self.evals[-1].step, self.evals[-1].val_loss) if self.evals else None

    def _append(self, data: dict) -> None:
        with self.path.open("a") as f:
            f.write(json_text(data) + "\n")

    def summary(self) -> dict:
        """The run's steps and losses; the timings and memory of this process's steps only."""
        own = [r for r in self.records if r.step >= self.first_step] or self.records
        measured = [r for r in own if not r.warmup] or own
        mfus = [r.mfu for r in measured if r.mfu is not None]
        return {
            "steps": len(self.records), "measured_steps": len(measured),
            "skipped_steps": sum(r.skipped for r in self.records),
            "final_loss": self.records[-1].loss if self.records else None,
            "median_step_time_s": statistics.median(r.step_time_s for r in measured),
            "median_tokens_per_s": statistics.median(r.tokens_per_s for r in measured),
            "median_tokens_per_s_per_gpu": statistics.median(r.tokens_per_s_per_gpu for r in measured),
            "median_mfu": statistics.median(mfus) if mfus else None,
            "peak_memory_bytes": max(r.peak_memory_bytes for r in own),
            "final_val_loss": self.evals[-1].val_loss if self.evals else None,
            "val_losses": [[r.step, r.val_loss] for r in self.evals],
            "median_breakdown_s": median_breakdown(r.breakdown_s for r in measured),
            **_documents_summary(measured),
        }


def _documents_summary(measured: list[StepRecord]) -> dict:
    """With documents masked: the median share of the score matrices within documents and
    the median MFU counted there ({} otherwise)."""
    shares = [r.attention_share for r in measured if r.attention_share is not None]
    if not shares:
        return {}
    mfus = [r.mfu_documents for r in measured if r.mfu_documents is not None]
    return {"median_attention_share": statistics.median(shares),
            "median_mfu_documents": statistics.median(mfus) if mfus else None}


def format_summary(summary: dict) -> str:
    mfu_text = f"{summary['median_mfu']:.1%}" if summary["median_mfu"] is not None else "n/a"
    if summary.get("median_attention_share") is not None:
        within = summary["median_mfu_documents"]
        mfu_text += (f" (attention over whole sequences; {within:.1%} within documents, "
                     if within is not None else " (attention over whole sequences; ")
        mfu_text += f"{summary['median_attention_share']:.1%} of the score matrices)"
    val = summary.get("final_val_loss")
    val_text = f", validation loss {val:.4f}" if val is not None else ""
    return (f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}{val_text}; median over "
            f"{summary['measured_steps']} measured steps: {summary['median_step_time_s'] * 1e3:.1f} ms/step, "
            f"{summary['median_tokens_per_s']:,.0f} tok/s ({summary['median_tokens_per_s_per_gpu']:,.0f} per rank), "
            f"MFU {mfu_text}")


def format_breakdown(summary: dict) -> str:
    """Where the median step goes: each phase's median in ms and its share of the median step;
    phases that took no time (no pipeline, no recompute) are left out."""
    step = summary["median_step_time_s"]
    parts = [f"{phase} {seconds * 1e3:.1f} ({seconds / step:.0%})"
             for phase in PHASES if (seconds := summary["median_breakdown_s"][phase]) != 0]
    return f"step breakdown, median ms (share of the {step * 1e3:.1f} ms step): " + ", ".join(parts)
