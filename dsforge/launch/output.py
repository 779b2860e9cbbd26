"""What a running job shows on the terminal: dsforge's own lines, not the engines' logs.

The launcher's whole output (DeepSpeed's INFO lines, each rank's command line, warnings,
tracebacks) is written to the job log in the run directory. The terminal gets only the
lines ranks mark for it (dsforge/job/console.py): messages, a progress bar drawn here from the
reporting rank's step events (a line at every tenth of the steps where the terminal is a file
or a pipe), and the summary. `verbose` also echoes every other line.
"""

from __future__ import annotations

import re
import sys
from typing import Any, TextIO

from dsforge.job.console import PlainProgress, is_terminal, parse

# "dsforge: rank 3 failed building ...": every rank of a job may say the same thing.
_RANK_LINE = re.compile(r"dsforge: rank (\d+) (.*)")


class JobView:
    def __init__(self, *, verbose: bool = False, out: TextIO = sys.stderr):
        self.verbose, self.out = verbose, out
        self._bar = None
        self._plain: PlainProgress | None = None  # where `out` is not a terminal
        self.lines_shown: list[str] = []
        self.done_ranks: set[int] = set()  # ranks that reported completing their part
        # rank -> (steps done, why, whether their checkpoint was written) for ranks that stopped
        # early on request (a signal, train.time_limit)
        self.stopped_ranks: dict[int, tuple[int, str, bool]] = {}
        # rank -> (step, what) for ranks that stopped together because training went bad
        self.halted_ranks: dict[int, tuple[int, str]] = {}
        # what a rank said (without its number) -> the other ranks that said it too, unshown
        self._repeated: dict[str, list[int]] = {}

    def feed(self, line: str) -> None:
        """One line of the launcher's output (without its newline)."""
        event = parse(line)
        if event is None:
            if self.verbose:
                self._write(line)
            return
        if event["kind"] == "progress":
            self._progress(event)
        elif event["kind"] == "line":
            self._say(str(event.get("text", "")))
        elif event["kind"] == "done":
            self.done_ranks.add(int(event["rank"]))
        elif event["kind"] == "stopped":
            self.stopped_ranks[int(event["rank"])] = (int(event["step"]), str(event["reason"]),
                                                      bool(event.get("saved", True)))
        elif event["kind"] == "halted":
            self.halted_ranks[int(event["rank"])] = (int(event["step"]), str(event["reason"]))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for said, ranks in self._repeated.items():
            if ranks:
                shown = said if len(said) <= 80 else said[:80] + "..."
                self._write(f"dsforge: rank{'s' if len(ranks) > 1 else ''} "
                            f"{_ranks_text(ranks)} said the same: {shown}")
        self._repeated.clear()

    def _say(self, text: str) -> None:
        """A rank's line, unless another rank said the same before (shown once, at close, as
        which ranks repeated it: 8 GPUs failing one build make one line, not 8)."""
        match = _RANK_LINE.fullmatch(text)
        if match is None:
            self._write(text)
        elif match[2] in self._repeated:
            self._repeated[match[2]].append(int(match[1]))
        else:
            self._repeated[match[2]] = []
            self._write(text)

    def _write(self, text: str) -> None:
        self.lines_shown.append(text)
        if self._bar is not None and self._bar.n >= self._bar.total:
            self.close()  # finished: the summary goes below the final bar, for good
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def _progress(self, event: dict[str, Any]) -> None:
        from tqdm import tqdm

        step, steps = int(event["step"]), int(event["steps"])
        if not is_terminal(self.out):
            self._plain = self._plain or PlainProgress(self.out)
            self._plain.update(name=str(event.get("name", "")), step=step, steps=steps,
                               postfix=str(event.get("postfix", "")))
            return
        if self._bar is None:
            self._bar = tqdm(total=steps, initial=step - 1, desc=str(event.get("name", "")),
                             unit="step", dynamic_ncols=True, file=self.out)
        self._bar.set_postfix_str(str(event.get("postfix", "")), refresh=False)
        self._bar.update(step - self._bar.n)


def _ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(map(str, sorted(ranks)[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
