"""Every resume reads the layout-free state, the checkpoint's only copy of the weights and the
optimizer, and periodic saves are written in the background (issue 49).

A resume from a checkpoint written in the background, on the layout that wrote it, trains the
next steps bitwise as the uninterrupted run did, at every ZeRO stage and under a pipeline,
through the traps of each:
- ZeRO-0 in bf16: DeepSpeed's 16-bit wrapper takes an Adam step with zero gradients when it
  is built, so its step count runs one ahead (docs/checkpoints.md); the checkpoint keeps the
  count as it is;
- ZeRO-2 with the optimizer offloaded: DeepSpeed's CPU Adam keeps its step as an int;
- ZeRO-3 in bf16: the 16-bit partitions are cast from the fp32 ones.
- ZeRO-3 in fp32: no 16-bit copy, the fp32 partitions are the weights;
- a pipeline with validation before and after the resume (a hang source in Megatron's tools):
  the held-out losses are bitwise too;
- the experts of an MoE model (ep 2): their state is partitioned over the expert-data-parallel
  ranks, not the data-parallel ones.
(Another layout's resume is test_reshard.py's; the crash-and-resume through `dsforge run` is
test_checkpoint.py's. DeepSpeed refuses fp16 on a CPU; the loss scaler's state is
tests/unit/test_layout_free.py's.)

One world of 2 ranks (legs_worker.py) trains each case 4 steps straight, saving after step 2
(in the background: published at step 3's all-reduce) and after step 4 (in the foreground, the
last); a copy of that run resumes the step-2 checkpoint and trains steps 3 and 4 again.

Through `dsforge run`: a rank whose background writer dies after writing its files leaves that
checkpoint unpublished; the previous one stays `latest` and the run resumes from it, exactly.
"""

from __future__ import annotations

import json

import pytest

from dsforge.ckpt.retention import complete_checkpoints
from dsforge.ckpt.trust import read_latest
from dsforge.job.metrics_file import read_metrics
from tests.conftest import REPO
from tests.distributed.legs_worker import run_legs
from tests.distributed.test_checkpoint import TEXT
from tests.distributed.test_run import _job_processes, dsforge

pytestmark = pytest.mark.timeout(600)

TINY = REPO / "recipes" / "tiny.yaml"
TINY_MOE = REPO / "recipes" / "tiny_moe.yaml"
COMMON = [f"data.source={TEXT}", "train.checkpoint_every=2", "train.steps=4",
          "train.warmup_steps=0", "train.timing_warmup=0"]
CASES = {  # name -> (recipe, overrides)
    "zero0_bf16": (TINY, ["zero.stage=0", "train.precision=bf16"]),
    "zero1": (TINY, ["zero.stage=1"]),
    "zero2_offload": (TINY, ["zero.stage=2", "zero.offload_optimizer=cpu"]),
    "zero3_bf16": (TINY, ["zero.stage=3", "train.precision=bf16"]),
    "zero3_fp32": (TINY, ["zero.stage=3", "train.precision=fp32"]),
    "pp2_zero1_eval": (TINY, ["parallel.dp=1", "parallel.pp=2", "zero.stage=1",
                              "train.eval_every=1", "train.eval_iters=1"]),
    "moe_ep2_zero1": (TINY_MOE, ["zero.stage=1"]),
}
WRITTEN_IN_THE_BACKGROUND = "step00000002"


def _legs() -> list[dict]:
    legs = []
    for name, (recipe, overrides) in CASES.items():
        legs += [{"run": f"{name}-straight", "recipe": str(recipe), "overrides": COMMON + overrides,
                  "resume": False},
                 {"run": f"{name}-resumed", "recipe": str(recipe), "overrides": COMMON + overrides,
                  "resume": True, "copy_of": f"{name}-straight",
                  "latest": WRITTEN_IN_THE_BACKGROUND}]
    return legs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_exact")
    ends = run_legs(out, TINY, _legs(), timeout_s=540)
    assert ends == [None] * len(ends)
    return out


def _steps(run_dir) -> list[tuple[float, float | None, float]]:
    return [(r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(run_dir / "metrics.jsonl")[0]]


def _validation(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in read_metrics(run_dir / "metrics.jsonl")[1]]


@pytest.mark.parametrize("name", CASES)
def test_a_resume_from_a_background_save_is_bitwise(world, name):
    straight, resumed = world / f"{name}-straight", world / f"{name}-resumed"
    assert list(complete_checkpoints(straight / "checkpoints")) == [2, 4]
    assert len(_steps(straight)) == len(_steps(resumed)) == 4
    assert _steps(resumed) == _steps(straight)  # loss, gradient norm and rate, bit for bit
    assert _validation(resumed) == _validation(straight)  # the held-out losses too
    if "train.eval_every=1" in CASES[name][1]:
        assert [step for step, _ in _validation(straight)] == [0, 1, 2, 3]
    checkpoint = straight / "checkpoints" / WRITTEN_IN_THE_BACKGROUND
    files = json.loads((checkpoint / "dsforge_complete.json").read_text())["files"]
    assert not [name for name in files if name.endswith("_states.pt")]  # the state once


def test_a_writer_that_dies_leaves_its_checkpoint_invisible(tmp_path):
    """Rank 1 dies (os._exit) right after its writer wrote the step-4 files, before every rank
    had written and the save was published: `latest` stays the step-2 checkpoint, which
    the resume continues, its steps equal to the crashed run's."""
    run_dir = tmp_path / "run"
    args = ["run", str(TINY), "--set", f"data.source={TEXT}", "--set", "train.steps=6",
            "--set", "train.checkpoint_every=2", "--run-dir", str(run_dir)]
    crashed = dsforge(*args, env={"DSFORGE_INJECT_FAULT": "save-exit:1:4"}, timeout=240)
    assert crashed.returncode != 0
    root = run_dir / "checkpoints"
    assert read_latest(root) == "step00000002" and list(complete_checkpoints(root)) == [2]
    assert not (root / "step00000004" / "dsforge_complete.json").exists()
    assert not _job_processes(run_dir)
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]]
    resumed = dsforge(*args, "--resume", timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "after step 2" in resumed.stderr
    again = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]]
    assert len(again) == 6 and again[:len(losses)] == losses
    assert list(complete_checkpoints(root)) == [2, 4, 6]
