"""Every resume reads the layout-free state, the checkpoint's only copy of the weights and the
optimizer, and periodic saves are written in the background (issue 49).

A resume from a checkpoint written in the background, on the layout that wrote it, trains the
next steps bitwise as the uninterrupted run did, at every ZeRO stage and under a pipeline,
through the traps of each:
- ZeRO-1 staged in parts (train.checkpoint_staging_gb below a rank's state): the optimizer step
  waits for the writes of all parts but the last;
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

Through `dsforge run`: a writer that hangs is named, with its rank, when the run next waits for
it. A job killed at a random moment while it saves every step (a rank's SIGKILL: its writer is
a thread of it; then `dsforge run`'s SIGTERM during the resume) leaves `latest` on a complete
checkpoint, which resumes exactly. The hung writer has written its files: that save stays
unpublished, invisible. (A rank killed while the last, foreground save is written:
test_checkpoint.py's `save-exit` drill.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dsforge.ckpt.retention import complete_checkpoints
from dsforge.ckpt.trust import latest_complete, read_latest
from dsforge.job import failure
from dsforge.job.run_dir import RunDir
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
    # 1.3 MB of state a rank through 200 kB of host memory: staged and written in 7 parts
    "zero1_in_parts": (TINY, ["zero.stage=1", "train.checkpoint_staging_gb=0.0002"]),
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


def test_a_writer_that_hangs_is_named_and_the_run_ends(tmp_path):
    """Rank 1's writer hangs once it has written the step-4 files: the final save waits for it,
    and the watchdog ends the rank saying what it waited for; the step-4 save is never
    published."""
    run_dir = tmp_path / "run"
    result = dsforge("run", str(TINY), "--set", f"data.source={TEXT}", "--set", "train.steps=6",
                     "--set", "train.checkpoint_every=2", "--run-dir", str(run_dir),
                     "--step-timeout", "5", env={"DSFORGE_INJECT_FAULT": "save-hang:1:4"},
                     timeout=240)
    assert result.returncode != 0
    assert ("rank 1 stuck: step 6 made no progress for 5s (waiting for its checkpoint writer to "
            "write the checkpoint of step 4") in result.stderr, result.stderr[-3000:]
    records = {r.rank: r for r in failure.read_all(RunDir(run_dir))}
    assert records[1].kind == "hang" and "checkpoint writer" in records[1].message
    assert read_latest(run_dir / "checkpoints") == "step00000002"
    assert not _job_processes(run_dir)


def test_a_job_killed_at_random_while_saving_leaves_latest_complete(tmp_path):
    """Saves every step, each in the background while the next trains, and keep_last 2. A
    rank is SIGKILLed at a random moment (its writer is a thread of it); the resume continues
    from `latest` exactly, and `dsforge run` is sent SIGTERM at a random moment of that run
    (exit 75). After each, `latest` is a complete checkpoint that keep_last kept. The seed is
    in every failure's message; DSFORGE_KILL_SEED=N repeats one."""
    seed = int(os.environ.get("DSFORGE_KILL_SEED", random.randrange(2**31)))
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    args = ["run", str(TINY), "--set", f"data.source={TEXT}", "--set", "train.steps=40",
            "--set", "train.checkpoint_every=1", "--set", "train.keep_last=2",
            "--run-dir", str(run_dir)]
    rank = rng.randrange(2)
    code, said = _killed(args, run_dir, rng, lambda proc: os.kill(_rank_pid(run_dir, rank),
                                                                  signal.SIGKILL))
    said = f"SIGKILL of rank {rank} with DSFORGE_KILL_SEED={seed}: {said}"
    assert code not in (0, 75), said
    killed = _latest_is_complete(run_dir, said)
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]]
    code, stderr = _killed([*args, "--resume"], run_dir, rng,
                           lambda proc: proc.send_signal(signal.SIGTERM), after=killed + 1)
    said = f"SIGTERM of the resumed run with DSFORGE_KILL_SEED={seed}: {stderr}"
    assert code == 75 and f"after step {killed}" in stderr, said
    stopped = _latest_is_complete(run_dir, said)
    again = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]]
    assert stopped > killed and len(again) >= stopped, said
    overlap = min(len(losses), len(again))
    assert again[:overlap] == losses[:overlap], said  # the resumed steps, bit for bit


def _killed(args: list[str], run_dir, rng: random.Random, kill, after: int = 0):
    """`dsforge` with `args`, `kill(proc)` at a random moment once `after` + 2 steps are in
    metrics.jsonl; its exit code and stderr's tail."""
    proc = subprocess.Popen([sys.executable, "-m", "dsforge", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _until_steps(run_dir / "metrics.jsonl", after + 2)
        time.sleep(rng.uniform(0.0, 1.5))
        kill(proc)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr[-2000:]


def _rank_pid(run_dir, rank: int) -> int:
    return int(RunDir(run_dir).pid_file(rank).read_text().split()[1])


def _latest_is_complete(run_dir, said: str) -> int:
    """The step a resume takes: a complete checkpoint (the trust checks pass on it), the newest
    one keep_last kept, and nothing of the job left running. Rank 0 publishes a save with its
    completion marker and then `latest` (save_load.publish): killed between the two
    (DSFORGE_KILL_SEED=2121431388 did it), the save is complete but not yet `latest`, and the
    resume still takes it (trust.newest_published)."""
    root = run_dir / "checkpoints"
    record = latest_complete(root)
    assert record is not None, said
    complete = list(complete_checkpoints(root))  # keep_last 2, and one not yet pruned at most
    assert record["step"] == complete[-1] and len(complete) <= 3, said
    assert not _job_processes(run_dir), said
    return record["step"]


def _until_steps(metrics, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{metrics}: fewer than {count} steps after {timeout_s:.0f} s")
