"""`dsforge run RECIPE --tiny` end to end: a shipped recipe's exact layout at tiny size on CPU
ranks, its losses against one rank's, a quiet terminal, nothing left running.

CI runs the largest and most varied layouts (docs/launch.md says which and why); every other
shipped recipe runs the same way with DSFORGE_TINY_ALL=1 (32 CPU ranks take ~4 minutes on a
2-core machine, too slow to run all of them on every change).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.distributed.test_run import _job_processes

IN_CI = {
    "70b_pp4": 900,  # 32 ranks: tp4 x pp4 x vpp5 x dp2, sequence parallel, ZeRO-1, bf16, full AC
    "13b_8gpu_zero3": 300,  # ZeRO-3 over 8 data-parallel ranks, full AC
    "moe_8gpu_ep8": 300,  # 8 experts on 8 expert-parallel ranks
    "7b_1gpu": 300,  # one rank, ZeRO-0
}
SMALL = {"smoke", "tiny", "tiny_moe", "tiny_pp"}  # CPU recipes: tested at their own size
SHIPPED = [p.stem for p in sorted((REPO / "recipes").glob("*.yaml")) if p.stem not in SMALL]
ALL = os.environ.get("DSFORGE_TINY_ALL") == "1"


def _case(name: str):
    limit = IN_CI.get(name, 900)
    return pytest.param(name, limit, id=name, marks=pytest.mark.timeout(limit + 60))


@pytest.mark.parametrize("name, limit", [_case(name) for name in SHIPPED])
def test_shipped_recipe_at_tiny_size(tmp_path, name, limit):
    if name not in IN_CI and not ALL:
        pytest.skip("set DSFORGE_TINY_ALL=1 to run every shipped layout at tiny size")
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "dsforge", "run", str(REPO / "recipes" / f"{name}.yaml"),
                             "--tiny", "--run-dir", str(run_dir), "--timeout", str(limit)],
                            capture_output=True, text=True, cwd=REPO, timeout=limit + 30)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "layout check: the loss matches a single-rank run" in result.stderr
    assert "[INFO]" not in result.stderr and "--job" not in result.stderr
    assert (run_dir / "summary.json").exists() and (run_dir / "reference" / "summary.json").exists()
    assert not _job_processes(run_dir)
