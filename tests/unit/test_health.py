"""The guard's decisions (runtime/guard/health.py), its drills (drills.py), what a bad step
leaves (runtime/loop/bad_steps.py) and the loss a bad step back-propagates (step.py), without
process groups; tests/distributed/test_guard.py runs them in a world, at every ZeRO stage."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from dsforge.job.run_dir import RunDir
from dsforge.launch.output import JobView
from dsforge.launch.start import _stopped
from dsforge.runtime.guard import health
from dsforge.runtime.guard.drills import SPIKE_FACTOR, NumericDrill
from dsforge.runtime.loop import bad_steps
from dsforge.runtime.loop.bad_steps import Halted
from dsforge.runtime.loop.step import _spoiled_if_not_finite
from dsforge.runtime.guard.drills import parse_fault

GOOD = health.StepView(loss=2.0, bad_loss=False, bad_norm=False, skipped=False)
NAN = health.StepView(loss=math.nan, bad_loss=True, bad_norm=True, skipped=True)


def _guard(**train) -> health.Guard:
    fields = dict(on_nonfinite="stop", max_consecutive_skips=2, precision="bf16",
                  spike_factor=2.0, spike_window=3, on_spike="report")
    return health.Guard(SimpleNamespace(**{**fields, **train}))


def test_a_good_step_is_not_bad_and_a_non_finite_one_stops_by_default():
    guard = _guard()
    assert guard.judge(0, GOOD) is None
    bad = guard.judge(1, NAN)
    assert (bad.kind, bad.action, bad.what) == ("nonfinite", "stop",
                                                "non-finite loss and gradient norm")


def test_skip_counts_bad_steps_in_a_row_and_stops_after_the_limit():
    guard = _guard(on_nonfinite="skip")
    assert [guard.judge(s, NAN).action for s in range(2)] == ["skip", "skip"]
    assert guard.judge(2, GOOD) is None  # a good step starts the count again
    assert [guard.judge(s, NAN).action for s in (3, 4)] == ["skip", "skip"]
    last = guard.judge(5, NAN)
    assert last.action == "stop" and last.in_a_row == 3
    assert last.what.endswith("3 steps in a row: more than train.max_consecutive_skips (2)")


def test_a_bad_step_whose_update_was_applied_stops_even_when_skipping():
    """Nothing can take the update back; DeepSpeed 0.19.8 drops them all, but if one ever is
    applied the run must not go on as if it had been skipped."""
    applied = health.StepView(loss=math.nan, bad_loss=True, bad_norm=False, skipped=False)
    bad = _guard(on_nonfinite="skip").judge(0, applied)
    assert bad.action == "stop" and bad.what == "non-finite loss; DeepSpeed applied its update"


def test_fp16_overflows_are_the_loss_scalers_not_bad_steps():
    overflow = health.StepView(loss=3.0, bad_loss=False, bad_norm=True, skipped=True)
    assert _guard(precision="fp16").judge(0, overflow) is None
    assert _guard(precision="bf16").judge(0, overflow).what == "non-finite gradient norm"
    assert _guard(precision="fp16").judge(0, NAN).what == "non-finite loss"


def test_a_spike_is_measured_against_a_full_window():
    guard = _guard()
    assert guard.judge(0, GOOD) is None
    assert guard.judge(1, health.StepView(loss=9.0, bad_loss=False, bad_norm=False,
                                          skipped=False)) is None  # two losses: no median yet
    assert guard.judge(2, GOOD) is None
    spike = guard.judge(3, health.StepView(loss=4.5, bad_loss=False, bad_norm=False,
                                           skipped=False))
    assert spike.kind == "spike" and spike.action == "report"
    assert spike.what == "loss spike: 4.5000 is 2.2x the median 2.0000 of the last 3 steps"
    assert _guard(spike_factor=0.0)._spike(9, 100.0) is None
    stops = _guard(on_spike="stop")
    for step in range(3):
        stops.judge(step, GOOD)
    assert stops.judge(3, health.StepView(loss=5.0, bad_loss=False, bad_norm=False,
                                          skipped=False)).action == "stop"


def _reduced(loss_sum: torch.Tensor, writing: int = 0, pairs: float = 0.0) -> torch.Tensor:
    """What the step's all-reduce (health.reduce_step) leaves: the sum of the ranks' loss
    shares, the number of ranks still writing a checkpoint, the mean step time's sum and the
    score pairs within documents."""
    return torch.stack([loss_sum, torch.tensor(float(writing)), torch.tensor(0.0),
                        torch.tensor(pairs)])


def test_the_loss_shares_and_what_every_rank_reads_from_them():
    device = torch.device("cpu")
    first = health.loss_share(torch.tensor(2.5), adds_loss=True, device=device)
    second = health.loss_share(torch.tensor(1.5), adds_loss=True, device=device)
    tp_peer = health.loss_share(torch.tensor(2.5), adds_loss=False, device=device)
    stage = health.loss_share(None, adds_loss=False, device=device)
    seen = health.view(_reduced(first + second + tp_peer + stage), replicas=2,
                       grad_norm=torch.tensor(0.4), applied=True)
    assert seen == health.StepView(loss=2.0, bad_loss=False, bad_norm=False, skipped=False,
                                   grad_norm=pytest.approx(0.4))
    bad = health.loss_share(torch.tensor(math.inf), adds_loss=True, device=device)
    seen = health.view(_reduced(first + bad), replicas=2, grad_norm=math.inf, applied=False)
    assert seen.bad_loss and seen.bad_norm and seen.skipped and math.isinf(seen.loss)
    assert not health.view(_reduced(first), replicas=1, grad_norm=None, applied=True).bad_norm
    assert health.ranks_writing(_reduced(first, writing=3)) == 3
    # two context-parallel ranks of one replica each counted its whole sequences' pairs
    assert health.view(_reduced(first, pairs=44.0), replicas=2, grad_norm=None, applied=True,
                       cp=2).score_pairs == 22.0
    loss = torch.tensor(3.0)
    share = health.loss_share(loss, adds_loss=True, device=device)
    share += 1  # the rank's own loss stays its own
    assert loss.item() == 3.0


def test_weights_finite_reads_a_zero3_partition():
    layer = torch.nn.Linear(2, 2)
    assert health.weights_finite(layer)
    layer.weight.ds_tensor = torch.tensor([1.0, math.nan])  # ZeRO-3 keeps the rank's part here
    layer.weight.data = torch.empty(0)
    assert not health.weights_finite(layer)


def test_a_non_finite_loss_back_propagates_non_finite_gradients():
    """Cross entropy is infinite where the target's logit is -inf, yet its gradient (softmax
    minus one-hot) is finite; spoiled, DeepSpeed's overflow check sees it."""
    logits = torch.tensor([[0.0, -math.inf]], requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([1]))
    assert math.isinf(loss.item())
    plain, = torch.autograd.grad(loss, logits, retain_graph=True)
    assert torch.isfinite(plain).all()
    spoiled, = torch.autograd.grad(_spoiled_if_not_finite(loss), logits)
    assert torch.isnan(spoiled).all()
    x = torch.tensor([1.5, 2.5], requires_grad=True)
    finite = (x ** 2).mean()
    assert torch.equal(torch.autograd.grad(_spoiled_if_not_finite(finite), x)[0],
                       torch.autograd.grad((x ** 2).mean(), x)[0])  # bitwise the same


