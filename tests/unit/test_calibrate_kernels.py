"""`dsforge calibrate`'s float8 GEMM and MoE experts timings (calibrate/float8_timing.py,
expert_timing.py), and the step-time model pricing the experts at `expert_efficiency`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsforge.calibrate import expert_timing, float8_timing, layers
from dsforge.cost import fit as cal
from dsforge.cost.profile import default_profile, read_profile
from dsforge.cost.step_time import _flop_rate, step_time
from dsforge.estimate.flops import pipeline_rank_flops
from dsforge.estimate.params import layer_expert_params, layer_matmul_params
from dsforge.problems import RecipeError
from dsforge.recipe import resolve_file
from tests.conftest import REPO

CPU = torch.device("cpu")
H100 = default_profile("h100", gpus_per_node=8)


def _tiny(*overrides, world_size=1):
    return resolve_file(REPO / "recipes" / "tiny.yaml", ["parallel.dp=1", *overrides],
                        world_size=world_size)


def _tiny_moe(*overrides, world_size=2):
    return resolve_file(REPO / "recipes" / "tiny_moe.yaml", list(overrides), world_size=world_size)


def test_the_float8_product_is_timed_against_bf16_at_the_layer_shapes():
    """On a CPU torch's reference float8 product runs: both sides timed (three passes each),
    the speedup their ratio; the output layer is not among the products, which run over a
    rank's tokens (a context-parallel shard under cp)."""
    resolved = _tiny("train.micro_batch=1", "train.seq_len=64")
    assert [g.name for g in float8_timing.layer_gemms(resolved)] == ["qkv", "proj", "fc1", "fc2"]
    sharded = _tiny("train.micro_batch=1", "train.seq_len=64", "parallel.cp=2", world_size=2)
    assert {g.m for g in float8_timing.layer_gemms(sharded)} == {32}
    timed = float8_timing.time_float8(resolved, CPU, reps=1)
    assert timed["bf16_s"] > 0 and timed["fp8_s"] > 0, timed
    assert float8_timing.float8_speedup(timed) == pytest.approx(timed["bf16_s"] / timed["fp8_s"])
    assert timed["scaling"] == "tensorwise: the recipe's train.fp8 is none"
    # A bf16 recipe's products, timed already by the GEMM rate, are not timed again.
    passes = {"forward": 1.0, "input_grad": 2.0, "weight_grad": 3.0}
    gemms = float8_timing.layer_gemms(resolved)
    reused = float8_timing.time_float8(resolved, CPU, reps=1,
                                       bf16_timed={g.name: passes for g in gemms})
    assert reused["bf16_s"] == 6.0 * sum(g.count for g in gemms)
    line = float8_timing.float8_line(timed, dataclasses.replace(H100, fp8_gemm_speedup=0.25), "cpu")
    assert "fp8_gemm_speedup 0.25; a CPU's figure" in line
    # What a CPU's refusal counts for it: both sides' FLOPs, bf16's at the dense rate given.
    layer = sum(3 * g.flops for g in float8_timing.layer_gemms(resolved)) * (1 + float8_timing.WARMUP)
    flops, seconds = float8_timing.cpu_estimate(resolved, CPU, 1, rate=1e11)
    assert flops == 2 * layer and seconds > layer / 1e11


