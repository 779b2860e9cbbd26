"""`dsforge calibrate RECIPE --out PROFILE`: a --profile file measured on this machine's device
at RECIPE's shapes, term by term (docs/search.md "Calibration").

- GEMMs: each of a layer's matrix products and the output layer's, at the recipe's microbatch
  of tokens and tensor-parallel widths, in the three passes of training, in its precision, and
  again at a half and a quarter of the tokens. The rates at the three sizes set
  `gemm_knee_tokens` (the tokens at which the GEMMs reach half their full rate); the rate at
  the recipe's microbatch then sets `compute_efficiency`: the cost model's rate at these shapes
  (peak x efficiency x its two saturation factors) becomes the measured one.
- The optimizer step: DeepSpeed's engine as dsforge configures it for the recipe (its ZeRO
  stage, `train.adam_impl`, the wrapper around it), over the parameters of one layer and of
  as many as fit a fifth of the device (optimizer_sizes; the widths halved for a model too
  large for that). The two steps give a fixed cost and a cost per parameter: the optimizer's
  fixed seconds and bytes per parameter at the GPU's memory bandwidth (the fp32 ones for an
  fp32 recipe).
- Attention (forward and backward, `model.sdpa_backend`, at the recipe's microbatch and
  sequence length) sets `attention_efficiency`: its rate on the FLOPs dsforge counts for it,
  as a share of the peak.
- The float8 GEMM (calibrate/float8_timing.py): torch's scaled product in a linear layer's
  three passes, its operands cast as torchao casts them for train.fp8's scaling (else
  tensorwise), against bf16's at a layer's product shapes, sets `fp8_gemm_speedup` (the
  products alone: the casts are the `other` row's) for a dense model where torchao and the
  device run it (on a CPU torch's reference product: timed, not a GPU's figure).
- An MoE recipe's experts (calibrate/expert_timing.py), as its layout runs them (grouped GEMM
  or per-expert loop), one layer at one microbatch, set `expert_efficiency`: their rate on
  the FLOPs dsforge counts for them, as a share of the peak.
- The memory bandwidth (a copy) is measured and written beside the profile; the cost model has
  no term of its own for it yet.
- The recipe's own layers (calibrate/layers.py): on a GPU the host floors and the work
  outside the GEMMs and attention.

The band, and on a CPU the costs that show only in a whole run (per microbatch, ZeRO-3's
gathers), come from `dsforge plan --search --measure`, which refits this profile from trials.
What the engines print while they are timed goes to PROFILE's `.engines.log` beside it
(engine_log), as a run's engine lines go to its job.log: the terminal shows dsforge's lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import click

from dsforge.calibrate.expert_timing import (cpu_estimate_flops, expert_efficiency, expert_line,
                                              time_experts)
from dsforge.calibrate.float8_timing import cpu_estimate, float8_line, float8_speedup, time_float8
from dsforge.calibrate.kernel_timing import device_name, measured_on, rank_tokens, recipe_dtype
from dsforge.calibrate.layers import layer_fields, layer_lines, measure_layers
from dsforge.cost.profile import ClusterProfile, default_profile, profile_text, provenance_lines
from dsforge.cost.step_time import modelled_gemm_rate
from dsforge.files import write_atomic
from dsforge.hardware import gpu_for_device_name
from dsforge.problems import EXIT_INVALID
from dsforge.recipe.resolve import Resolved

CPU_COPY_MIB, GPU_COPY_MIB = 256, 1024
CPU_GEMM_LIMIT_S = 120.0  # what a calibration's GEMMs may take on a CPU before it is refused


def calibrate_main(resolved: Resolved, *, out: Path, gpu: str | None, device: str, reps: int) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no GPU is visible here; use --device cpu (or auto)")
    on = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available())
                      else "cpu")
    if on.type == "cpu":
        refuse_a_long_cpu_calibration(resolved, on, reps)
    profile = _base_profile(resolved, gpu, on)
    click.echo(f"dsforge: calibrating {resolved.recipe.name} on {device_name(on)} for a "
               f"{profile.gpu.name} profile", err=True)
    log = engine_log(out)
    gemms, optimizer, side, layers = _measure(resolved, on, reps, log)
    profile = dataclasses.replace(profile, gemm_knee_tokens=gemms["knee"])
    measured = dataclasses.replace(
        profile, compute_efficiency=min(1.0, gemms["rate"] / modelled_gemm_rate(resolved, profile, 1.0)),
        attention_efficiency=attention_efficiency(side["attention"], profile),
        measured_on=measured_on(on),
        measured_runs=0, **optimizer_fields(resolved, profile, optimizer),
        expert_efficiency=expert_efficiency(side["experts"], profile.gpu.peak_bf16_flops),
        fp8_gemm_speedup=float8_speedup(side["fp8"]) or profile.fp8_gemm_speedup,  # where timed
        **layer_fields(layers, on.type, resolved, gemms["rate"], side["attention"]))
    lines = _report(resolved, measured, gemms, optimizer, side, layers, on.type)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, profile_text(measured, "\n".join(lines)))
    click.echo("\n".join(lines + [f"wrote {out}: use it with dsforge plan --search --profile {out}",
                                  f"the engines' own output: {log}"]))


def engine_log(out: Path) -> Path:
    """Where the engines' output goes: beside the profile, e.g. h200.yaml -> h200.engines.log."""
    return out.with_suffix(".engines.log")


