"""How steps are numbered: from 0 in records, from 1 in what dsforge says.

Records count a step by its index, from 0 (metrics.jsonl, anomalies.jsonl, failure records,
heartbeats, `tracking.profile`). Everything dsforge says to people counts from 1, as its
progress line does: "step 4/6" and "step 4" are the fourth step, index 3. "After step k"
names the state after k steps: the checkpoint of step k (its tag, `stepNNNNNNNN`, holds k), from
which a resume trains step k + 1. `step_text` is the one place the index becomes a number
for people.
"""

from __future__ import annotations


def step_text(index: int) -> str:
    """'step N' for the step of 0-based `index` (N = index + 1)."""
    return f"step {index + 1}"