def test_the_recipes_scaling_is_timed_and_where_it_cannot_run_the_profile_keeps_its_figure(monkeypatch):
    from dsforge.translate import fp8 as rules

    fp8 = _tiny("train.precision=bf16", "train.fp8=rowwise")
    assert float8_timing.scaling_timed(fp8.recipe) == "rowwise"
    assert float8_timing.scaling_timed(_tiny().recipe) == "tensorwise"
    tensorwise = _tiny("train.precision=bf16", "train.fp8=tensorwise")
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    monkeypatch.setattr(float8_timing, "device_capability", lambda on: (8, 9))
    assert ("[FP6] rowwise float8 GEMMs need compute capability 9.0"
            in float8_timing.why_not_timed(fp8, cuda))
    assert float8_timing.why_not_timed(tensorwise, cuda) is None
    monkeypatch.setattr(float8_timing, "device_capability", lambda on: None)
    assert float8_timing.why_not_timed(fp8, CPU) is None  # the reference product runs
    rowwise = float8_timing.time_scaled_gemm(float8_timing.PROBE, "rowwise", CPU, reps=1)
    assert set(rowwise) == {"forward", "input_grad", "weight_grad"} and min(rowwise.values()) > 0
    moe = float8_timing.time_float8(_tiny_moe(), CPU, reps=1)  # FP4: nothing to time
    assert moe["skipped"].startswith("[FP4]")
    monkeypatch.setattr(rules, "torchao_installed", lambda: False)
    timed = float8_timing.time_float8(fp8, CPU, reps=1)
    assert "[X1]" in timed["skipped"] and float8_timing.float8_speedup(timed) is None
    assert float8_timing.cpu_estimate(fp8, CPU, 1, rate=1e11) == (0.0, 0.0)
    line = float8_timing.float8_line(timed, H100, "cpu")
    assert line.startswith("float8 GEMMs (rowwise, the recipe's train.fp8): not timed ([X1]")
    assert line.endswith("fp8_gemm_speedup 1.6 kept")


@pytest.mark.parametrize("impl", ["sequential", "grouped"])
def test_the_experts_are_timed_as_the_recipe_runs_them(impl):
    """tiny_moe on 2 ranks at ep 2: 2 experts a rank, 2 x 128 tokens x top-2 rows; its
    rate, a CPU's, is a share of the H100's peak in (0, 1]."""
    resolved = _tiny_moe(f"model.moe.experts={impl}")
    shape = expert_timing.expert_shape(resolved)
    assert (shape.rows, shape.experts, shape.hidden, shape.ffn) == (512, 2, 64, 96)
    assert shape.counts() == [256, 256]
    assert shape.flops == 6 * 512 * 3 * 64 * 96
    timed = expert_timing.time_experts(resolved, CPU, torch.float32, reps=1)
    assert timed["impl"] == impl and timed["seconds"] > 0, timed
    efficiency = expert_timing.expert_efficiency(timed, H100.gpu.peak_bf16_flops)
    assert 0 < efficiency <= 1
    line = expert_timing.expert_line(timed, dataclasses.replace(H100, expert_efficiency=efficiency),
                                     "tiny_moe")
    assert line.startswith(f"MoE experts ({impl}: model.moe.experts), one layer's 512 rows over 2")
    assert f"expert_efficiency {efficiency:.4g}" in line


def test_a_ranks_experts_see_etp_over_tp_of_its_tokens():
    """tp 2 with sequence parallelism holds half the tokens on a rank; at etp 2 the dispatcher
    gathers them back over the expert-tensor group (and halves each expert's width), at etp 1
    it does not."""
    common = ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2")
    folded = expert_timing.expert_shape(_tiny_moe(*common, "parallel.etp=1", world_size=4))
    assert (folded.rows, folded.ffn) == (256, 96)  # 2 x 128 tokens / tp 2 x top-2
    whole = expert_timing.expert_shape(_tiny_moe(*common, "parallel.etp=2", world_size=4))
    assert (whole.rows, whole.ffn) == (512, 48)


def test_a_cpus_refusal_counts_both_expert_timings():
    """At the recipe's layout (2 of 4 experts a rank) and on the layers' one device (all 4):
    the same 512 rows a layer, so twice the FLOPs."""
    resolved = _tiny_moe()
    one = expert_timing.expert_shape(resolved).flops
    assert expert_timing.cpu_estimate_flops(resolved, reps=3) == 2 * one * (3 + expert_timing.WARMUP)


