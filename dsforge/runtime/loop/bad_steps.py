"""What a run says and keeps about the steps the guard finds bad (runtime/guard/health.py).

Each bad step, skipped, reported or the one the run stops at, is one line on the terminal and
one JSON line in RUN_DIR/anomalies.jsonl (`record`): the step, what was bad, which ranks' own
losses were not finite, what the run did, and where the step's samples come from (the
documents of a Megatron corpus, the offsets in a token file), so the batch can be found.
A run that stops (`Halted`) ends with a report from rank 0 (`report_lines`), also kept as
the failure record of kind "nonfinite": the step, what was bad, the ranks, the updates
DeepSpeed skipped, the last good checkpoint, and how to go on.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsforge.ckpt.retention import complete_checkpoints
from dsforge.ckpt.trust import CheckpointError, latest_complete
from dsforge.job import failure
from dsforge.job.metrics_file import json_text
from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text
from dsforge.runtime.guard import health
from dsforge.runtime.guard.health import BadStep

_SHOWN_NUMBERS = 8  # documents or offsets named on the terminal; anomalies.jsonl has them all


@dataclass(frozen=True)
class Halted:
    """The ranks stopped together at `step` (0-based) because the training went bad."""

    step: int
    what: str
    kind: str  # "nonfinite", "spike" or "weights"
    ranks: list[int] = field(default_factory=list)  # ranks whose own value was not finite
    data: dict | None = None  # step_data of the step (rank 0's)
    in_a_row: int = 1  # non-finite: the bad steps in a row that ended with this one


class BadSteps:
    """The guard's state across a run: its judge (health.Guard, the same decision on every
    rank), whether the last step's update was dropped (no checkpoint may follow it), and
    `halted` once the ranks stop together. `step_data(step)` says where a step's samples
    come from; `reporting`: this rank keeps the records and says the lines."""

    def __init__(self, train, *, run_dir: RunDir, device, say: Callable[[str], None], rank: int,
                 reporting: bool, step_data: Callable[[int], dict]):
        self.guard = health.Guard(train)
        self.run_dir, self.device, self.say, self.rank = run_dir, device, say, rank
        self.reporting, self.step_data = reporting, step_data
        self.last_step_bad = False
        self.halted: Halted | None = None

    def judge(self, step: int, seen: health.StepView) -> BadStep | None:
        bad = self.guard.judge(step, seen)
        self.last_step_bad = bad is not None and bad.kind == "nonfinite"
        return bad

    def handle(self, bad: BadStep, loss) -> None:
        """Which ranks' losses were not finite (every rank takes part), then the reporting
        rank's line and record, and the halt when the run stops here."""
        ranks = health.ranks_where(not health.finite(loss), self.device) \
            if bad.kind == "nonfinite" else []
        data = None
        if self.reporting or (bad.action == "stop" and self.rank == 0):
            data = self.step_data(bad.step)
        if self.reporting:
            append_record(self.run_dir, record(bad, ranks, data))
            if bad.action != "stop":
                self.say(line(bad, ranks, data, self.guard.max_in_a_row))
        if bad.action == "stop":
            self.halt(Halted(step=bad.step, what=bad.what, kind=bad.kind, ranks=ranks, data=data,
                             in_a_row=bad.in_a_row))

    def halt(self, halted: Halted) -> None:
        self.halted = self.halted or halted

    def report(self, *, skipped_updates: int, fp16: bool) -> None:
        """Rank 0's report of a run that stopped here (`report_halt`)."""
        if self.halted is not None and self.rank == 0:
            report_halt(self.halted, run_dir=self.run_dir, skipped_updates=skipped_updates,
                        fp16=fp16, say=self.say)


def record(bad: BadStep, ranks: list[int], data: dict) -> dict:
    """The step's line in anomalies.jsonl."""
    return {"step": bad.step, "kind": bad.kind, "what": bad.what, "action": bad.action,
            "ranks": ranks, "data": data}


def append_record(run_dir: RunDir, line: dict) -> None:
    with run_dir.anomalies.open("a") as f:
        f.write(json_text(line) + "\n")


def line(bad: BadStep, ranks: list[int], data: dict, max_in_a_row: int) -> str:
    """The terminal's line for a bad step the run goes on from (skipped or reported)."""
    if bad.action == "skip":
        done = (f"its update was skipped ({bad.in_a_row} in a row; more than {max_in_a_row} in "
                "a row stop the run)")
    elif bad.action == "report":
        done = "reported (train.on_spike: report)"
    else:
        done = "the run stops"
    return (f"dsforge: {step_text(bad.step)}: {bad.what}{ranks_text(ranks)}; {done}; "
            f"{data_text(data)}")


def ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return ""
    shown = ", ".join(str(r) for r in ranks[:_SHOWN_NUMBERS])
    more = f" and {len(ranks) - _SHOWN_NUMBERS} more" if len(ranks) > _SHOWN_NUMBERS else ""
    return f" (on rank{'s' if len(ranks) > 1 else ''} {shown}{more})"


def data_text(data: dict) -> str:
    """e.g. 'its data: samples 72..79 of training samples; documents of data/tempest: 311,
    312, ... (20 in all, RUN_DIR/anomalies.jsonl has them)'."""
    first, last = data["samples"]
    parts = [f"its data: samples {first}..{last} of {data['source']}"]
    for kind in ("documents", "token offsets"):
        for name, numbers in data.get(kind, {}).items():
            shown = ", ".join(str(n) for n in numbers[:_SHOWN_NUMBERS])
            more = f", ... ({len(numbers)} in all, in anomalies.jsonl)" \
                if len(numbers) > _SHOWN_NUMBERS else ""
            parts.append(f"{kind} of {name}: {shown}{more}")
    return "; ".join(parts)


def report_halt(halted: Halted, *, run_dir: RunDir, skipped_updates: int, fp16: bool,
                say) -> None:
    """Rank 0's report, said and kept as the failure record of kind "nonfinite"."""
    lines = report_lines(halted, run_dir=run_dir, skipped_updates=skipped_updates, fp16=fp16)
    for text in lines:
        say(text)
    failure.write(run_dir, failure.Failure(rank=0, step=halted.step, kind="nonfinite",
                                           message=halted.what, detail="\n".join(lines)))


def report_lines(halted: Halted, *, run_dir: RunDir, skipped_updates: int,
                 fp16: bool) -> list[str]:
    """Rank 0's report of a run that stopped because its training went bad."""
    why = "non-finite gradients and the loss scaler's overflows" if fp16 else \
        "non-finite gradients"
    lines = [f"dsforge: the training stopped at {step_text(halted.step)}: {halted.what}"
             f"{ranks_text(halted.ranks)}",
             f"  DeepSpeed skipped {skipped_updates} update{'s' if skipped_updates != 1 else ''} "
             f"of this run ({why})"]
    if halted.data is not None:
        lines.append(f"  {data_text(halted.data)}")
    root = run_dir.checkpoints
    try:
        latest = latest_complete(root)
    except CheckpointError as exc:
        return lines + [f"  the latest checkpoint cannot be read: {exc}"]
    lines.append(f"  {_checkpoint_text(root, latest, halted)}")
    lines.append(f"  {_way_forward(halted, run_dir, resumable=latest is not None)}")
    return lines


def _checkpoint_text(root: Path, latest: dict | None, halted: Halted) -> str:
    """The last good checkpoint: `latest`, which nothing after the bad step replaced."""
    if latest is None:
        return "no checkpoint had been saved before it"
    text = (f"the last good checkpoint: {root / latest['tag']} (after step {latest['step']}, "
            "`latest`); nothing was saved after it")
    if latest["step"] == halted.step and halted.kind == "nonfinite":
        # A finite update that ruins the weights shows only in the next step's loss.
        earlier = sorted(s for s in complete_checkpoints(root) if s < latest["step"])
        text += (". It was saved right before the bad step, so the update of "
                 f"{step_text(halted.step - 1)} may be the cause"
                 + (f"; the checkpoint before it is after step {earlier[-1]}" if earlier else ""))
    return text


def _way_forward(halted: Halted, run_dir: RunDir, resumable: bool) -> str:
    if halted.in_a_row > 1:  # skipping did not help: the weights themselves are likely bad
        back = (f"go back to an earlier checkpoint (write its tag into "
                f"{run_dir.checkpoints / 'latest'}) or " if resumable else "")
        return (f"the run has likely diverged: {back}start a new run with a lower train.lr or "
                "train.grad_clip")
    if not resumable:
        change = {"spike": "train.on_spike: report", "weights": "a lower train.lr"}.get(
            halted.kind, "train.on_nonfinite: skip, or a lower train.lr or train.grad_clip")
        return f"to go on: start a new run with {change}"
    resume = ["dsforge", "run", str(run_dir.recipe), "--resume", "--run-dir", str(run_dir)]
    if halted.kind == "spike":
        return ("to go on past it: " + shlex.join(resume + ["--set", "train.on_spike=report"])
                + "; or start a new run without the spike's data")
    if halted.kind == "weights":
        return "to go on from the last good checkpoint: " + shlex.join(resume)
    return ("to go on, skipping such steps' updates: "
            + shlex.join(resume + ["--set", "train.on_nonfinite=skip"])
            + "; or start a new run with a lower train.lr or train.grad_clip")
