"""`dsforge calibrate`'s float8 figure: `fp8_gemm_speedup`, how many times faster train.fp8's
float8 GEMMs are than bf16's at the transformer layers' linear layers (cost/step_time.py
float8_gemm_seconds).

Timed are the GEMMs themselves: torch's scaled matrix product (`torch._scaled_mm`, what
torchao's float8 linear calls) in each of a linear layer's three passes (the output, the
input's gradient, the weight's), on operands cast to float8 and laid out beforehand with the
dtypes, scale shapes and fast-accumulation settings of torchao's config for the scaling (the
one the ranks use, runtime/assemble/fp8.py), against the same three products in bf16
(kernel_timing.time_gemm). The casts and scales are left out: the cost model counts them in
the `other` row (fp8_eager_cast_share eager, fused under model.compile), so the speedup here
is the products' alone. At a layer's product shapes at a rank's microbatch (QKV, the
attention's output projection, fc1, fc2; not the output layer, which stays bf16). The
scaling is the recipe's train.fp8, else tensorwise. Nothing is timed, and the profile keeps
its figure, where torchao is missing, the GPU has no float8 GEMM for the scaling
(translate/fp8.py), the model has experts (train.fp8 does not apply: FP4) or a width has no
float8 kernel. A CPU runs torch's reference float8 product (slower than bf16 there): timed,
so the path is exercised, but its figure is not a GPU's.
"""

from __future__ import annotations

from dsforge.calibrate.kernel_timing import (PROBE, WARMUP, Gemm, device_capability,
                                             median_seconds, model_gemms, rank_tokens, time_gemm)
from dsforge.recipe.resolve import Resolved


def scaling_timed(recipe) -> str:
    """The recipe's train.fp8 scaling, else tensorwise (cuBLAS's float8 GEMM, the one more
    GPUs run: translate/fp8.py)."""
    return recipe.train.fp8 if recipe.train.fp8 != "none" else "tensorwise"


def scaling_text(recipe) -> str:
    """Which scaling was timed and why, for the report."""
    if recipe.train.fp8 != "none":
        return f"{recipe.train.fp8}, the recipe's train.fp8"
    return "tensorwise: the recipe's train.fp8 is none"


def why_not_timed(resolved: Resolved, on) -> str | None:
    """Why the float8 GEMMs are not timed for `resolved` on `on` (None: they are): a model
    with experts (FP4), torchao missing (X1: its config gives the casts' dtypes) or a GPU
    older than the scaling's kernel (FP6), as translate/fp8.py rules for the ranks. A CPU is
    asked about as a GPU of unknown capability: its own FP6 (no float8 training on CPU
    ranks, slower there than bf16) does not stop a timing, torch's reference product runs."""
    from dsforge.translate.fp8 import fp8_device_problems, torchao_installed

    if resolved.recipe.model.moe is not None:
        return "[FP4] train.fp8 is for dense models; the experts' GEMMs stay bf16"
    problems = fp8_device_problems(scaling_timed(resolved.recipe), device="cuda",
                                   capability=device_capability(on),
                                   torchao_available=torchao_installed())
    return "; ".join(f"[{p.rule}] {p.message}" for p in problems) or None


def layer_gemms(resolved: Resolved) -> list[Gemm]:
    """A layer's products at a rank's microbatch: the ones train.fp8 runs in float8."""
    return [g for g in model_gemms(resolved.recipe.model, rank_tokens(resolved),
                                   tp=resolved.layout.tp) if g.name != "logits"]


def time_float8(resolved: Resolved, on, reps: int,
                bf16_timed: dict[str, dict] | None = None) -> dict:
    """{"scaling", "bf16_s", "fp8_s" (a microbatch's layer products, their three passes, each
    product x its count), "flops"}, or {"scaling", "skipped": why}. `bf16_timed`: the
    products' passes already timed in bf16 at these shapes, by name (calibrate's GEMM rate
    for a bf16 recipe); the others are timed here."""
    import torch

    scaling, timed = scaling_text(resolved.recipe), scaling_timed(resolved.recipe)
    why = why_not_timed(resolved, on)
    if why:
        return {"scaling": scaling, "skipped": why}
    bf16_s = fp8_s = flops = 0.0
    try:
        for g in layer_gemms(resolved):
            bf16 = (bf16_timed or {}).get(g.name) or time_gemm(g, on, torch.bfloat16, reps, WARMUP)
            bf16_s += g.count * sum(bf16.values())
            fp8_s += g.count * sum(time_scaled_gemm(g, timed, on, reps).values())
            flops += 3 * g.count * g.flops
    except RuntimeError as exc:  # no float8 kernel for these shapes (e.g. a width not x16)
        return {"scaling": scaling,
                "skipped": f"no float8 product at these shapes: {str(exc).splitlines()[0][:200]}"}
    return {"scaling": scaling, "bf16_s": bf16_s, "fp8_s": fp8_s, "flops": flops}


