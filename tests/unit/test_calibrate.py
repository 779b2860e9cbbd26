"""The profile refitted from measured step times (dsforge/cost/fit.py): which terms the
points determine, the coefficients they give, the band from leave-one-out residuals, and the
refitted profile as a --profile file."""

from __future__ import annotations

import dataclasses

import pytest

from dsforge.cost import fit as cal
from dsforge.cost.profile import default_profile, profile_text, read_profile
from dsforge.cost.step_time import step_time
from dsforge.recipe import resolve_file
from tests.conftest import REPO

ONE_B = REPO / "benchmarks" / "gpu" / "recipes" / "1b_1gpu.yaml"
# The additive fixed and gather costs (the refit's model where the host is the device, as on
# a CPU) are tested on the H200's profile without its host floors; the floors' tests add them.
H200 = dataclasses.replace(default_profile("h200", gpus_per_node=1), host_layer_s=0.0,
                           host_layer_zero3_s=0.0)
# What a machine "measures" in these tests: known coefficients on the profile's own terms.
# (One model size and batch: the optimizer step is the same in every layout, and no layout
# here tells its coefficient apart from compute's, so it stays 1.)
TRUE = {"compute": 1.2, "fixed": 0.003, "gathers": 0.0025, "optimizer": 1.0, "communication": 1.0}


def _layout(*overrides):
    return resolve_file(ONE_B, list(overrides), world_size=1)


def _measured(resolved) -> float:
    return step_time(resolved, cal.apply(H200, TRUE)).total


def _points(*layouts) -> list[cal.Point]:
    return [cal.Point(" ".join(o), r := _layout(*o), _measured(r)) for o in layouts]


MB = [("train.micro_batch=1",), ("train.micro_batch=2",), ("train.micro_batch=4",)]
ZERO3 = [("zero.stage=3", "train.micro_batch=2"), ("zero.stage=3", "train.micro_batch=4")]


def test_enough_different_layouts_recover_the_machines_coefficients():
    points = _points(*MB, *ZERO3)
    coefficients = cal.fit(points, H200)
    for term in ("compute", "fixed", "gathers"):
        assert coefficients[term] == pytest.approx(TRUE[term], rel=1e-6)
    calibration = cal.calibrate(points, H200, measured_on="test")
    assert all(r.after_s == pytest.approx(r.measured_s, rel=1e-6) for r in calibration.rows)
    assert all(r.left_out_s == pytest.approx(r.measured_s, rel=1e-3) for r in calibration.rows)
    assert calibration.after.prediction_error < 1e-3  # the band is the left-out residuals'
    assert (calibration.after.measured_on, calibration.after.measured_runs) == ("test", 5)


def test_layouts_the_model_cannot_tell_apart_determine_one_term():
    """ZeRO 0, 1 and 2 on one GPU: the same features, so only compute is fitted, and the
    terms left out keep what they predicted before."""
    points = _points(("zero.stage=0",), ("zero.stage=1",), ("zero.stage=2",))
    coefficients = cal.fit(points, H200)
    assert coefficients["fixed"] == H200.microbatch_layer_s and coefficients["optimizer"] == 1.0
    after = cal.apply(H200, coefficients)
    for p in points:
        assert step_time(p.resolved, after).total == pytest.approx(p.measured_s, rel=1e-6)


def test_the_term_that_would_come_out_negative_is_the_one_held_at_zero():
    """A machine faster at more microbatches than the model can say: no negative fixed cost,
    and the ZeRO-3 gathers (a later term, positive) are still fitted."""
    points = _points(*MB, *ZERO3)
    points[0] = dataclasses.replace(points[0], measured_s=points[1].measured_s * 0.9)
    unconstrained = cal.fit(points[1:], H200)  # without the odd point: all three terms
    assert unconstrained["fixed"] > 0 and unconstrained["gathers"] > 0
    coefficients = cal.fit(points, H200)
    assert coefficients["fixed"] == 0.0  # held at its bound
    assert coefficients["gathers"] > 0 and coefficients["compute"] > 0


# The 1B at three sequence lengths and two micro-batches (its max_seq_len is 8,192).
SEQ_LENS = [(f"train.seq_len={s}", f"train.micro_batch={mb}") for s in (1024, 2048, 4096)
            for mb in (1, 2)]


