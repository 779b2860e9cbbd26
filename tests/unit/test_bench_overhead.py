"""tools/bench_overhead.py's pure part: step periods without the warmup steps.
tests/distributed/test_overhead_bench.py runs the tool itself."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def test_overhead_periods_skip_warmup_steps():
    spec = importlib.util.spec_from_file_location("bench_overhead", REPO / "tools" / "bench_overhead.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.periods([0.0, 5.0, 6.0, 6.5, 7.5], skip=1) == [1.0, 0.5, 1.0]
