"""The host floor under each layer's grad-enabled forward: its wait in the step time
(dsforge/cost/step_time.py) and its fit in the refit (cost/fit.py, cost/floor_fit.py)."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

from dsforge.cost import fit as cal
from dsforge.cost.fit import term_margins
from dsforge.cost.floor_fit import Waits, fit_floors
from dsforge.cost.profile import default_profile
from dsforge.cost.step_time import forward_share, step_time
from dsforge.recipe import resolve_file
from tests.conftest import REPO

ONE_B = REPO / "benchmarks" / "gpu" / "recipes" / "1b_1gpu.yaml"
BARE = dataclasses.replace(default_profile("h200", gpus_per_node=1), host_layer_s=0.0,
                           host_layer_zero3_s=0.0)
FLOORED = dataclasses.replace(BARE, host_layer_s=0.003, host_layer_zero3_s=0.008)
# A machine the tests "measure": compute 10% slower than the profile, floors of 3 and 8 ms.
TRUE = {"compute": 1.1, "fixed": 0.0, "gathers": 0.0, "optimizer": 1.0, "communication": 1.0,
        "host": 0.003, "host_zero3": 0.008}
# The floors bind where the 1B's layers are short (micro-batch 1, or the recompute at 2): two
# such runs at each ZeRO floor, so that each run left out leaves one that determines it.
LAYOUTS = [("train.micro_batch=1",), ("train.micro_batch=2",), ("train.micro_batch=4",),
           ("train.micro_batch=1", "train.activation_checkpointing=selective"),
           ("train.micro_batch=2", "train.activation_checkpointing=full"),
           ("zero.stage=3", "train.micro_batch=1"), ("zero.stage=3", "train.micro_batch=4"),
           ("zero.stage=3", "train.micro_batch=2", "train.activation_checkpointing=full")]


def _layout(*overrides):
    return resolve_file(ONE_B, list(overrides), world_size=1)


def _points(*layouts, machine=TRUE) -> list[cal.Point]:
    truth = cal.apply(BARE, machine)
    return [cal.Point(" ".join(o), r := _layout(*o), step_time(r, truth).total) for o in layouts]


def _pass_s(resolved, profile) -> float:
    """The device's seconds of one layer's grad-enabled forward, one microbatch."""
    t = resolved.recipe.train
    layers = resolved.layout.grad_accum * resolved.recipe.model.num_layers
    share = forward_share(resolved.recipe.model, t.seq_len, t.activation_checkpointing)
    return step_time(resolved, profile).compute * share / layers


def test_the_wait_is_what_each_layers_forward_falls_short_of_its_floor():
    for overrides, floor in ((("train.micro_batch=1",), 0.003),
                             (("zero.stage=3", "train.micro_batch=1"), 0.008),
                             (("train.micro_batch=2", "train.activation_checkpointing=full"), 0.003)):
        resolved = _layout(*overrides)
        layers = resolved.layout.grad_accum * resolved.recipe.model.num_layers
        pass_s = _pass_s(resolved, BARE)
        assert 0 < pass_s < floor  # the 1B's layers are short: the floor binds
        with_floor, without = step_time(resolved, FLOORED), step_time(resolved, BARE)
        assert with_floor.host == pytest.approx(layers * (floor - pass_s), rel=1e-9)
        assert with_floor.total == pytest.approx(without.total + with_floor.host, rel=1e-9)
    long = _layout("train.micro_batch=8")
    hidden = dataclasses.replace(FLOORED, host_layer_s=0.9 * _pass_s(long, BARE))
    assert step_time(long, hidden).host == 0.0  # a forward longer than the floor hides it


def test_the_refit_recovers_the_floors_and_the_compute_scale():
    points = _points(*LAYOUTS)
    coefficients = cal.fit(points, BARE, host_floors=True)
    assert coefficients["compute"] == pytest.approx(TRUE["compute"], rel=1e-3)
    assert coefficients["host"] == pytest.approx(TRUE["host"], abs=1e-4)
    assert coefficients["host_zero3"] == pytest.approx(TRUE["host_zero3"], abs=1e-4)
    assert coefficients["fixed"] == coefficients["gathers"] == 0.0  # the floors replace them
    calibration = cal.calibrate(points, BARE, measured_on="test", host_floors=True)
    assert all(r.left_out_s == pytest.approx(r.measured_s, rel=5e-3) for r in calibration.rows)
    assert calibration.after.host_layer_zero3_s == pytest.approx(0.008, abs=1e-4)


def test_without_host_floors_the_refit_clears_them_and_fits_additive_costs():
    """On a CPU the host is the device: its costs add, and a GPU profile's floors go."""
    coefficients = cal.fit(_points(*LAYOUTS), FLOORED)
    assert (coefficients["host"], coefficients["host_zero3"]) == (0.0, 0.0)
    assert coefficients["fixed"] > 0