def _drilled(spec: str, rank: int = 1):
    drill = NumericDrill(parse_fault(spec), rank)
    layer = torch.nn.Linear(2, 2)
    drill.attach([layer])
    return drill, layer


def test_the_nan_and_spike_drills_scale_one_steps_output_once():
    drill, layer = _drilled("nan:1:3")
    x = torch.ones(1, 2)
    for step in range(5):
        drill.before_step(step)
        assert torch.isnan(layer(x)).all() == (step == 3)
        drill.before_step(step)  # before a validation batch of the same step: clean
        assert torch.isfinite(layer(x)).all()
        drill.after_step(step, layer)
    drill, layer = _drilled("spike:1:0")
    drill.before_step(0)
    with torch.no_grad():
        assert torch.allclose(layer(x), SPIKE_FACTOR * torch.nn.functional.linear(x, layer.weight,
                                                                                   layer.bias))
    drill, layer = _drilled("nan-from:1:1")
    hits = []
    for step in range(4):
        drill.before_step(step)
        hits.append(bool(torch.isnan(layer(x)).all()))
    assert hits == [False, True, True, True]
    drill, layer = _drilled("nan:1:3", rank=0)  # another rank's drill
    drill.before_step(3)
    assert torch.isfinite(layer(x)).all()


def test_the_weights_drill_spoils_a_weight_after_its_step():
    drill, layer = _drilled("nan-weights:1:2")
    drill.before_step(2)
    assert torch.isfinite(layer(torch.ones(1, 2))).all()  # the step itself is clean
    drill.after_step(1, layer)
    assert health.weights_finite(layer)
    drill.after_step(2, layer)
    assert not health.weights_finite(layer)


def _complete(root, step):
    tag = f"step{step:08d}"
    (root / tag).mkdir(parents=True)
    (root / tag / "dsforge_complete.json").write_text(json.dumps(
        {"step": step, "tag": tag, "world_size": 2, "recipe": {}, "files": {}}))
    (root / "latest").write_text(tag)


DATA = {"samples": [24, 31], "source": "training samples",
        "documents": {"data/wiki": list(range(100, 112))}}


