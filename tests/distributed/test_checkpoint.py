"""Checkpoints are complete or invisible, and resume is exact (bitwise on CPU fp32).

Each exactness test trains 6 steps straight (checkpoint every 3), and again with rank 0
dying at the start of step 4 followed by `--resume`; the per-step losses must be identical.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import REPO
from tests.distributed.test_run import _job_processes, dsforge

TEXT = REPO / "data" / "tempest.u16.bin"
COMMON = ["--set", f"data.source={TEXT}", "--set", "train.steps=6", "--set", "train.checkpoint_every=3"]
LAYOUTS = {
    "zero1_dp2": ("tiny.yaml", []),
    "zero3_dp2": ("tiny.yaml", ["--set", "zero.stage=3"]),
    "pp2_zero1": ("tiny.yaml", ["--set", "parallel.dp=1", "--set", "parallel.pp=2"]),
    "moe_ep2_zero1": ("tiny_moe.yaml", []),
}


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(recipe: str, run_dir, extra, env=None, resume=False):
    args = ["run", str(REPO / "recipes" / recipe), *COMMON, *extra, "--run-dir", str(run_dir)]
    return dsforge(*args, *(["--resume"] if resume else []), env=env)


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """The uninterrupted 6-step run of every layout (also reused by the refusal tests)."""
    out = tmp_path_factory.mktemp("straight")
    for name, (recipe, extra) in LAYOUTS.items():
        result = _run(recipe, out / name, extra)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_resume_is_exact(straight_runs, tmp_path, name):
    recipe, extra = LAYOUTS[name]
    run_dir = tmp_path / "run"
    crashed = _run(recipe, run_dir, extra, env={"DSFORGE_INJECT_FAULT": "exit:0:4"})
    assert crashed.returncode != 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000003"
    resumed = _run(recipe, run_dir, extra, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and "after step 3" in resumed.stderr
    assert _losses(run_dir) == _losses(straight_runs / name)  # bitwise, all 6 steps
    assert not _job_processes(run_dir)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_as_latest(straight_runs, tmp_path):
    run_dir = tmp_path / "run"
    extra = ["--set", "train.checkpoint_every=2"]
    crashed = _run("tiny.yaml", run_dir, extra, env={"DSFORGE_INJECT_FAULT": "save-exit:1:4"})
    assert crashed.returncode != 0
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step00000002"
    assert (checkpoints / "step00000004").exists()  # written in part ...
    assert not (checkpoints / "step00000004" / "dsforge_complete.json").exists()  # ... never published
    resumed = _run("tiny.yaml", run_dir, extra, resume=True)
    assert resumed.returncode == 0 and "after step 2" in resumed.stderr
    assert not _job_processes(run_dir)


def _copy_run(straight_runs, tmp_path, name="zero1_dp2"):
    target = tmp_path / name
    shutil.copytree(straight_runs / name, target)
    return target


def test_resume_with_another_model_or_layout_is_refused(straight_runs, tmp_path):
    run_dir = _copy_run(straight_runs, tmp_path)
    result = dsforge("run", str(REPO / "recipes" / "tiny.yaml"), *COMMON, "--set", "parallel.dp=1",
                     "--set", "parallel.tp=2", "--set", "model.num_layers=2",
                     "--run-dir", str(run_dir), "--resume")
    assert result.returncode == 2
    assert "model.num_layers: 4 in the checkpoint, 2 now" in result.stderr
    assert "parallel.tp: 1 in the checkpoint, 2 now" in result.stderr


def test_world_writable_checkpoint_is_refused_before_unpickling(straight_runs, tmp_path):
    run_dir = _copy_run(straight_runs, tmp_path)
    os.chmod(run_dir / "checkpoints" / "step00000006" / "mp_rank_00_model_states.pt", 0o666)
    result = _run("tiny.yaml", run_dir, [], resume=True)
    assert result.returncode == 2 and "writable by every user" in result.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_checkpoint_of_another_user_is_refused(straight_runs, tmp_path):
    run_dir = _copy_run(straight_runs, tmp_path)
    os.chown(run_dir / "checkpoints" / "step00000006" / "dsforge_complete.json", 4242, 4242)
    result = _run("tiny.yaml", run_dir, [], resume=True)
    assert result.returncode == 2 and "belongs to uid 4242" in result.stderr


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    result = _run("tiny.yaml", tmp_path, [], resume=True)
    assert result.returncode == 2 and "no complete checkpoint" in result.stderr