def test_a_floor_no_run_determines_keeps_the_profiles():
    points = _points(*(o for o in LAYOUTS if "zero.stage=3" not in o))
    coefficients = cal.fit(points, FLOORED, host_floors=True)
    assert coefficients["host"] == pytest.approx(TRUE["host"], abs=1e-4)
    assert coefficients["host_zero3"] == FLOORED.host_layer_zero3_s


def test_a_floor_that_binds_in_no_run_keeps_the_profiles_where_the_runs_allow_it():
    """Runs whose layers are all longer than the ZeRO 0-2 floor (the 1B at micro-batch 4 and
    8) say only that it is no higher than their forward: the profile's floor stays, not 0; a
    profile's floor above what the runs allow comes down to it."""
    long = [("train.micro_batch=4",), ("train.micro_batch=8",),
            ("zero.stage=3", "train.micro_batch=1"), ("zero.stage=3", "train.micro_batch=2")]
    points = _points(*long)
    assert all(step_time(p.resolved, cal.apply(BARE, TRUE)).host == 0.0 for p in points[:2])
    coefficients = cal.fit(points, FLOORED, host_floors=True)
    assert coefficients["host"] == pytest.approx(FLOORED.host_layer_s, abs=1e-5)
    assert coefficients["host_zero3"] == pytest.approx(TRUE["host_zero3"], abs=1e-4)
    shortest = min(_pass_s(p.resolved, cal.apply(BARE, coefficients)) for p in points[:2])
    high = dataclasses.replace(FLOORED, host_layer_s=5 * shortest)
    assert cal.fit(points, high, host_floors=True)["host"] <= shortest * 1.01


def test_runs_that_repeat_a_layout_determine_one_floor_not_two():
    """On one GPU ZeRO-0 and ZeRO-1 differ in nothing the model sees: with one ZeRO-3 run they
    are two distinct points, enough for the compute and one floor (the first: ZeRO 0-2's)."""
    full = ("train.activation_checkpointing=full", "train.micro_batch=1")
    points = _points(("zero.stage=0", *full), ("zero.stage=1", *full), ("zero.stage=3", *full))
    coefficients = cal.fit(points, FLOORED, host_floors=True)
    assert coefficients["host_zero3"] == FLOORED.host_layer_zero3_s
    assert coefficients["host"] > 0


def test_no_floor_may_run_the_gemms_faster_than_the_peak():
    """Two points a floor alone could explain (compute scale 0.5): refused where the profile's
    efficiency of 0.8 would go above 1; the fit keeps the scale at or above it."""
    waits = Waits(zero3=np.array([False, False]), layers=np.array([10.0, 20.0]),
                  pass_per_term=np.array([[0.001], [0.001]]), pass_kept=np.zeros(2),
                  measured_s=np.array([1.0, 1.0]))
    x = np.array([[1.0], [0.5]])  # compute's share of each measured step at scale 1
    target = 0.5 * x[:, 0] + waits.relative(np.array([0.02]), np.array([0.0]),
                                            np.array([[0.5]]))[:, 0]
    compute_only = partial(term_margins, ["compute"])
    free = fit_floors(x, target, waits, (True, False), (0.0, 0.0), np.ones(1), min_compute=0.0,
                      margins=compute_only)
    assert free.solution[0] == pytest.approx(0.5, rel=1e-6) and free.host == pytest.approx(0.02)
    bound = fit_floors(x, target, waits, (True, False), (0.0, 0.0), np.ones(1), min_compute=0.8,
                       margins=compute_only)
    assert bound.solution is None or bound.solution[0] >= 0.8


def test_calibrate_times_the_floor_on_the_recipes_own_layers_at_few_tokens():
    """calibrate/layer_timing.py: the recipe's model at 1 and 3 layers on one device, one
    microbatch of a few tokens, at each ZeRO stage; MoE layers stay MoE."""
    from dsforge.calibrate.layer_timing import HOST_SEQ_LEN, small_recipe

    for path in ("recipes/70b_pp4.yaml", "recipes/moe_32gpu_tp4_ep2.yaml"):
        resolved = resolve_file(REPO / path)
        for layers, stage in ((1, 0), (3, 3)):
            small = small_recipe(resolved, layers, stage)
            m, lay = small.recipe.model, small.layout
            assert (m.num_layers, small.recipe.zero.stage) == (layers, stage)
            assert (m.hidden_size, m.ffn_hidden_size) == (resolved.recipe.model.hidden_size,
                                                          resolved.recipe.model.ffn_hidden_size)
            assert (lay.world_size, lay.tp, lay.pp, lay.micro_batch, lay.grad_accum) == (1, 1, 1, 1, 1)
            assert small.recipe.train.seq_len == HOST_SEQ_LEN
            assert (m.moe is None) == (resolved.recipe.model.moe is None)


