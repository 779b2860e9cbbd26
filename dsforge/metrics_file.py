"""Reading RUN_DIR/metrics.jsonl without torch (the launcher, bench and tools read it).

Two kinds of lines: a step record (runtime/metrics.StepRecord: "step", "loss", ...) and a
validation record {"step": s, "val_loss": x}, written after the record of step s.
"""

from __future__ import annotations

import json
from pathlib import Path

VALIDATION_KEY = "val_loss"


def is_validation(record: dict) -> bool:
    return VALIDATION_KEY in record


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, validation records) of a metrics.jsonl, each in file order."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return ([r for r in lines if not is_validation(r)], [r for r in lines if is_validation(r)])
