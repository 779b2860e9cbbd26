"""Reading RUN_DIR/metrics.jsonl without torch (the launcher, bench and tools read it).

Two kinds of lines: a step record (runtime/metrics.StepRecord: "step", "loss", ...) and a
validation record {"step": s, "val_loss": x}, written after the record of step s. The run's
records are strict JSON (`json_text`): a value that is not a finite number (a NaN loss, an
infinite gradient norm) is written as null.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

VALIDATION_KEY = "val_loss"

# The phases of a step record's `breakdown_s` (docs/breakdown.md), in the order reports show
# them. Exclusive: a phase nested in another (a ZeRO gather inside a forward, a recompute
# inside a backward) counts only in the inner one, and "other" is the step's time outside
# every named phase, so the phases sum to the record's step_time_s.
PHASES = ("data", "forward", "backward", "recompute", "experts", "optimizer", "dp_comm",
          "pipeline_wait", "guard", "other")


def json_text(data: Any, **kwargs: Any) -> str:
    """`data` as strict JSON, a float that is not finite written as null: json.dumps alone
    writes bare NaN and Infinity, which strict readers (jq, JavaScript, most languages'
    parsers) refuse. What was not finite is said beside it (a record's `skipped`,
    anomalies.jsonl's `what`)."""
    return json.dumps(_finite_or_null(data), allow_nan=False, **kwargs)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def is_validation(record: dict) -> bool:
    return VALIDATION_KEY in record


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, validation records) of a metrics.jsonl, each in file order."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return ([r for r in lines if not is_validation(r)], [r for r in lines if is_validation(r)])


def median_breakdown(breakdowns) -> dict[str, float] | None:
    """Each phase's median over the steps' breakdowns (dicts phase -> seconds; None for a step
    measured without one); None when no step has one. The medians need not add up to the
    median step."""
    present = [b for b in breakdowns if b]
    if not present:
        return None
    return {phase: statistics.median(b.get(phase, 0.0) for b in present) for phase in PHASES}