def _measured_layers(forward_per_layer_s: float = 0.010, zero3_per_layer_s: float = 0.0105) -> dict:
    """What calibrate/layer_timing.py returns, made up: floors of 3 and 8 ms; a layer of the 1B
    at 8,192 tokens taking 30 ms forward and backward, its forward 10.5 ms at ZeRO-3."""
    return {"floors": {0: {"forward_s": {1: 0.010, 3: 0.016}, "per_layer_s": 0.003},
                       3: {"forward_s": {1: 0.020, 3: 0.036}, "per_layer_s": 0.008}},
            "work": {"tokens": 8192, "forward_s": {1: 0.02, 3: 0.02 + 2 * forward_per_layer_s},
                     "forward_backward_s": {1: 0.05, 3: 0.11},
                     "forward_per_layer_s": forward_per_layer_s, "per_layer_s": 0.030},
            "zero3": {"tokens": 8192, "forward_s": {}, "per_layer_s": zero3_per_layer_s}}


ATTENTION = {"backends": {"auto": {"seconds": 0.004, "tflops_full_matrix": 300.0}}}


def test_the_measured_floors_and_other_work_go_into_a_gpus_profile_and_not_a_cpus():
    from dsforge.calibrate.kernel_timing import model_gemms
    from dsforge.calibrate.layers import layer_fields, layer_lines, other_work

    resolved = _layout("train.micro_batch=2")
    layers, rate = _measured_layers(), 600e12
    gemm_s = 3 * sum(g.flops for g in model_gemms(resolved.recipe.model, 8192)
                     if g.name != "logits") / rate
    other = other_work(resolved, layers, rate, ATTENTION)
    assert other["rest_s"] == pytest.approx(0.030 - gemm_s - 0.004)
    assert other["per_token_hidden_s"] == pytest.approx(other["rest_s"] / (8192 * 2048))
    fields = layer_fields(layers, "cuda", resolved, rate, ATTENTION)
    assert fields == {"host_layer_s": 0.003, "host_layer_zero3_s": 0.008,
                      "other_s_per_token_hidden": other["per_token_hidden_s"]}
    assert layer_fields(layers, "cpu", resolved, rate, ATTENTION) == {
        "host_layer_s": 0.0, "host_layer_zero3_s": 0.0, "other_s_per_token_hidden": 0.0}
    assert layer_fields("RuntimeError: no room", "cuda", resolved, rate, ATTENTION) == {}
    measured = dataclasses.replace(FLOORED, **fields)
    lines = layer_lines(layers, measured, resolved, rate, ATTENTION, on_gpu=True)
    assert "ZeRO-0 3 ms a layer (1 layer 10 ms, 3 layers 16 ms)" in lines[0]
    assert "(other_s_per_token_hidden)" in lines[1]
    assert "paced by the device's work: host_layer_zero3_s is the bare layer's" in lines[2]
    failed = layer_lines("RuntimeError: no room", FLOORED, resolved, rate, ATTENTION, on_gpu=True)[0]
    assert "not measured (RuntimeError: no room)" in failed and "3 ms and 8 ms" in failed


def test_a_zero3_forward_the_host_paces_at_the_recipes_shapes_sets_the_zero3_floor():
    """The bare layer's 8 ms bounds the ZeRO-3 floor from below. Where the recipe's own ZeRO-3
    forward takes 10% or more over its ZeRO-0 forward (10 ms), the host's fetches pace it, and
    its time a layer is the floor at these shapes; within 10% the device's work paces it, and
    the bare layer's floor stands (the recipe's forward bounds it only from above)."""
    from dsforge.calibrate.layers import layer_fields, layer_lines, zero3_floor

    resolved = _layout("train.micro_batch=2")
    assert zero3_floor(_measured_layers(zero3_per_layer_s=0.0105)) == 0.008  # device-paced
    assert zero3_floor(_measured_layers(zero3_per_layer_s=0.013)) == 0.013  # host-paced
    short = _measured_layers(forward_per_layer_s=0.003, zero3_per_layer_s=0.005)
    assert zero3_floor(short) == 0.008  # paced, yet under the bare floor: the larger
    paced = _measured_layers(zero3_per_layer_s=0.013)
    assert layer_fields(paced, "cuda", resolved, 600e12, ATTENTION)["host_layer_zero3_s"] == 0.013
    assert layer_fields(paced, "cpu", resolved, 600e12, ATTENTION)["host_layer_zero3_s"] == 0.0
    line = layer_lines(paced, FLOORED, resolved, 600e12, ATTENTION, on_gpu=True)[2]
    assert line == ("a layer at 8,192 tokens at ZeRO-3: forward 13 ms against 10 ms at ZeRO-0, "
                    "paced by the host's fetches: host_layer_zero3_s 13 ms, the larger of it and "
                    "the bare layer's")
    cpu = layer_lines(paced, FLOORED, resolved, 600e12, ATTENTION, on_gpu=False)[2]
    assert cpu.endswith("not in a CPU's profile (--measure's gathers term stands for it)")