def _measure(resolved: Resolved, on, reps: int, log: Path) -> tuple:
    """Every term's timing, with what the engines print sent to `log`, and the one-rank world
    the engines needed torn down after, however the timing ends."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink, contextlib.redirect_stdout(sink):
        try:
            gemms = gemm_rate(resolved, on, reps)
            optimizer = optimizer_cost(resolved, on, reps)
            side = _side_figures(resolved, on, reps, gemms)
            # last: on a CPU it installs the CPU backend
            layers = measure_layers(resolved, on, reps, experts=side["experts"])
        finally:
            leave_world()
    return gemms, optimizer, side, layers


def leave_world() -> None:
    """DeepSpeed's engines (the optimizer step, the layers) needed a process group of one; a
    process that ends without destroying it gets NCCL's warning about leaked resources."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def refuse_a_long_cpu_calibration(resolved: Resolved, on, reps: int) -> None:
    """A GPU-sized recipe's GEMMs on a CPU take hours: estimated from this CPU's rate at a
    small product, refused (exit 2) with the fix before anything is measured. The GEMMs are
    the dense ones at three sizes, the experts' (at the recipe's layout, and every expert on
    one device for its layers) and the float8 timing's (whose rate is probed only where the
    rest fits: importing torchao takes seconds)."""
    from dsforge.calibrate.kernel_timing import PROBE, WARMUP, model_gemms, time_gemm

    tokens = rank_tokens(resolved)
    gemms = model_gemms(resolved.recipe.model, tokens, tp=resolved.layout.tp)
    per_size = sum(3 * g.flops for g in gemms)
    flops = (per_size * sum(1 / f for f in TOKEN_FRACTIONS) * (reps + WARMUP)
             + cpu_estimate_flops(resolved, reps))
    rate = 3 * PROBE.flops / sum(time_gemm(PROBE, on, recipe_dtype(resolved), 3, warmup=1).values())
    seconds = flops / rate
    if seconds <= CPU_GEMM_LIMIT_S:
        fp8_flops, fp8_s = cpu_estimate(resolved, on, reps, rate)
        flops, seconds = flops + fp8_flops, seconds + fp8_s
    if seconds <= CPU_GEMM_LIMIT_S:
        return
    click.echo(f"{resolved.recipe.name}: dsforge calibrate on this CPU would spend ~{seconds / 60:.0f} "
               f"minutes in the recipe's GEMMs ({flops / 1e12:.0f} TFLOP at ~{flops / seconds / 1e9:.0f} "
               f"GFLOP/s). Fix: run it where the recipe trains (a GPU: --device cuda), or on the "
               "CPU calibrate a CPU-sized recipe (e.g. recipes/tiny.yaml)", err=True)
    raise SystemExit(EXIT_INVALID)


def _base_profile(resolved: Resolved, gpu: str | None, on) -> ClusterProfile:
    """The profile of the GPU named, else of the visible one, else of the recipe's cluster."""
    import torch

    cluster = resolved.recipe.cluster
    if gpu is None and on.type == "cuda":
        found = gpu_for_device_name(torch.cuda.get_device_name(on))
        gpu = found.key if found else None
    key = gpu or (cluster.gpu if cluster and cluster.gpu else "h100")
    if on.type == "cuda" and gpu is None:
        click.echo(f"dsforge: {torch.cuda.get_device_name(on)} is not in dsforge's GPU table; the "
                   f"profile plans for {key} (--gpu chooses)", err=True)
    return default_profile(key, gpus_per_node=cluster.gpus_per_node if cluster else 8)


TOKEN_FRACTIONS = (1, 2, 4)  # the microbatch's tokens, a half and a quarter of them