def test_experts_already_timed_on_one_device_are_not_timed_again():
    """At ep 1 on one rank the layer's experts are the recipe's: the layers reuse that
    timing, and the CPU's refusal counts it once; at ep 2 they time every expert again."""
    alone = _tiny_moe("parallel.ep=1", "parallel.dp=1", world_size=1)
    one = expert_timing.expert_shape(alone).flops
    assert expert_timing.cpu_estimate_flops(alone, reps=3) == one * (3 + expert_timing.WARMUP)
    timed = {"impl": "sequential", "why": "", "shape": expert_timing.expert_shape(alone),
             "seconds": 1.0}
    assert layers._layer_experts(alone, CPU, 1, timed) is timed
    spread = _tiny_moe()
    again = layers._layer_experts(spread, CPU, 1, expert_timing.time_experts(spread, CPU, torch.float32, 1))
    assert again["shape"].experts == 4 and "seconds" in again


def test_the_rows_spread_over_the_experts_with_the_remainder_first():
    shape = expert_timing.ExpertShape(rows=10, experts=4, hidden=8, ffn=8)
    assert shape.counts() == [3, 3, 2, 2]


def test_a_model_without_experts_times_none_and_says_so():
    resolved = _tiny()
    assert expert_timing.expert_shape(resolved) is None
    assert expert_timing.time_experts(resolved, CPU, torch.float32, reps=1) is None
    assert expert_timing.expert_efficiency(None, H100.gpu.peak_bf16_flops) is None
    assert expert_timing.cpu_estimate_flops(resolved, reps=3) == 0.0
    assert expert_timing.expert_line(None, H100, "tiny") == (
        "MoE experts: none in tiny's model: nothing timed, expert_efficiency unset")


def test_the_experts_share_of_a_layers_products_leaves_its_sum():
    m = _tiny_moe().recipe.model
    dense = _tiny().recipe.model
    for layer in range(m.num_layers):
        assert layer_expert_params(m, layer) == 2 * 3 * 64 * 96  # top-2 experts of width 96
        assert layer_matmul_params(m, layer) - layer_expert_params(m, layer) == (
            layer_matmul_params(dense, layer) - 3 * 64 * 176 + 64 * 4)  # dense MLP out, router in
        assert layer_expert_params(dense, layer) == 0


def _expert_flops_per_token(resolved) -> float:
    """The routed experts' hardware FLOPs a token, counted here from the model's sizes: 2
    FLOPs a weight of the top_k experts' fc1 (h x 2 ffn) and fc2 (ffn x h), x3 for training and
    once more where full checkpointing recomputes the forward."""
    m, t = resolved.recipe.model, resolved.recipe.train
    forward = 2 * m.num_layers * m.moe.top_k * 3 * m.hidden_size * m.moe.ffn_hidden_size
    return forward * (4 if t.activation_checkpointing == "full" else 3)


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_the_planner_prices_the_experts_at_their_measured_rate(checkpointing):
    """expert_efficiency moves the experts' FLOPs from the GEMMs' rate to peak x it: halving
    it adds exactly their seconds at the first rate; the other rows do not move."""
    resolved = _tiny_moe(f"train.activation_checkpointing={checkpointing}")
    lay, t = resolved.layout, resolved.recipe.train
    tokens = lay.grad_accum * lay.micro_batch * t.seq_len / lay.tp
    experts = tokens * _expert_flops_per_token(resolved)
    peak = H100.gpu.peak_bf16_flops
    base = step_time(resolved, H100)
    at = {e: step_time(resolved, dataclasses.replace(H100, expert_efficiency=e)) for e in (0.2, 0.1)}
    assert at[0.1].compute - at[0.2].compute == pytest.approx(experts / (peak * 0.2), rel=1e-9)
    assert at[0.2].compute - base.compute == pytest.approx(
        experts / (peak * 0.2) - experts / _flop_rate(resolved, H100), rel=1e-9)
    for row in ("optimizer", "dp_comm", "ep_comm", "fixed", "other"):
        assert getattr(at[0.1], row) == getattr(base, row)


