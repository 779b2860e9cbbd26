"""`dsforge run RECIPE --tiny` end to end: a shipped recipe's exact layout at tiny size on CPU
ranks, its losses against one rank's, a quiet terminal, nothing left running.

CI runs the most varied layouts at 8 ranks or fewer (docs/launch.md says which and why):
70b_pp4's interleaved tp x pp x vpp x dp layout on 8 ranks instead of 32, and 8b_32k_cp4 as it
is. Every shipped recipe runs at its own world size with DSFORGE_TINY_ALL=1
(32 CPU ranks take ~4-6 minutes each on a 2-core machine, too slow for every change).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.distributed.test_run import _job_processes

# 7b_1gpu (one rank, ZeRO-0, bf16) is opt-in: one-rank jobs already run as every --tiny
# run's reference. So is 13b_8gpu_zero3 (ZeRO-3 over 8 data-parallel ranks, bf16, full AC;
# ~40 s of the suite's 30-minute budget): ZeRO-3 in bf16 resumes bitwise in
# test_resume_exact.py and matches one rank in the equivalence tests, full AC there too. And
# moe_8gpu_ep8 (8 experts on 8 expert-parallel ranks, ~37 s; issue 50's restarts took its
# place in the budget): expert parallelism matches one rank in the equivalence tests at ep 2
# beside dp, tp with sequence parallelism, pp, vpp and cp, sequential and grouped, and
# resumes bitwise in test_resume_exact.py.
IN_CI = {
    "8b_32k_cp4": 300,  # context parallelism (cp 4) beside tp 2 + sequence parallelism, bf16
}
# 70b_pp4 (tp4 x pp4 x vpp5 x dp2, 32 ranks) with every parallel dimension kept above 1 in a
# world of 8: interleaved 1F1B with tensor and sequence parallelism, ZeRO-1 over dp2, bf16 and
# full activation checkpointing, through the same CLI path. The `layout` text is what --tiny
# prints, so a change to the recipe that drops one of these fails here.
SHRUNK = {
    "70b_pp4_on_8_ranks": {
        "recipe": "70b_pp4",
        "set": ["cluster.nodes=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"],
        "layout": "(8 ranks: dp2 x tp2 x pp2 x vpp2 + sequence parallel, ZeRO 1, bf16, "
                  "activation checkpointing full)",
        "limit": 300,
    },
}
SMALL = {"smoke", "tiny", "tiny_moe", "tiny_pp"}  # CPU recipes: tested at their own size
SHIPPED = [p.stem for p in sorted((REPO / "recipes").glob("*.yaml")) if p.stem not in SMALL]
ALL = os.environ.get("DSFORGE_TINY_ALL") == "1"


def _case(name: str):
    limit = IN_CI.get(name, 900)
    return pytest.param(name, limit, id=name, marks=pytest.mark.timeout(limit + 60))


def _run_tiny(tmp_path, recipe: str, limit: int, overrides=()) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    sets = [word for item in overrides for word in ("--set", item)]
    result = subprocess.run([sys.executable, "-m", "dsforge", "run", str(REPO / "recipes" / f"{recipe}.yaml"),
                             "--tiny", *sets, "--run-dir", str(run_dir), "--timeout", str(limit)],
                            capture_output=True, text=True, cwd=REPO, timeout=limit + 30)
    assert result.returncode == 0, result.stderr[-4000:]
    if "the layout is the single-rank reference's: nothing to compare" in result.stderr:
        assert not (run_dir / "reference").exists()  # a one-rank recipe (7b_1gpu, moe_1gpu)
    else:
        assert "layout check: the loss matches a single-rank run" in result.stderr
        assert (run_dir / "reference" / "summary.json").exists()
    assert "[INFO]" not in result.stderr and "--job" not in result.stderr
    assert (run_dir / "summary.json").exists()
    startup = json.loads((run_dir / "summary.json").read_text())["startup_s"]  # runtime/startup.py
    assert set(startup) >= {"launch", "setup", "data", "distributed", "model", "weights", "engine"}
    assert "ready for the first step after" in result.stderr
    assert not _job_processes(run_dir)
    return result


@pytest.mark.parametrize("name, limit", [_case(name) for name in SHIPPED])
def test_shipped_recipe_at_tiny_size(tmp_path, name, limit):
    if name not in IN_CI and not ALL:
        pytest.skip("set DSFORGE_TINY_ALL=1 to run every shipped layout at tiny size")
    _run_tiny(tmp_path, name, limit)


@pytest.mark.parametrize("case", [pytest.param(case, id=name, marks=pytest.mark.timeout(case["limit"] + 60))
                                  for name, case in SHRUNK.items()])
def test_shipped_layout_in_a_smaller_world(tmp_path, case):
    result = _run_tiny(tmp_path, case["recipe"], case["limit"], case["set"])
    assert case["layout"] in result.stderr