def _from_features(profile, layouts, **coefficients) -> list[cal.Point]:
    """Points whose measured step is `coefficients` x the profile's features (terms not named
    at the profile's: compute and optimizer 1, the rest 0)."""
    points = []
    for overrides in layouts:
        resolved = _layout(*overrides)
        f = cal.features(resolved, profile)
        scale = {"compute": 1.0, "optimizer": 1.0, **coefficients}
        points.append(cal.Point(" ".join(overrides), resolved,
                                sum(scale.get(t, 0.0) * f[t] for t in cal.TERMS)))
    return points


@pytest.mark.parametrize("correction", [0.8, -0.4])
def test_runs_at_several_sequence_lengths_fit_the_attention_apart(correction):
    """With an attention rate of its own in the profile, runs at several sequence lengths
    tell its share from the GEMMs': `attention` corrects compute's coefficient on it (either
    way), and the refitted rate is the profile's over their sum."""
    profile = dataclasses.replace(H200, attention_efficiency=0.5)
    points = _from_features(profile, SEQ_LENS, compute=1.2, attention=correction, fixed=0.003)
    coefficients = cal.fit(points, profile)
    assert coefficients["compute"] == pytest.approx(1.2, rel=1e-6)
    assert coefficients["attention"] == pytest.approx(correction, rel=1e-6)
    after = cal.apply(profile, coefficients)
    assert after.attention_efficiency == pytest.approx(0.5 / (1.2 + correction))
    for p in points:
        assert step_time(p.resolved, after).total == pytest.approx(p.measured_s, rel=1e-6)
    shown = cal.render(cal.calibrate(points, profile, measured_on="test"))
    assert f"attention x{1.2 + correction:.3g} (efficiency 0.5 -> {0.5 / (1.2 + correction):.3g})" in shown


def test_one_sequence_length_leaves_the_attention_with_the_gemms():
    """At one sequence length (and one width) the attention's share is the same in every run:
    not determined, it keeps compute's coefficient. Without a rate of its own it has no
    feature at all."""
    profile = dataclasses.replace(H200, attention_efficiency=0.5)
    points = _from_features(profile, [o for o in SEQ_LENS if "train.seq_len=2048" in o],
                            compute=1.2, attention=0.8)
    assert cal.fit(points, profile)["attention"] == 0.0
    assert cal.features(points[0].resolved, H200)["attention"] == 0.0


def _pipelines():
    """The 1B on pp 2 (two GPUs of a node), at three micro-batches, with and without vpp 2:
    (its overrides, resolved)."""
    for mb in (1, 2, 4):
        for vpp in ((), ("parallel.vpp=2",)):
            overrides = ("parallel.pp=2", "cluster.gpus_per_node=2", "model.tie_embeddings=false",
                         f"train.micro_batch={mb}", *vpp)
            yield overrides, resolve_file(ONE_B, list(overrides), world_size=2)


def test_communication_an_engine_hides_is_held_at_zero_not_kept():
    """Runs faster than even hiding all their communication would make them: the fit wants a
    negative communication coefficient and holds it at 0 (an engine that overlaps all of it),
    not at the profile's 1 (all of it exposed), and refits compute beside it."""
    profile = dataclasses.replace(H200, inter_node_gbps=0.5, intra_node_gbps=0.5)
    points = []
    for overrides, resolved in _pipelines():
        f = cal.features(resolved, profile)
        points.append(cal.Point(" ".join(overrides), resolved,
                                1.2 * f["compute"] + f["optimizer"] - 0.1 * f["communication"]))
    coefficients = cal.fit(points, profile)
    assert coefficients["communication"] == 0.0 and coefficients["compute"] > 0


def test_with_a_pipeline_the_refitted_profile_predicts_the_fitted_step():
    """pp 2: the bubble's share of compute goes with compute, its share of the pipeline's
    sends with communication, as the refitted profile then predicts them."""
    true = {**TRUE, "gathers": 0.0, "communication": 3.0}
    profile = dataclasses.replace(H200, inter_node_gbps=0.5, intra_node_gbps=0.5)  # sends matter
    points = []
    for overrides, resolved in _pipelines():
        points.append(cal.Point(" ".join(overrides), resolved,
                                step_time(resolved, cal.apply(profile, true)).total))
    calibration = cal.calibrate(points, profile, measured_on="test")
    assert calibration.coefficients["communication"] == pytest.approx(3.0, rel=1e-6)
    for row in calibration.rows:
        assert row.after_s == pytest.approx(row.measured_s, rel=1e-6)


def test_too_few_points_keep_the_band_and_say_so():
    calibration = cal.calibrate(_points(*MB[:2]), H200, measured_on="test")
    assert calibration.left_out_error is None
    assert calibration.after.prediction_error == H200.prediction_error
    assert "leave-one-out needs 3 trials" in cal.render(calibration)


