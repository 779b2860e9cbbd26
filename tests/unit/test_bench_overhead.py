"""tools/bench_overhead.py's pure part: step periods without the warmup steps.
tests/distributed/test_overhead_bench.py runs the tool itself."""

from __future__ import annotations

from tests.conftest import load_tool


def test_overhead_periods_skip_warmup_steps():
    tool = load_tool("bench_overhead")
    assert tool.periods([0.0, 5.0, 6.0, 6.5, 7.5], skip=1) == [1.0, 0.5, 1.0]