def time_scaled_gemm(g: Gemm, scaling: str, on, reps: int, warmup: int = WARMUP) -> dict:
    """Seconds of each pass of one float8 product at g's shape (x [m, k], the weight w [n, k]
    as nn.Linear holds it, the output's gradient dy [m, n]), each operand as torchao's config
    casts it: the output x @ w.T, the input's gradient dy @ w, the weight's dy.T @ x; the
    second operand column-major, as the kernel takes it."""
    config = _torchao_config(scaling)
    rowwise = scaling == "rowwise"
    passes = {"forward": (g.m, g.k, g.n, config.cast_config_input, config.cast_config_weight,
                          config.gemm_config_output),
              "input_grad": (g.m, g.n, g.k, config.cast_config_grad_output,
                             config.cast_config_weight_for_grad_input, config.gemm_config_grad_input),
              "weight_grad": (g.n, g.m, g.k, config.cast_config_grad_output_for_grad_weight,
                              config.cast_config_input_for_grad_weight,
                              config.gemm_config_grad_weight)}
    return {name: median_seconds(_scaled_product(*shape, on, rowwise), on, reps, warmup)
            for name, shape in passes.items()}


def _torchao_config(scaling: str):
    """torchao's float8 config for `scaling`, as the ranks make it. Importing torchao logs the
    optional kernels it could not load (none of them these) and a torch deprecation: not this
    command's lines."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from torchao.float8.config import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(scaling)


def _scaled_product(rows: int, inner: int, cols: int, cast_a, cast_b, gemm, on, rowwise: bool):
    """a [rows, inner] @ b [inner, cols] in float8 (b column-major), bf16 out: a callable."""
    import torch

    a = torch.randn(rows, inner, device=on).to(cast_a.target_dtype)
    b = torch.randn(cols, inner, device=on).to(cast_b.target_dtype).t()  # column-major
    scale_a = torch.ones(rows, 1, device=on) if rowwise else torch.tensor(1.0, device=on)
    scale_b = torch.ones(1, cols, device=on) if rowwise else torch.tensor(1.0, device=on)
    return lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                                    out_dtype=torch.bfloat16, use_fast_accum=gemm.use_fast_accum)


def float8_speedup(timed: dict) -> float | None:
    """bf16's seconds over float8's, summed over the layer products (None: not timed)."""
    return timed["bf16_s"] / timed["fp8_s"] if "fp8_s" in timed else None


def cpu_estimate(resolved: Resolved, on, reps: int, rate: float) -> tuple[float, float]:
    """(FLOPs, seconds) the float8 timing would take on this CPU: its bf16 products at `rate`
    (the CPU's dense rate), its float8 ones at the float8 product's rate at a 512^3 product
    (torch's reference float8 product: several times slower than the dense one here)."""
    if why_not_timed(resolved, on):
        return 0.0, 0.0
    flops = sum(3 * g.flops for g in layer_gemms(resolved)) * (reps + WARMUP)
    probe_s = sum(time_scaled_gemm(PROBE, scaling_timed(resolved.recipe), on, 3,
                                   warmup=1).values())
    return 2 * flops, flops / rate + flops * probe_s / (3 * PROBE.flops)


def float8_line(timed: dict, profile, device_type: str) -> str:
    """The report's line: the rates, the speedup written, or why none was."""
    chosen = f"float8 GEMMs ({timed['scaling']}"
    if "skipped" in timed:
        return (f"{chosen}): not timed ({timed['skipped']}): fp8_gemm_speedup "
                f"{profile.fp8_gemm_speedup:.4g} kept")
    rate = {k: timed["flops"] / timed[f"{k}_s"] / 1e12 for k in ("fp8", "bf16")}
    cpu = ("; a CPU's figure (torch's reference float8 product), not a GPU's"
           if device_type != "cuda" else "")
    return (f"{chosen}) at a layer's shapes, the products alone (the casts are the other "
            f"row's), three passes: {rate['fp8']:.3g} TFLOP/s against bf16's {rate['bf16']:.3g}: "
            f"fp8_gemm_speedup {profile.fp8_gemm_speedup:.4g}{cpu}")