def test_the_refitted_profile_is_a_profile_file(tmp_path):
    calibration = cal.calibrate(_points(*MB, *ZERO3), H200, measured_on="NVIDIA H200, 2026-11-26")
    path = tmp_path / "profile.yaml"
    path.write_text(profile_text(calibration.after, "measured here\n" + cal.render(calibration)))
    written = read_profile(path)
    assert written.measured_on == "NVIDIA H200, 2026-11-26" and written.measured_runs == 5
    assert written.zero3_gather_layer_s == pytest.approx(TRUE["gathers"], rel=1e-6)
    assert path.read_text().startswith("# measured here\n")


def test_the_fixed_and_gather_terms_in_the_step_time():
    profile = dataclasses.replace(H200, microbatch_layer_s=0.001, zero3_gather_layer_s=0.002)
    z3_full = _layout("zero.stage=3", "train.activation_checkpointing=full", "train.micro_batch=2")
    t = step_time(z3_full, profile)
    layers = 8 * 16  # 8 microbatches of the 16 layers
    assert t.fixed == pytest.approx(layers * 0.001)
    assert t.gathers == pytest.approx(3 * layers * 0.002)  # forward, backward, recompute
    assert step_time(_layout("train.micro_batch=2"), profile).gathers == 0.0


def test_model_gemms_divide_the_parallel_widths_by_tp():
    from dsforge.calibrate.kernel_timing import model_gemms

    m = _layout().recipe.model
    one, two = model_gemms(m, 4096), model_gemms(m, 4096, tp=2)
    assert [(g.name, g.k, g.n // 2) for g in one if g.name in ("qkv", "fc1", "logits")] == \
        [(g.name, g.k, g.n) for g in two if g.name in ("qkv", "fc1", "logits")]
    assert [(g.name, g.k // 2, g.n) for g in one if g.name in ("proj", "fc2")] == \
        [(g.name, g.k, g.n) for g in two if g.name in ("proj", "fc2")]


def test_dsforge_calibrate_writes_a_profile_the_search_reads(tmp_path):
    """Its own process: DeepSpeed's engine for the optimizer step needs a process group."""
    import subprocess
    import sys

    out = tmp_path / "cpu.yaml"
    done = subprocess.run([sys.executable, "-m", "dsforge", "calibrate", "recipes/tiny.yaml",
                           "--set", "parallel.dp=1", "--world-size", "1", "--reps", "2",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr  # DeepSpeed's lines are not the command's
    assert "Failed to load" not in done.stderr and "_pytree" not in done.stderr  # nor torchao's
    written = read_profile(out)
    assert written.measured_on.startswith("cpu (") and written.measured_runs == 0
    assert 0 < written.compute_efficiency < 0.01  # a CPU's fp32 GEMMs against an H100's peak
    assert 0 < written.attention_efficiency < 0.01  # and its attention
    assert written.optimizer_bytes_per_param_fp32 > 0 and written.optimizer_fixed_s >= 0
    assert written.optimizer_bytes_per_param == 109.0  # an fp32 recipe measures the fp32 step
    assert "GEMMs at tiny's shapes" in out.read_text() and "wrote" in done.stdout
    # The host floors are timed here too, and reported; a CPU's profile has none.
    assert "the forward at 128 tokens: ZeRO-0 " in done.stdout and "ZeRO-3 " in done.stdout
    assert "a layer at 256 tokens (ZeRO-0): forward " in done.stdout  # and the layer's work
    assert "a layer at 256 tokens at ZeRO-3: forward " in done.stdout  # and its ZeRO-3 forward
    assert written.host_layer_s == written.host_layer_zero3_s == 0.0
    assert written.other_s_per_token_hidden == 0.0
    # The float8 product is timed on a CPU too (torch's reference one); a dense model has no
    # experts to time.
    assert written.fp8_gemm_speedup > 0 and "a CPU's figure" in done.stdout
    assert written.expert_efficiency is None and "MoE experts: none in tiny's model" in done.stdout
    searched = subprocess.run([sys.executable, "-m", "dsforge", "plan", "--search", "recipes/tiny.yaml",
                               "--gpus", "1", "--profile", str(out)], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
    assert searched.returncode == 0, searched.stderr[-3000:]
    assert f"coefficients measured on {written.measured_on}, the band not" in searched.stdout


# The engines' output beside the profile: tests/unit/test_calibrate_kernels.py's MoE calibrate
# (in bf16, whose engines print their memory).


def test_attention_at_its_own_rate_costs_only_the_attentions_flops():
    """attention_efficiency moves the attention's FLOPs (the full score matrix, forward,
    backward and recompute) from the GEMMs' rate to its own, and nothing else."""
    from dsforge.cost.step_time import gemm_saturation
    from dsforge.estimate.flops import attention_flops_forward

    resolved = _layout("train.activation_checkpointing=full")
    lay, m, seq = resolved.layout, resolved.recipe.model, resolved.recipe.train.seq_len
    base = step_time(resolved, H200)
    slow = step_time(resolved, dataclasses.replace(H200, attention_efficiency=0.2))
    peak = H200.gpu.peak_bf16_flops
    gemm_rate = (peak * H200.compute_efficiency * gemm_saturation(m.hidden_size)
                 * gemm_saturation(lay.micro_batch * seq, H200.gemm_knee_tokens))
    tokens = lay.grad_accum * lay.micro_batch * seq
    attention = 4 * attention_flops_forward(m, seq) * tokens  # 3 passes and the recompute
    assert slow.compute - base.compute == pytest.approx(
        attention / (peak * 0.2) - attention / gemm_rate, rel=1e-9)
    assert (slow.optimizer, slow.fixed, slow.gathers) == (base.optimizer, base.fixed, base.gathers)


def test_the_measured_attention_becomes_its_share_of_the_peak():
    from dsforge.calibrate.command import attention_efficiency

    timed = {"backends": {"auto": {"seconds": 1.0, "tflops_full_matrix": 654.0}}}
    assert attention_efficiency(timed, H200) == pytest.approx(654e12 / H200.gpu.peak_bf16_flops)
    assert attention_efficiency({"backends": {"flash": {"error": "no kernel"}}}, H200) is None


def test_dsforge_calibrate_refuses_a_bad_recipe_before_measuring(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "dsforge", "calibrate", "recipes/tiny.yaml",
                           "--world-size", "1", "--out", str(tmp_path / "x.yaml")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "[Y4]" in done.stderr and not (tmp_path / "x.yaml").exists()


def test_the_optimizer_is_timed_at_sizes_that_fit_the_device():
    from dsforge.calibrate.command import optimizer_sizes
    from dsforge.recipe.presets import PRESETS
    from dsforge.schema import ModelConfig

    one_b = _layout().recipe.model
    assert optimizer_sizes(one_b, 50e6 * 1000) == (1, 16)  # all of it fits
    # 1.2B parameters: the 262M embedding and 15 layers of 61M, widths whole
    assert optimizer_sizes(one_b, 1.2e9) == (1, 15)
    llama_70b = ModelConfig(**PRESETS["llama3-70b"])
    divisor, layers = optimizer_sizes(llama_70b, 80e9 / 5 / 18)  # an 80 GB GPU
    assert divisor == 4 and 2 <= layers < llama_70b.num_layers


@pytest.mark.parametrize("steps_ms, resolved", [
    ((70.0, 2.0, 1.0, 3.0), True),  # a busy first pair: timed again, the second rises
    ((70.0, 2.0, 5.0, 4.0), False),  # twice not: said, all of it fixed cost
])
def test_an_optimizer_step_that_did_not_grow_is_timed_again_then_said(monkeypatch, steps_ms, resolved):
    """The larger step taking no longer is noise; clamped silently it wrote 0 ns a parameter
    into a profile as if measured (a busy 2-core machine gave 71.7 ms at 79,040 parameters and
    1.73 ms at 217,664)."""
    import torch

    from dsforge.calibrate import command as cc
    from dsforge.calibrate import optimizer_timing

    timings = iter(steps_ms)
    monkeypatch.setattr(cc, "_quiet_deepspeed", lambda on: None)
    monkeypatch.setattr(optimizer_timing, "init_world", lambda on: None)
    monkeypatch.setattr(optimizer_timing, "time_optimizer", lambda resolved, on, reps, divisor, layers: {
        "step_s": next(timings) / 1e3, "parameters": 1000 * layers, "optimizer": "DeepSpeedZeroOptimizer"})
    cost = cc.optimizer_cost(_layout(), torch.device("cpu"), reps=1)
    assert next(timings, None) is None  # the first pair did not rise: both pairs timed
    assert cost["resolved"] is resolved
    if resolved:
        assert cost["per_param_s"] == pytest.approx(2e-3 / (1000 * (cost["full"]["parameters"] // 1000 - 1)))
    else:
        assert cost["per_param_s"] == 0 and cost["fixed_s"] == pytest.approx(4e-3)


def test_a_negative_compute_drops_the_term_that_bent_it():
    """ZeRO-1 and ZeRO-2 on two GPUs differ, for the model, only in data-parallel traffic
    (ZeRO-2 reduces every microbatch). Measured 5x apart, the exact two-term fit would make
    compute negative to let communication explain the gap: communication goes, compute is
    fitted alone, both predicted between the two measurements."""
    profile = dataclasses.replace(H200, intra_node_gbps=20.0)
    two = [resolve_file(ONE_B, [f"zero.stage={z}", "parallel.dp=2", "cluster.gpus_per_node=2",
                                "train.micro_batch=1"],
                        world_size=2) for z in (1, 2)]
    x = [cal.features(r, profile)["communication"] for r in two]
    assert x[1] > 2 * x[0] > 0  # what makes the exact fit bend compute below 0
    points = [cal.Point("z1", two[0], 1.0), cal.Point("z2", two[1], 5.0)]
    coefficients = cal.fit(points, profile)
    assert coefficients["communication"] == 1.0 and coefficients["compute"] != 1.0
    after = cal.apply(profile, coefficients)
    assert all(1.0 < step_time(r, after).total < 5.0 for r in two)


def test_a_gpu_sized_calibration_on_a_cpu_is_refused_before_measuring(tmp_path):
    """The 7B's GEMMs at 4,096 tokens, 50 times each: hours on a CPU. Refused with the fix
    from the CPU's rate at one small product, in about a second, nothing written."""
    import subprocess
    import sys

    out = tmp_path / "7b.yaml"
    done = subprocess.run([sys.executable, "-m", "dsforge", "calibrate", "recipes/7b_1gpu.yaml",
                           "--device", "cpu", "--reps", "50", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "dsforge calibrate on this CPU would spend ~" in done.stderr
    assert "Fix: run it where the recipe trains" in done.stderr and not out.exists()


def test_the_optimizer_comes_from_the_breakdowns_where_the_steps_cannot_tell_it():
    """One model size and batch: the step times cannot tell the optimizer from compute, but
    the breakdowns time it: its coefficient is theirs, and compute is fitted around it."""
    true = {**TRUE, "optimizer": 2.0}
    machine = cal.apply(H200, true)
    points = []
    for overrides in MB:
        resolved = _layout(*overrides)
        timed = step_time(resolved, machine)
        points.append(cal.Point(" ".join(overrides), resolved, timed.total,
                                phases={"optimizer": timed.optimizer}))
    coefficients = cal.fit(points, H200)
    assert coefficients["optimizer"] == pytest.approx(2.0, rel=1e-9)
    for term in ("compute", "fixed"):
        assert coefficients[term] == pytest.approx(true[term], rel=1e-6)
    without = [dataclasses.replace(p, phases=None) for p in points]
    assert cal.fit(without, H200)["optimizer"] == 1.0  # the steps alone leave it as it was
    # A run measured without its breakdown (DSFORGE_BREAKDOWN=off) leaves it to the others.
    some = [without[0], *points[1:]]
    assert cal.fit(some, H200)["optimizer"] == pytest.approx(2.0, rel=1e-9)


def test_the_gemm_knee_is_fitted_from_the_rates_at_three_sizes():
    from dsforge.calibrate.command import knee_of

    def rate(tokens, knee=300.0, full=700e12):
        return full / (1 + knee / tokens)

    assert knee_of({t: rate(t) for t in (4096, 2048, 1024)}) == pytest.approx(300.0, rel=1e-9)
    assert knee_of({t: 5e11 for t in (512, 256, 128)}) == pytest.approx(0.0, abs=1e-6)
    assert knee_of({512: 5e11, 256: 6e11, 128: 7e11}) == 0.0  # faster with fewer tokens: no knee
    assert knee_of({4096: 7e14}) == 0.0


def test_the_refit_scales_a_measured_attention_rate_with_the_gemms():
    """The compute term holds the attention: a coefficient on it divides both rates."""
    measured = dataclasses.replace(H200, attention_efficiency=0.5)
    after = cal.apply(measured, {**TRUE, "compute": 2.0})
    assert after.attention_efficiency == pytest.approx(0.25)
    assert after.compute_efficiency == pytest.approx(H200.compute_efficiency / 2)
    assert cal.apply(H200, TRUE).attention_efficiency is None  # unmeasured stays unmeasured