def test_a_slope_the_larger_count_did_not_time_longer_is_reported_and_kept_out():
    """Noise (a busy machine) gives a slope at or under 0: clamped to 0 it would write a 0
    floor or 0 `other` into a GPU's profile as if measured. The GPU's defaults stay instead,
    and the lines say so."""
    from dsforge.calibrate.layers import NOT_RESOLVED, layer_fields, layer_lines, other_work

    resolved = _layout("train.micro_batch=2")
    noisy = _measured_layers()
    noisy["floors"][0] = {"forward_s": {1: 0.016, 3: 0.010}, "per_layer_s": 0.0}
    noisy["work"]["forward_backward_s"] = {1: 0.11, 3: 0.05}
    noisy["work"]["forward_s"] = {1: 0.03, 3: 0.02}
    fields = layer_fields(noisy, "cuda", resolved, 600e12, ATTENTION)
    assert fields == {"host_layer_zero3_s": 0.008}  # the rest keep the GPU's defaults
    assert other_work(resolved, noisy, 600e12, ATTENTION) == NOT_RESOLVED
    lines = layer_lines(noisy, FLOORED, resolved, 600e12, ATTENTION, on_gpu=True)
    assert f"3 layers 10 ms; {NOT_RESOLVED}, the default kept)" in lines[0]
    assert f"forward 10 ms ({NOT_RESOLVED})" in lines[1] and "the rest not measured" in lines[1]


def test_the_other_work_is_not_measured_where_the_host_paces_the_layer():
    from dsforge.calibrate.layers import layer_fields, other_work

    resolved = _layout("train.micro_batch=2")
    host_bound = _measured_layers(forward_per_layer_s=0.004)  # within 1.5 x the 3 ms floor
    assert "host-bound" in other_work(resolved, host_bound, 600e12, ATTENTION)
    assert "other_s_per_token_hidden" not in layer_fields(host_bound, "cuda", resolved, 600e12,
                                                          ATTENTION)


def test_an_moe_layers_other_work_is_what_its_experts_router_and_attention_leave():
    """Every layer an MoE layer (moe_1gpu): its experts, timed alone as the layer runs them,
    and its router and attention products come out of its time in place of a dense MLP's; a
    model that mixes dense and MoE layers (frequency 2) is not measured: the slope between 1
    and 3 layers is neither kind."""
    from dsforge.calibrate.layers import layer_lines, other_work

    moe = resolve_file(REPO / "recipes" / "moe_1gpu.yaml", ["train.micro_batch=2"])
    m, rate = moe.recipe.model, 600e12
    layers = {**_measured_layers(), "experts": {"seconds": 0.012}}
    h, heads, groups, d = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    gemm_s = 6 * 8192 * h * ((heads + 2 * groups) * d + heads * d + m.moe.num_experts) / rate
    other = other_work(moe, layers, rate, ATTENTION)
    assert other["gemm_s"] == pytest.approx(gemm_s)
    assert other["rest_s"] == pytest.approx(0.030 - gemm_s - 0.004 - 0.012)
    lines = layer_lines(layers, FLOORED, moe, rate, ATTENTION, on_gpu=True)
    assert "attention (4 ms) and experts (12 ms)" in lines[1]
    no_kernel = {**layers, "experts": {"error": "no grouped GEMM"}}
    assert other_work(moe, no_kernel, rate, ATTENTION) == "the experts had no kernel at these shapes"
    mixed = resolve_file(REPO / "recipes" / "moe_1gpu.yaml", ["model.moe.frequency=2"])
    assert "mixes dense and MoE layers" in other_work(mixed, layers, rate, ATTENTION)
