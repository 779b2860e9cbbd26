"""`dsforge plan --search --measure`: the top layouts of a tiny model run as short bench trials
on CPU ranks, are re-ranked by measured step time, and a second run reuses finished trials."""

from __future__ import annotations

import json
import sqlite3

import pytest

from tests.distributed.test_run import dsforge


@pytest.mark.timeout(400)
def test_measure_runs_and_reranks_the_top_layouts(tmp_path):
    out = tmp_path / "trials"
    args = ("plan", "--search", "tiny", "--gpus", "2", "--gpu", "h100", "--seq-len", "128",
            "--global-batch-tokens", str(8 * 128), "--top", "2", "--measure", "--measure-out", str(out),
            "--json")
    first = dsforge(*args, timeout=360)
    assert first.returncode == 0, first.stderr[-3000:]
    measured = json.loads(first.stdout)["measured"]
    assert sorted(t["predicted_rank"] for t in measured) == [1, 2]
    assert all(t["status"] == "ok" and t["measured_step_s"] > 0 for t in measured)
    steps = [t["measured_step_s"] for t in measured]
    assert steps == sorted(steps)  # re-ranked by what was measured
    with sqlite3.connect(out / "results.db") as con:
        assert con.execute("SELECT COUNT(*) FROM results WHERE status='ok'").fetchone()[0] == 2
    again = dsforge(*args, timeout=120)
    assert again.returncode == 0 and "trial 1/2" not in again.stderr  # finished trials are reused
    assert json.loads(again.stdout)["measured"] == measured