def test_without_expert_efficiency_the_compute_row_is_the_gemms_rate_exactly():
    """None (every default profile): the matrix products at the GEMMs' rate, to the last bit;
    a dense model ignores the field."""
    resolved = _tiny_moe()
    m, lay, t = resolved.recipe.model, resolved.layout, resolved.recipe.train
    dense = pipeline_rank_flops(m, 0, "none", pp=1, vpp=1, rank=0)
    attention = pipeline_rank_flops(m, t.seq_len, "none", pp=1, vpp=1, rank=0) - dense
    tokens = lay.grad_accum * (lay.micro_batch * t.seq_len // lay.cp) / lay.tp
    rate = _flop_rate(resolved, H100)
    assert step_time(resolved, H100).compute == tokens * dense / rate + tokens * attention / rate
    plain = _tiny()
    assert (step_time(plain, dataclasses.replace(H100, expert_efficiency=0.01)).to_dict()
            == step_time(plain, H100).to_dict())


def test_the_refit_scales_a_measured_expert_rate_with_the_gemms():
    """The compute term holds the experts: a coefficient on it divides their rate too."""
    measured = dataclasses.replace(H100, expert_efficiency=0.4)
    coefficients = {"compute": 2.0, "fixed": 0.0, "gathers": 0.0, "optimizer": 1.0, "communication": 1.0}
    assert cal.apply(measured, coefficients).expert_efficiency == pytest.approx(0.2)
    assert cal.apply(H100, coefficients).expert_efficiency is None
    full = {**coefficients, "other": 0.0, "host": 0.0, "host_zero3": 0.0}
    line = cal._coefficients_line(cal.Calibration(measured, cal.apply(measured, full), full, []))
    assert "experts' efficiency 0.4 -> 0.2" in line


def test_a_profile_file_holds_expert_efficiency_in_range(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("expert_efficiency: 0.35\n")
    assert read_profile(path).expert_efficiency == 0.35
    path.write_text("expert_efficiency: 1.5\n")
    with pytest.raises(RecipeError, match="out of range"):
        read_profile(path)


def test_dsforge_calibrate_of_an_moe_recipe_writes_its_experts_figure(tmp_path):
    """Its own process (DeepSpeed's engines need a process group): tiny_moe in bf16 on this
    CPU. Also what the engines print: DeepSpeed's bf16 engines print their memory
    (see_memory_usage) to stdout, where the report goes; those lines go to the profile's
    .engines.log, the report stays dsforge's."""
    import subprocess
    import sys

    out = tmp_path / "moe.yaml"
    done = subprocess.run([sys.executable, "-m", "dsforge", "calibrate", "recipes/tiny_moe.yaml",
                           "--set", "train.precision=bf16", "--device", "cpu", "--reps", "1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    log = tmp_path / "moe.engines.log"
    assert "begin bf16_optimizer" in log.read_text()
    assert "bf16_optimizer" not in done.stdout + done.stderr and "MA " not in done.stdout
    assert done.stdout.startswith("Measured by dsforge calibrate")
    assert done.stdout.rstrip().endswith(f"the engines' own output: {log}")
    assert "destroy_process_group" not in done.stderr
    written = read_profile(out)
    assert 0 < written.expert_efficiency <= 1
    assert written.fp8_gemm_speedup == H100.fp8_gemm_speedup  # FP4: no float8 in an MoE
    assert f"expert_efficiency {written.expert_efficiency:.4g}" in done.stdout
    assert "MoE experts (sequential: auto: torch's grouped GEMM has no fast CPU kernel)" in done.stdout
    assert "float8 GEMMs (tensorwise: the recipe's train.fp8 is none): not timed ([FP4]" in done.stdout
    assert "Failed to load" not in done.stderr  # torchao's import lines are not the command's
    # its layers too: 1 and 3 MoE layers, one after the other (Megatron's aux-loss tracker)
    assert "the recipe's layers: not measured" not in done.stdout
    assert "a layer at 256 tokens (ZeRO-0): forward" in done.stdout
