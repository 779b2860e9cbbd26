"""The glue is right: sharded layouts reproduce a single-process run, step by step.

For a fixed tiny model, seed and global batch (8 sequences of 128 tokens of The Tempest per
step), the loss
and the global gradient norm of every step must match the single-process reference
(world 1, 4 microbatches of 2). Weights start layout-invariant (dsforge/runtime/init.py) and
every layout sees the same samples per step, so any difference is a bug in the glue:
gradients reduced over the wrong group, a pipeline message swapped, a shard misplaced.
Tolerance: float32 on CPU; only the order of floating-point sums differs between layouts,
observed differences are ~1e-6, the bound is 1e-4 absolute on the loss and 1e-3 relative on
the gradient norm.

Worlds are spawned once per size and train all their layouts in turn (harness.py).
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.distributed.harness import run_world

# The first test builds every world (and, on a fresh machine, DeepSpeed's CPU Adam and comm
# ops, ~2 minutes of C++ compilation); each world also has its own timeout in the harness.
pytestmark = pytest.mark.timeout(900)

STEPS = 4
TEXT = REPO / "data" / "tempest.u16.bin"
BATCH = [f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2",
         "train.grad_accum=null", "train.warmup_steps=0", "train.timing_warmup=0",
         "train.lr=1.0e-2", f"data.source={TEXT}"]
DENSE, MOE = REPO / "recipes" / "tiny.yaml", REPO / "recipes" / "tiny_moe.yaml"


def _case(*overrides: str) -> list[str]:
    return BATCH + list(overrides)


def _moe(*overrides: str) -> list[str]:
    # A large load-balancing weight, so a mis-scaled auxiliary loss gradient shows.
    return _case("model.moe.aux_loss_coeff=1.0", *overrides)


REFERENCE = {"dense": _case("parallel.dp=1"), "moe": _moe("parallel.dp=1", "parallel.ep=1")}

WORLD2_DENSE = {
    **{f"dp2_zero{s}": _case("parallel.dp=2", f"zero.stage={s}") for s in range(4)},
    "tp2": _case("parallel.dp=1", "parallel.tp=2"),
    "tp2_sp": _case("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "tp2_full_ckpt": _case("parallel.dp=1", "parallel.tp=2", "train.activation_checkpointing=full"),
    "dp2_selective_ckpt": _case("parallel.dp=2", "train.activation_checkpointing=selective"),
    "dp2_zero2_offload": _case("parallel.dp=2", "zero.stage=2", "zero.offload_optimizer=cpu"),
    **{f"pp2_1f1b_zero{s}": _case("parallel.dp=1", "parallel.pp=2", f"zero.stage={s}") for s in (0, 1)},
    **{f"pp2_vpp2_zero{s}": _case("parallel.dp=1", "parallel.pp=2", "parallel.vpp=2", f"zero.stage={s}")
       for s in (0, 1)},
}
WORLD2_MOE = {
    **{f"moe_ep2_zero{s}": _moe("parallel.dp=2", "parallel.ep=2", f"zero.stage={s}") for s in (0, 1, 2)},
    "moe_dp2": _moe("parallel.dp=2", "parallel.ep=1"),
    "moe_pp2": _moe("parallel.dp=1", "parallel.ep=1", "parallel.pp=2"),
    "moe_dp2_zero3": _moe("parallel.dp=2", "parallel.ep=1", "zero.stage=3"),
}
WORLD4_DENSE = {
    "tp2_pp2": _case("parallel.dp=1", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"),
    "pp2_vpp2_dp2": _case("parallel.dp=2", "parallel.pp=2", "parallel.vpp=2"),
    "tp2_dp2_zero3": _case("parallel.dp=2", "parallel.tp=2", "zero.stage=3"),
}
# Not an equivalence (other arithmetic), but the same trajectory within bf16 rounding.
BF16 = {"dp2_bf16": _case("parallel.dp=2", "train.precision=bf16")}
WORLD4_MOE = {
    "moe_tp2_sp_ep2": _moe("parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                           "parallel.ep=2"),
    "moe_pp2_ep2": _moe("parallel.dp=2", "parallel.pp=2", "parallel.ep=2"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every layout's metrics; four worlds, each spawned once."""
    out = tmp_path_factory.mktemp("equivalence")
    found = {}
    found.update(run_world(1, {"ref_dense": REFERENCE["dense"]}, recipe=DENSE, out=out / "w1d"))
    found.update(run_world(1, {"ref_moe": REFERENCE["moe"]}, recipe=MOE, out=out / "w1m"))
    found.update(run_world(2, {**WORLD2_DENSE, **BF16}, recipe=DENSE, out=out / "w2d"))
    found.update(run_world(2, WORLD2_MOE, recipe=MOE, out=out / "w2m"))
    found.update(run_world(4, WORLD4_DENSE, recipe=DENSE, out=out / "w4d"))
    found.update(run_world(4, WORLD4_MOE, recipe=MOE, out=out / "w4m"))
    return found


def _assert_matches(results, name: str, reference: str) -> None:
    got, ref = results[name], results[reference]
    assert len(got) == len(ref) == STEPS, f"{name}: {len(got)} steps recorded"
    for step, (g, r) in enumerate(zip(got, ref)):
        assert g["loss"] == pytest.approx(r["loss"], abs=1e-4), f"{name} loss at step {step}"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-3), f"{name} grad norm at step {step}"


def test_reference_learns(results):
    losses = [r["loss"] for r in results["ref_dense"]]
    assert losses[-1] < losses[0] - 0.5


def test_bf16_follows_the_fp32_trajectory(results):
    for got, ref in zip(results["dp2_bf16"], results["ref_dense"]):
        assert got["loss"] == pytest.approx(ref["loss"], abs=0.05)


@pytest.mark.parametrize("name", [*WORLD2_DENSE, *WORLD4_DENSE])
def test_dense_layout_matches_single_process(results, name):
    _assert_matches(results, name, "ref_dense")


@pytest.mark.parametrize("name", [*WORLD2_MOE, *WORLD4_MOE])
def test_moe_layout_matches_single_process(results, name):
    _assert_matches(results, name, "ref_moe")
