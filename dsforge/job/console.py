"""dsforge's own lines from inside the ranks, told apart from the engines' logs.

Ranks share stdout and stderr with DeepSpeed, Megatron-Core and torch, and over pdsh every
line comes back prefixed with "host: ". So a rank marks each line meant for the user's
terminal with MARK and a JSON payload; the `dsforge run` that started the job writes the
whole stream to the run directory's log and shows only the marked lines (launch/output.py).
A rank started by a plain `deepspeed ... -m dsforge run` has no such reader and prints
ordinary text instead (`marked=False`).
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

MARK = "@dsforge "


def parse(line: str) -> dict[str, Any] | None:
    """The payload of a marked line (after any "host: " prefix), or None."""
    at = line.find(MARK)
    if at < 0:
        return None
    try:
        payload = json.loads(line[at + len(MARK):])
    except ValueError:
        return None
    return payload if isinstance(payload, dict) and "kind" in payload else None


def is_terminal(out: TextIO) -> bool:
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


class PlainProgress:
    """Progress for a stream that is not a terminal (a log file, a pipe, a batch job's
    output): a line at every tenth of the steps and at the last, where a bar redrawn with
    carriage returns would leave every frame in the file."""

    def __init__(self, out: TextIO):
        self.out, self._next = out, 0

    def update(self, *, name: str, step: int, steps: int, postfix: str) -> None:
        if step < self._next and step < steps:
            return
        self._next = step + max(1, steps // 10)
        print(f"{name}: step {step}/{steps}" + (f", {postfix}" if postfix else ""), file=self.out,
              flush=True)


class RankConsole:
    """What one rank shows the user: messages, the progress of the run, its summary."""

    def __init__(self, marked: bool = True):
        self.marked = marked
        self._bar = None
        self._plain: PlainProgress | None = None

    def say(self, text: str) -> None:
        if self.marked:
            self._emit(kind="line", text=text)
        else:
            print(text, file=sys.stderr, flush=True)

    def progress(self, *, name: str, step: int, steps: int, postfix: str) -> None:
        """Step `step` (1-based) of `steps` is done."""
        if self.marked:
            self._emit(kind="progress", name=name, step=step, steps=steps, postfix=postfix)
            return
        if not is_terminal(sys.stderr):
            self._plain = self._plain or PlainProgress(sys.stderr)
            self._plain.update(name=name, step=step, steps=steps, postfix=postfix)
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=step - 1, desc=name, unit="step",
                             dynamic_ncols=True)
        self._bar.update(1)
        self._bar.set_postfix_str(postfix)

    def done(self, rank: int) -> None:
        """This rank finished its part of the job."""
        if self.marked:
            self._emit(kind="done", rank=rank)

    def stopped(self, rank: int, steps_done: int, reason: str, saved: bool = True) -> None:
        """This rank stopped early after `steps_done` steps, with their checkpoint unless
        `saved` is False (the last step was bad: `latest` is an earlier one;
        runtime/guard/preempt.py)."""
        if self.marked:
            self._emit(kind="stopped", rank=rank, step=steps_done, reason=reason, saved=saved)
        elif rank == 0:
            saved_text = "with a checkpoint" if saved else \
                "(its last step was bad: no checkpoint after it)"
            print(f"dsforge: stopped after step {steps_done} ({reason}) {saved_text}; "
                  "continue with --resume", file=sys.stderr, flush=True)

    def halted(self, rank: int, step: int, reason: str) -> None:
        """This rank stopped with the others at `step` because the training went bad
        (runtime/guard/health.py); rank 0 has said the report."""
        if self.marked:
            self._emit(kind="halted", rank=rank, step=step, reason=reason)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @staticmethod
    def _emit(**payload: Any) -> None:
        # One write per line: ranks share the stream, and a line must not be split by another.
        sys.stdout.write(MARK + json.dumps(payload) + "\n")
        sys.stdout.flush()
