"""Checkpoints are complete or invisible, and resume is exact (bitwise on CPU fp32).

Each exactness test trains 6 steps straight (checkpoint every 3), and again with rank 0
dying at the start of step 4 followed by `--resume`; the per-step losses must be identical.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from dsforge.runtime import checkpoint
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


class _StraightRuns:
    """`straight_runs / name`: the uninterrupted 6-step run of layout `name`, trained the first
    time a test asks for it (the refusal tests need only zero1_dp2)."""

    def __init__(self, out):
        self.out = out

    def __truediv__(self, name: str):
        run_dir = self.out / name
        if not (run_dir / "summary.json").exists():
            recipe, extra = LAYOUTS[name]
            result = _run(recipe, run_dir, extra)
            assert result.returncode == 0, result.stderr[-3000:]
        return run_dir


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    return _StraightRuns(tmp_path_factory.mktemp("straight"))


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


def test_the_marker_lists_every_file_each_rank_wrote(straight_runs):
    step = straight_runs / "zero1_dp2" / "checkpoints" / "step00000006"
    files = json.loads((step / "dsforge_complete.json").read_text())["files"]
    on_disk = {p.name: p.stat().st_size for p in step.iterdir() if p.name != "dsforge_complete.json"}
    assert files == on_disk
    assert {"dsforge_rng_rank00000.pt", "dsforge_rng_rank00001.pt"} <= set(files)
    assert len([name for name in files if "optim_states" in name]) == 2  # ZeRO-1, dp 2


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_optimizer_shard_is_refused_before_any_rank_starts(straight_runs, tmp_path,
                                                                     damage):
    run_dir = _copy_run(straight_runs, tmp_path)
    step = run_dir / "checkpoints" / "step00000006"
    (shard,) = [p for p in step.iterdir() if p.name.startswith("zero_pp_rank_1")]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    result = _run("tiny.yaml", run_dir, [], resume=True)
    assert result.returncode == 2 and "[CK4]" in result.stderr and shard.name in result.stderr
    assert "resuming" not in result.stderr  # refused before the ranks were started


def test_latest_naming_another_runs_checkpoint_is_refused(straight_runs, tmp_path):
    """../../other-run/checkpoints/step00000006 resumed someone else's run."""
    _copy_run(straight_runs, tmp_path / "other-run")
    run_dir = _copy_run(straight_runs, tmp_path / "mine")
    (run_dir / "checkpoints" / "latest").write_text("../../../other-run/zero1_dp2/checkpoints/"
                                                    "step00000006")
    result = _run("tiny.yaml", run_dir, [], resume=True)
    assert result.returncode == 2 and "[CK1]" in result.stderr


def test_group_writable_checkpoint_of_a_shared_group_is_refused(straight_runs, tmp_path):
    run_dir = _copy_run(straight_runs, tmp_path)
    shard = run_dir / "checkpoints" / "step00000006" / "mp_rank_00_model_states.pt"
    if os.getuid() == 0:
        os.chown(shard, 0, 4242)  # a group with no entry: never the user's private group
    elif checkpoint._private_group(os.getgid(), os.getuid()):
        pytest.skip("needs root to give the file a group other than your private one")
    os.chmod(shard, 0o664)
    result = _run("tiny.yaml", run_dir, [], resume=True)
    assert result.returncode == 2 and "writable by group" in result.stderr


def test_a_symlinked_file_is_called_a_symlink(straight_runs, tmp_path):
    run_dir = _copy_run(straight_runs, tmp_path)
    shard = run_dir / "checkpoints" / "step00000006" / "mp_rank_00_model_states.pt"
    shard.rename(tmp_path / "moved.pt")
    shard.symlink_to(tmp_path / "moved.pt")
    result = _run("tiny.yaml", run_dir, [], resume=True)
    assert result.returncode == 2 and "symbolic link" in result.stderr
    assert "writable by every user" not in result.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_checkpoint_of_another_user_is_refused(straight_runs, tmp_path):
    run_dir = _copy_run(straight_runs, tmp_path)
    os.chown(run_dir / "checkpoints" / "step00000006" / "dsforge_complete.json", 4242, 4242)
    result = _run("tiny.yaml", run_dir, [], resume=True)
    assert result.returncode == 2 and "belongs to uid 4242" in result.stderr


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    result = _run("tiny.yaml", tmp_path, [], resume=True)
    assert result.returncode == 2 and "no complete checkpoint" in result.stderr
