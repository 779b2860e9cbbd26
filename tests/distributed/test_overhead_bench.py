"""The overhead benchmark's two sides still run: `dsforge run` and the hand-written script
train the same layout and both report step end times (tools/bench_overhead.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(300)
def test_both_sides_run_and_are_compared(tmp_path):
    out = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench_overhead.py"), "--layouts",
                           "dp2-zero1", "--steps", "6", "--skip", "2", "--repeats", "1",
                           "--timeout", "240", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert result["layout"] == "dp2-zero1" and result["steps_measured"] == 3
    assert result["dsforge_ms"] > 0 and result["handwritten_ms"] > 0
    assert "| dp2-zero1 |" in done.stdout


@pytest.mark.timeout(300)
def test_the_breakdown_overhead_bench_pairs_steps_with_and_without(tmp_path):
    """tools/bench_breakdown.py: one run whose steps alternate with and without the step
    breakdown, and the clock's own cost per mark."""
    out = tmp_path / "breakdown.json"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench_breakdown.py"), "--layouts",
                           "pp2-1f1b-full-ckpt", "--steps", "10", "--skip", "2", "--timeout", "240",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert result["layout"] == "pp2-1f1b-full-ckpt" and result["pairs"] == 4
    assert result["on_ms"] > 0 and result["off_ms"] > 0 and result["marks_per_step"] > 10
    assert 0 < result["us_per_mark"] and 0 < result["direct_share"] < 1
    assert "| pp2-1f1b-full-ckpt | cpu | 4 |" in done.stdout