def gemm_rate(resolved: Resolved, on, reps: int) -> dict:
    """The FLOP-weighted rate of one microbatch's products and of a half and a quarter of its
    tokens, each product's passes at the full microbatch, and the knee that fits the rates:
    rate(t) = full / (1 + knee / t) is a line in 1/t."""
    tokens = rank_tokens(resolved)
    sizes = sorted({max(1, tokens // f) for f in TOKEN_FRACTIONS}, reverse=True)
    measured = {t: _gemm_rate_at(resolved, on, reps, t) for t in sizes}
    rates = {t: measured[t][0] for t in sizes}
    rate, rows = measured[tokens]
    return {"rate": rate, "rows": rows, "knee": knee_of(rates), "rates": rates}


def knee_of(rates: dict[int, float]) -> float:
    """The knee k of rate(t) = full / (1 + k / t) that fits rates at token counts t (least
    squares on 1 / rate, a line in 1 / t); 0 where the rate does not fall with fewer tokens."""
    import numpy as np

    if len(rates) < 2:
        return 0.0
    slope, intercept = np.polyfit([1 / t for t in rates], [1 / r for r in rates.values()], 1)
    return max(0.0, float(slope / intercept)) if intercept > 0 else 0.0


def _gemm_rate_at(resolved: Resolved, on, reps: int, tokens: int) -> tuple[float, list]:
    from dsforge.calibrate.kernel_timing import WARMUP, model_gemms, time_gemm

    rows, flops, seconds = [], 0.0, 0.0
    for g in model_gemms(resolved.recipe.model, tokens, tp=resolved.layout.tp):
        passes = time_gemm(g, on, recipe_dtype(resolved), reps, warmup=WARMUP)
        flops += 3 * g.count * g.flops
        seconds += g.count * sum(passes.values())
        rows.append((g, passes))
    return flops / seconds, rows


def optimizer_cost(resolved: Resolved, on, reps: int) -> dict:
    """The step at one layer and at more (optimizer_sizes): seconds a parameter (the slope
    between them) and fixed seconds (the line at zero parameters)."""
    from dsforge.calibrate.optimizer_timing import init_world, time_optimizer

    _quiet_deepspeed(on)
    init_world(on)
    divisor, layers = optimizer_sizes(resolved.recipe.model, _parameter_budget(on))

    def pair() -> tuple[dict, dict]:
        return tuple(time_optimizer(resolved, on, reps, divisor=divisor, layers=n) for n in (1, layers))

    small, large = pair()
    if large["step_s"] <= small["step_s"]:  # noise (a busy machine): timed once more
        small, large = pair()
    added = large["parameters"] - small["parameters"]
    slope = (large["step_s"] - small["step_s"]) / added if added > 0 else 0.0
    per_param = max(0.0, slope)
    fixed = max(0.0, large["step_s"] - per_param * large["parameters"])
    return {"per_param_s": per_param, "fixed_s": fixed, "small": small, "full": large,
            "divisor": divisor, "resolved": slope > 0}


def optimizer_sizes(model, budget: float) -> tuple[int, int]:
    """(width divisor, layers) whose parameters stay within `budget`: the recipe's widths
    where two layers fit, else halved until they do; then as many layers as fit, at least 2
    and at most the model's. A large model's optimizer step is a memory-bound stream, so its
    cost a parameter does not need the full model (nor would the full model fit one device)."""
    from dsforge.calibrate.optimizer_timing import parameter_shapes

    def count(divisor: int, layers: int) -> int:
        modules = parameter_shapes(model, divisor, layers)
        return sum(_numel(shape) for module in modules for shape in module)

    divisor = 1
    while count(divisor, 2) > budget and model.hidden_size // (2 * divisor) >= 8:
        divisor *= 2
    per_layer = count(divisor, 2) - count(divisor, 1)
    room = int((budget - count(divisor, 0)) // max(per_layer, 1))
    return divisor, max(2, min(model.num_layers, room))


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _parameter_budget(on) -> float:
    """Parameters an engine may hold here: a fifth of the GPU's memory at ~18 bytes each
    (bf16 weights and gradients, fp32 master weights and Adam's two moments); 50M on a CPU,
    where the step's time, not memory, is the limit."""
    import torch

    if on.type == "cuda":
        return torch.cuda.get_device_properties(on).total_memory / 5 / 18
    return 50e6


def _quiet_deepspeed(on) -> None:
    """DeepSpeed's warnings (the accelerator it guessed, its scheduler) are not this command's
    lines: the accelerator named before DeepSpeed is imported, its logger to errors after."""
    import importlib
    import logging
    import os

    if on.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed")  # which creates its logger
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def optimizer_fields(resolved: Resolved, profile: ClusterProfile, optimizer: dict) -> dict:
    """The profile's optimizer fields for the recipe's precision."""
    per_param = optimizer["per_param_s"] * profile.gpu.memory_bandwidth
    name = ("optimizer_bytes_per_param_fp32" if resolved.recipe.train.precision == "fp32"
            else "optimizer_bytes_per_param")
    return {name: max(per_param, 1e-3), "optimizer_fixed_s": optimizer["fixed_s"]}


def attention_efficiency(attention: dict, profile: ClusterProfile) -> float | None:
    """The measured attention's share of the peak, on the FLOPs dsforge counts for it (the
    full score matrix, as the cost model charges them); None where the backend had no kernel
    at these shapes (the profile then keeps attention at the GEMMs' rate)."""
    [timed] = attention["backends"].values()
    if "seconds" not in timed:
        return None
    return min(1.0, timed["tflops_full_matrix"] * 1e12 / profile.gpu.peak_bf16_flops)


def _side_figures(resolved: Resolved, on, reps: int, gemms: dict) -> dict:
    """Attention, the memory bandwidth, the float8 GEMM and the MoE experts. A bf16 recipe's
    GEMMs (`gemms`, gemm_rate's) are the float8 timing's bf16 side, not timed again."""
    import torch

    from dsforge.calibrate.kernel_timing import WARMUP, memory_bandwidth, time_attention

    m, lay, dtype = resolved.recipe.model, resolved.layout, recipe_dtype(resolved)
    attention = time_attention(m, lay.micro_batch, resolved.recipe.train.seq_len, on, dtype, reps,
                               warmup=WARMUP, backends=(m.sdpa_backend,))
    copy = GPU_COPY_MIB if on.type == "cuda" else CPU_COPY_MIB
    bf16 = {g.name: passes for g, passes in gemms["rows"]} if dtype is torch.bfloat16 else None
    return {"attention": attention, "bandwidth": memory_bandwidth(on, copy),
            "fp8": time_float8(resolved, on, reps, bf16_timed=bf16),
            "experts": time_experts(resolved, on, dtype, reps)}


def _report(resolved, profile: ClusterProfile, gemms: dict, optimizer: dict, side: dict,
            layers: dict | str, device_type: str) -> list[str]:
    """What was measured, for the terminal and the profile's comments."""
    attention, bandwidth = side["attention"], side["bandwidth"]
    [(backend, timed)] = attention["backends"].items()
    attention_text = (f"{timed['tflops_full_matrix']:.3g} TFLOP/s (full-matrix count): "
                      f"attention_efficiency {profile.attention_efficiency:.4g}"
                      if "seconds" in timed else f"no kernel ({timed['error']}): attention at "
                      "the GEMMs' rate")
    lines = provenance_lines("Measured by dsforge calibrate", profile.measured_on) + [
             f"GEMMs at {resolved.recipe.name}'s shapes: {gemms['rate'] / 1e12:.3g} TFLOP/s "
             f"({gemms['rate'] / profile.gpu.peak_bf16_flops:.3g} of the {profile.gpu.name}'s "
             f"peak): compute_efficiency {profile.compute_efficiency:.4g}",
             "  at " + ", ".join(f"{t:,} tokens {r / 1e12:.3g}" for t, r in gemms["rates"].items())
             + f" TFLOP/s: half the full rate at {profile.gemm_knee_tokens:.3g} tokens "
             "(gemm_knee_tokens)"]
    for g, passes in gemms["rows"]:
        lines.append(f"  {g.name} {g.m}x{g.k}x{g.n} (x{g.count}): "
                     + ", ".join(f"{p} {g.flops / t / 1e12:.3g}" for p, t in passes.items())
                     + " TFLOP/s")
    full, small = optimizer["full"], optimizer["small"]
    widths = f", widths / {optimizer['divisor']}" if optimizer["divisor"] > 1 else ""
    lines += [f"optimizer step ({full['optimizer']}{widths}): {small['step_s'] * 1e3:.3g} ms at "
              f"{small['parameters']:,} parameters, {full['step_s'] * 1e3:.3g} ms at "
              f"{full['parameters']:,}: {optimizer['fixed_s'] * 1e3:.3g} ms + "
              f"{optimizer['per_param_s'] * 1e9:.3g} ns a parameter"
              + ("" if optimizer["resolved"] else
                 " (warning: not resolved: the larger step took no longer, timed twice (a busy "
                 "machine?), so all of it is fixed cost; calibrate again on an idle machine or "
                 "with more --reps)"),
              f"attention ({backend}), forward and backward: {attention_text}",
              float8_line(side["fp8"], profile, device_type),
              expert_line(side["experts"], profile, resolved.recipe.name),
              f"memory bandwidth (a copy): {bandwidth / 1e9:.3g} GB/s; not a term of the cost "
              "model yet"]
    on_gpu = device_type == "cuda"
    lines += layer_lines(layers, profile, resolved, gemms["rate"], attention, on_gpu)
    band = f"the band (+-{profile.prediction_error:.1%} kept)"
    if on_gpu:
        return lines + [f"not measured here: {band}: dsforge plan --search --measure refits it"]
    return lines + [f"not measured here: the fixed cost per microbatch, ZeRO-3's gathers and "
                    f"{band}: dsforge plan --search --measure refits them"]
