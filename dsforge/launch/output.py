"""What a running job shows on the terminal: dsforge's own lines, not the engines' logs.

The launcher's whole output (DeepSpeed's INFO lines, each rank's command line, warnings,
tracebacks) is written to the job log in the run directory. The terminal gets only the
lines ranks mark for it (dsforge/console.py): messages, a progress bar drawn here from the
reporting rank's step events, and the summary. `verbose` also echoes every other line.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from dsforge.console import parse


class JobView:
    def __init__(self, *, verbose: bool = False, out: TextIO = sys.stderr):
        self.verbose, self.out = verbose, out
        self._bar = None
        self.lines_shown: list[str] = []
        self.done_ranks: set[int] = set()  # ranks that reported completing their part
        # rank -> (steps done, why) for ranks that stopped early with a checkpoint
        self.stopped_ranks: dict[int, tuple[int, str]] = {}

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
            self._write(str(event.get("text", "")))
        elif event["kind"] == "done":
            self.done_ranks.add(int(event["rank"]))
        elif event["kind"] == "stopped":
            self.stopped_ranks[int(event["rank"])] = (int(event["step"]), str(event["reason"]))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

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
        if self._bar is None:
            self._bar = tqdm(total=steps, initial=step - 1, desc=str(event.get("name", "")),
                             unit="step", dynamic_ncols=True, file=self.out)
        self._bar.set_postfix_str(str(event.get("postfix", "")), refresh=False)
        self._bar.update(step - self._bar.n)