def test_the_report_names_the_last_good_checkpoint_and_how_to_go_on(tmp_path):
    run_dir = RunDir(tmp_path)
    root = run_dir.checkpoints
    halted = Halted(step=3, what="non-finite loss and gradient norm", kind="nonfinite",
                    ranks=[1], data=DATA)
    lines = bad_steps.report_lines(halted, run_dir=run_dir, skipped_updates=1, fp16=False)
    assert lines[0] == ("dsforge: the training stopped at step 4: non-finite loss and gradient "
                        "norm (on rank 1)")
    assert lines[1] == "  DeepSpeed skipped 1 update of this run (non-finite gradients)"
    assert lines[2] == ("  its data: samples 24..31 of training samples; documents of data/wiki: "
                        "100, 101, 102, 103, 104, 105, 106, 107, ... (12 in all, in "
                        "anomalies.jsonl)")
    assert lines[3] == "  no checkpoint had been saved before it"
    assert "start a new run with train.on_nonfinite: skip" in lines[4]
    _complete(root, 2)
    lines = bad_steps.report_lines(halted, run_dir=run_dir, skipped_updates=1, fp16=False)
    assert lines[3] == (f"  the last good checkpoint: {root / 'step00000002'} (after step 2, "
                        "`latest`); nothing was saved after it")
    assert lines[4].endswith(f"--resume --run-dir {tmp_path} --set train.on_nonfinite=skip; or "
                             "start a new run with a lower train.lr or train.grad_clip")
    _complete(root, 3)  # saved right before the bad step: the update before it may be the cause
    text = bad_steps.report_lines(halted, run_dir=run_dir, skipped_updates=1, fp16=False)[3]
    assert text.endswith("It was saved right before the bad step, so the update of step 3 may be "
                         "the cause; the checkpoint before it is after step 2")
    diverged = Halted(step=9, what="...", kind="nonfinite", in_a_row=6)
    assert "the run has likely diverged: go back to an earlier checkpoint" in \
        bad_steps.report_lines(diverged, run_dir=run_dir, skipped_updates=6, fp16=True)[-1]


def test_a_skipped_steps_line_says_what_the_run_did():
    bad = health.BadStep(step=3, kind="nonfinite", what="non-finite loss", action="skip",
                         in_a_row=1)
    assert bad_steps.line(bad, [1, 3], {"samples": [24, 31], "source": "synthetic samples"}, 5) \
        == ("dsforge: step 4: non-finite loss (on ranks 1, 3); its update was skipped (1 in a "
            "row; more than 5 in a row stop the run); its data: samples 24..31 of synthetic "
            "samples")


def test_dsforge_run_reads_halted_ranks_and_a_stop_without_its_checkpoint(tmp_path):
    view = JobView(out=open("/dev/null", "w"))
    view.feed('@dsforge {"kind": "halted", "rank": 0, "step": 3, "reason": "non-finite loss"}')
    assert view.halted_ranks == {0: (3, "non-finite loss")}
    said = []
    run_dir = RunDir(tmp_path)
    assert _stopped(run_dir, {0: (7, "SIGTERM", False)}, said.append) == 1
    assert "nothing to resume" in said[-1]
    _complete(run_dir.checkpoints, 6)
    assert _stopped(run_dir, {0: (7, "SIGTERM", False)}, said.append) == 75
    assert said[-1].endswith("(from the checkpoint after step 6)")


@pytest.mark.parametrize("overrides, rule", [
    (["train.lr_decay_steps=2"], "R5"),  # not above warmup_steps (2 in tiny.yaml)
    (["train.lr_decay=constant", "train.lr_decay_steps=40"], "R5"),  # no decay to end
    (["train.max_consecutive_skips=0"], "R1"),
    (["train.spike_factor=1.0"], "R1"),
    (["train.spike_window=0"], "R1"),
    (["train.on_nonfinite=ignore"], "Y3"),
])
def test_the_guard_and_schedule_fields_are_checked(overrides, rule):
    from dsforge.problems import RecipeError
    from dsforge.recipe import load_recipe
    from tests.conftest import REPO

    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / "recipes" / "tiny.yaml", overrides)
    assert [p.rule for p in info.value.problems] == [rule]


def test_the_schedule_spans_lr_decay_steps():
    from dsforge.recipe import load_recipe
    from dsforge.translate.deepspeed_config import scheduler_section
    from tests.conftest import REPO

    tiny = REPO / "recipes" / "tiny.yaml"
    assert scheduler_section(load_recipe(tiny).train)["params"]["total_num_steps"] == 20
    longer = load_recipe(tiny, ["train.lr_decay_steps=40"]).train
    assert scheduler_section(longer)["params"]["total_num_steps"] == 40
    linear = load_recipe(tiny, ["train.lr_decay=linear", "train.lr_decay_steps=30"]).train
    assert scheduler_section(linear)["params"]["total_num_steps"] == 30
