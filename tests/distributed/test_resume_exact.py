"""Every resume reads the layout-free state, the checkpoint's only copy of the weights and the
optimizer (issue 49): on the layout that wrote it, the resumed steps equal an uninterrupted
run's bitwise, at every ZeRO stage and precision, through the traps of each:
- ZeRO-0 in bf16: DeepSpeed's 16-bit wrapper takes an Adam step with zero gradients when it
  is built, so its step count runs one ahead (docs/checkpoints.md); the checkpoint keeps the
  count as it is;
- ZeRO-2 with the optimizer offloaded: DeepSpeed's CPU Adam keeps its step as an int;
- ZeRO-3 in bf16: the 16-bit partitions are cast from the fp32 ones.
(ZeRO-1 and ZeRO-3 in fp32, the pipeline and the experts of an MoE model are proven through
`dsforge run` in test_checkpoint.py, other layouts in test_reshard.py. DeepSpeed refuses fp16
on a CPU; the loss scaler's state is tests/unit/test_layout_free.py's.)

One world of 2 ranks (legs_worker.py) trains, for each case, 4 straight steps, and 2 steps
then a resume for the other 2; the schedule spans 4 steps in both (train.lr_decay_steps).
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.distributed.legs_worker import run_legs
from tests.distributed.test_checkpoint import TEXT
from dsforge.job.metrics_file import read_metrics

pytestmark = pytest.mark.timeout(600)

TINY = REPO / "recipes" / "tiny.yaml"
COMMON = [f"data.source={TEXT}", "train.checkpoint_every=2", "train.lr_decay_steps=4",
          "train.warmup_steps=0", "train.timing_warmup=0"]
CASES = {
    "zero0_bf16": ["zero.stage=0", "train.precision=bf16"],
    "zero2_offload": ["zero.stage=2", "zero.offload_optimizer=cpu"],
    "zero3_bf16": ["zero.stage=3", "train.precision=bf16"],
}


def _legs() -> list[dict]:
    legs = []
    for name, overrides in CASES.items():
        legs += [{"run": f"{name}-straight", "overrides": COMMON + overrides + ["train.steps=4"],
                  "resume": False},
                 {"run": f"{name}-resumed", "overrides": COMMON + overrides + ["train.steps=2"],
                  "resume": False},
                 {"run": f"{name}-resumed", "overrides": COMMON + overrides + ["train.steps=4"],
                  "resume": True}]
    return legs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_exact")
    ends = run_legs(out, TINY, _legs(), timeout_s=540)
    assert ends == [None] * len(ends)
    return out


def _steps(run_dir) -> list[tuple[float, float | None, float]]:
    return [(r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(run_dir / "metrics.jsonl")[0]]


@pytest.mark.parametrize("name", CASES)
def test_a_resume_on_the_same_layout_is_bitwise(world, name):
    straight, resumed = _steps(world / f"{name}-straight"), _steps(world / f"{name}-resumed")
    assert len(straight) == len(resumed) == 4
    assert resumed == straight  # loss, gradient norm and rate of every step, bit for bit
    checkpoint = world / f"{name}-resumed" / "checkpoints" / "step00000002"
    assert not [p.name for p in checkpoint.iterdir() if p.name.endswith("_states.pt")]
