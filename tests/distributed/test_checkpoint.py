"""Checkpoints are complete or invisible, and resume is exact (bitwise on CPU fp32), through
`dsforge run`.

Each layout trains 8 steps (checkpoint every 4) once, with a rank dying after step 6 (at the
start of step 7), or, for zero1_dp2, while it saves the checkpoint of step 8; every step the
crashed run finished was trained straight through from step 0. `--resume` then trains steps
4-7 again from the checkpoint of step 4, and the losses of every step both runs trained must be
identical: three steps (4-6) after the resume, four (4-7) for zero1_dp2, and the held-out
losses (steps 1, 3, 5, 7) too. The refusal tests resume copies of the finished zero1_dp2 run.
The other ZeRO stages, a pipeline with validation and the experts resume bitwise in
test_resume_exact.py's shared world; a rank lost mid-step and resumed, in test_restarts.py.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from dsforge.ckpt import trust
from dsforge.cli import main
from dsforge.job.metrics_file import read_metrics
from tests.conftest import REPO
from tests.distributed.test_run import _job_processes, dsforge

TEXT = REPO / "data" / "tempest.u16.bin"
COMMON = ["--set", f"data.source={TEXT}", "--set", "train.steps=8", "--set", "train.checkpoint_every=4"]
RESUMED_FROM, FINAL = "step00000004", "step00000008"
STATE0 = "dsforge_state/rank00000.safetensors"  # rank 0's part of the layout-free state
# name -> (recipe, --set options, the crash): `exit:R:7` ends rank R at the start of step 7,
# R being the rank that writes metrics.jsonl (the last pipeline stage's first rank), so the
# record of step 6 is always written; `save-exit:1:8` ends rank 1 once it has written its files
# of the step-8 checkpoint, before the checkpoint is published.
LAYOUTS = {
    "zero1_dp2": ("tiny.yaml", ["--set", "train.eval_every=2", "--set", "train.eval_iters=1"],
                  "save-exit:1:8"),
}


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]]


def _val_losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in read_metrics(run_dir / "metrics.jsonl")[1]]


def _run(recipe: str, run_dir, extra, env=None, resume=False):
    args = ["run", str(REPO / "recipes" / recipe), *COMMON, *extra, "--run-dir", str(run_dir)]
    return dsforge(*args, *(["--resume"] if resume else []), env=env)


def _refused_resume(run_dir, *extra: str) -> SimpleNamespace:
    """`dsforge run tiny.yaml --resume` for the resumes refused before any rank starts: the same
    command, in this process (click's runner), which saves each refusal the ~2.5 s of starting
    Python and importing torch. A resume that is not refused still launches its job."""
    result = CliRunner().invoke(main, ["run", str(REPO / "recipes" / "tiny.yaml"), *COMMON, *extra,
                                       "--run-dir", str(run_dir), "--resume"], prog_name="dsforge")
    return SimpleNamespace(returncode=result.exit_code, stderr=result.stderr)


@dataclass
class _Resumed:
    crashed: Path  # a copy of the run directory as the crash left it
    crash_code: int
    crash_stderr: str
    run_dir: Path  # the same run, resumed to the end
    stderr: str  # of the resumed run


class _ResumedRuns:
    """`resumed_runs / name`: layout `name` crashed and resumed (LAYOUTS), trained the first
    time a test asks for it (the refusal tests need only zero1_dp2)."""

    def __init__(self, out):
        self.out, self.runs = out, {}

    def __truediv__(self, name: str) -> _Resumed:
        if name not in self.runs:
            recipe, extra, fault = LAYOUTS[name]
            run_dir, crashed = self.out / name, self.out / f"{name}-as-crashed"
            crash = _run(recipe, run_dir, extra, env={"DSFORGE_INJECT_FAULT": fault})
            shutil.copytree(run_dir, crashed, symlinks=True)
            resumed = _run(recipe, run_dir, extra, resume=True)
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            self.runs[name] = _Resumed(crashed, crash.returncode, crash.stderr, run_dir,
                                       resumed.stderr)
        return self.runs[name]


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    return _ResumedRuns(tmp_path_factory.mktemp("resumed"))


@pytest.mark.parametrize("name", LAYOUTS)
def test_resume_is_exact(resumed_runs, name):
    run = resumed_runs / name
    assert run.crash_code != 0
    assert (run.crashed / "checkpoints" / "latest").read_text() == RESUMED_FROM
    straight = _losses(run.crashed)  # steps 0-6 (0-7 when the save of step 8 failed)
    assert len(straight) == (8 if LAYOUTS[name][2].startswith("save-exit") else 7)
    assert "resuming" in run.stderr and "after step 4" in run.stderr
    resumed = _losses(run.run_dir)
    assert len(resumed) == 8
    assert resumed[:len(straight)] == straight  # bitwise, including the steps after the resume
    validation = _val_losses(run.crashed)
    assert _val_losses(run.run_dir)[:len(validation)] == validation  # bitwise too
    if "train.eval_every=2" in LAYOUTS[name][1]:  # before each save: the crash's too
        assert [step for step, _ in validation] == [1, 3, 5, 7][:len(straight) // 2]
        assert [step for step, _ in _val_losses(run.run_dir)] == [1, 3, 5, 7]
    assert not _job_processes(run.run_dir)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_as_latest(resumed_runs):
    run = resumed_runs / "zero1_dp2"  # rank 1 died while saving the checkpoint of step 8
    assert run.crash_code != 0
    checkpoints = run.crashed / "checkpoints"
    assert (checkpoints / "latest").read_text() == RESUMED_FROM
    assert (checkpoints / FINAL).exists()  # written in part ...
    assert not (checkpoints / FINAL / "dsforge_complete.json").exists()  # ... never published
    # The lost rank is named first; its peer's broken save is not taken for a full disk.
    # (the step is its last heartbeat's, written every few seconds: at most step 8)
    assert "first failure: rank 1 exited at step " in run.crash_stderr, run.crash_stderr[-3000:]
    assert "with code 9 without a failure record" in run.crash_stderr
    assert "lost a peer rank while saving the checkpoint of step 8" in run.crash_stderr
    assert "disk full" not in run.crash_stderr
    assert "after step 4" in run.stderr  # the resume took the previous one
    assert (run.run_dir / "checkpoints" / "latest").read_text() == FINAL


def _copy_run(resumed_runs, tmp_path, name="zero1_dp2"):
    target = tmp_path / name
    shutil.copytree((resumed_runs / name).run_dir, target)
    return target


def test_resume_with_another_model_is_refused(resumed_runs, tmp_path):
    """The layout may change on resume (tests/distributed/test_reshard.py), the model not: the
    refusal lists the model's differences and not the layout's."""
    run_dir = _copy_run(resumed_runs, tmp_path)
    result = _refused_resume(run_dir, "--set", "parallel.dp=1", "--set", "parallel.tp=2",
                             "--set", "model.num_layers=2")
    assert result.returncode == 2
    assert "model.num_layers: 4 in the checkpoint, 2 now" in result.stderr
    assert "parallel.tp: 1 in the checkpoint" not in result.stderr


def test_world_writable_checkpoint_is_refused_before_unpickling(resumed_runs, tmp_path):
    run_dir = _copy_run(resumed_runs, tmp_path)
    os.chmod(run_dir / "checkpoints" / FINAL / STATE0, 0o666)
    result = _refused_resume(run_dir)
    assert result.returncode == 2 and "writable by every user" in result.stderr


def test_the_marker_lists_every_file_each_rank_wrote(resumed_runs):
    step = (resumed_runs / "zero1_dp2").run_dir / "checkpoints" / FINAL  # saved over a torn one
    files = json.loads((step / "dsforge_complete.json").read_text())["files"]
    on_disk = {str(p.relative_to(step)): p.stat().st_size for p in step.rglob("*")
               if p.is_file() and p.name != "dsforge_complete.json"}
    assert files == on_disk
    assert {"dsforge_rng_rank00000.pt", "dsforge_rng_rank00001.pt",  # and the layout-free state
            "dsforge_state/rank00000.safetensors", "dsforge_state/rank00001.safetensors",
            "dsforge_state/state.json"} <= set(files)
    # The state is written once: nothing of DeepSpeed's engine checkpoint (issue 49).
    assert not [name for name in files if "_states.pt" in name or "experts" in name]


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_optimizer_shard_is_refused_before_any_rank_starts(resumed_runs, tmp_path,
                                                                     damage):
    run_dir = _copy_run(resumed_runs, tmp_path)
    step = run_dir / "checkpoints" / FINAL
    shard = step / "dsforge_state" / "rank00001.safetensors"
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    result = _refused_resume(run_dir)
    assert result.returncode == 2 and "[CK4]" in result.stderr and shard.name in result.stderr
    assert "resuming" not in result.stderr  # refused before the ranks were started


def test_latest_naming_another_runs_checkpoint_is_refused(resumed_runs, tmp_path):
    """../../other-run/checkpoints/step00000008 resumed someone else's run."""
    _copy_run(resumed_runs, tmp_path / "other-run")
    run_dir = _copy_run(resumed_runs, tmp_path / "mine")
    (run_dir / "checkpoints" / "latest").write_text(f"../../../other-run/zero1_dp2/checkpoints/{FINAL}")
    result = _refused_resume(run_dir)
    assert result.returncode == 2 and "[CK1]" in result.stderr


def test_group_writable_checkpoint_of_a_shared_group_is_refused(resumed_runs, tmp_path):
    run_dir = _copy_run(resumed_runs, tmp_path)
    shard = run_dir / "checkpoints" / FINAL / STATE0
    if os.getuid() == 0:
        os.chown(shard, 0, 4242)  # a group with no entry: never the user's private group
    elif trust.private_group(os.getgid(), os.getuid()):
        pytest.skip("needs root to give the file a group other than your private one")
    os.chmod(shard, 0o664)
    result = _refused_resume(run_dir)
    assert result.returncode == 2 and "writable by group" in result.stderr


def test_a_symlinked_file_is_called_a_symlink(resumed_runs, tmp_path):
    run_dir = _copy_run(resumed_runs, tmp_path)
    shard = run_dir / "checkpoints" / FINAL / STATE0
    shard.rename(tmp_path / "moved.pt")
    shard.symlink_to(tmp_path / "moved.pt")
    result = _refused_resume(run_dir)
    assert result.returncode == 2 and "symbolic link" in result.stderr
    assert "writable by every user" not in result.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_checkpoint_of_another_user_is_refused(resumed_runs, tmp_path):
    run_dir = _copy_run(resumed_runs, tmp_path)
    os.chown(run_dir / "checkpoints" / FINAL / "dsforge_complete.json", 4242, 4242)
    result = _refused_resume(run_dir)
    assert result.returncode == 2 and "belongs to uid 4242" in result.stderr


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    result = _refused_resume(tmp_path)
    assert result.returncode == 2 and "no complete checkpoint" in result.stderr
