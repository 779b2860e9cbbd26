"""`dsforge calibrate`'s float8 figure: `fp8_gemm_speedup`, how many times faster train.fp8's
float8 GEMMs run the transformer layers' linear layers than bf16's (cost/step_time.py
float8_gemm_seconds).

Timed is the product a rank runs (runtime/assemble/fp8.py float8_product: torchao's
`matmul_with_hp_or_float8_args`, its casts and scales included) against bf16's F.linear, both
forward and backward (input and weight gradients) through autograd, at the layers' product
shapes at the recipe's microbatch (kernel_timing.model_gemms: QKV, the attention's output
projection, fc1, fc2; not the output layer, which stays bf16). The scaling is the recipe's
train.fp8, else tensorwise. One size only (the recipe's microbatch), as the speedup is a ratio
at the shapes the planner prices. Where torchao is missing or the GPU has no float8 GEMM
(translate/fp8.py), nothing is timed and the profile keeps its figure. A CPU runs torch's
reference float8 product (emulated, slower than bf16): timed, so a CPU's calibration
exercises the path, but its figure says nothing of a GPU's.
"""

from __future__ import annotations

from dsforge.calibrate.kernel_timing import Gemm, device_capability, median_seconds, model_gemms
from dsforge.recipe.resolve import Resolved

WARMUP = 2
PROBE = Gemm("probe", 512, 512, 512, 1)  # the product a CPU's float8 rate is estimated from


def scaling_timed(recipe) -> str:
    """The recipe's train.fp8 scaling, else tensorwise (cuBLAS's float8 GEMM, the one more
    GPUs run: translate/fp8.py)."""
    return recipe.train.fp8 if recipe.train.fp8 != "none" else "tensorwise"


def scaling_text(recipe) -> str:
    """Which scaling was timed and why, for the report."""
    if recipe.train.fp8 != "none":
        return f"{recipe.train.fp8}, the recipe's train.fp8"
    return "tensorwise: the recipe's train.fp8 is none"


def why_not_timed(scaling: str, on) -> str | None:
    """Why the float8 product cannot run on `on` (None: it can): torchao missing (X1) or a
    GPU older than the scaling's kernel (FP6), as translate/fp8.py rules for the ranks. A CPU
    is asked about as a GPU of unknown capability: its own FP6 (no float8 training on CPU
    ranks, slower there than bf16) does not stop a timing, torch's reference product runs."""
    from dsforge.translate.fp8 import fp8_device_problems, torchao_installed

    problems = fp8_device_problems(scaling, device="cuda", capability=device_capability(on),
                                   torchao_available=torchao_installed())
    return "; ".join(f"[{p.rule}] {p.message}" for p in problems) or None


def layer_gemms(resolved: Resolved) -> list[Gemm]:
    """A layer's products at the recipe's microbatch: the ones train.fp8 runs in float8."""
    tokens = resolved.layout.micro_batch * resolved.recipe.train.seq_len
    return [g for g in model_gemms(resolved.recipe.model, tokens, tp=resolved.layout.tp)
            if g.name != "logits"]


def time_float8(resolved: Resolved, on, reps: int) -> dict:
    """{"scaling", "bf16_s", "fp8_s" (a microbatch's layer products, forward and backward,
    each product x its count), "flops"}, or {"scaling", "skipped": why}."""
    import torch.nn.functional as F

    scaling = scaling_timed(resolved.recipe)
    why = why_not_timed(scaling, on)
    if why:
        return {"scaling": scaling_text(resolved.recipe), "skipped": why}
    product = _float8_product(scaling)
    bf16_s = fp8_s = flops = 0.0
    try:
        for g in layer_gemms(resolved):
            bf16_s += g.count * time_product(F.linear, g, on, reps)
            fp8_s += g.count * time_product(product, g, on, reps)
            flops += 3 * g.count * g.flops
    except RuntimeError as exc:  # no float8 kernel for these shapes (e.g. a width not x16)
        return {"scaling": scaling_text(resolved.recipe),
                "skipped": f"no float8 product at these shapes: {str(exc).splitlines()[0][:200]}"}
    return {"scaling": scaling_text(resolved.recipe), "bf16_s": bf16_s, "fp8_s": fp8_s,
            "flops": flops}


def time_product(product, g: Gemm, on, reps: int, warmup: int = WARMUP) -> float:
    """Seconds of `product(x, w)` (x [m, k], w [n, k] as nn.Linear holds it, in bf16) and its
    backward to both x and w, at g's shape."""
    import torch

    x = torch.randn(g.m, g.k, device=on, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(g.n, g.k, device=on, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(g.m, g.n, device=on, dtype=torch.bfloat16)
    return median_seconds(lambda: torch.autograd.grad(product(x, w), (x, w), dy), on, reps, warmup)


def _float8_product(scaling: str):
    """The rank's float8 product. Importing torchao logs the optional kernels it could not
    load (none of them float8's) and a torch deprecation: not this command's lines."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from dsforge.runtime.assemble.fp8 import float8_product

    return float8_product(scaling)


def float8_speedup(timed: dict) -> float | None:
    """bf16's seconds over float8's, summed over the layer products (None: not timed)."""
    return timed["bf16_s"] / timed["fp8_s"] if "fp8_s" in timed else None


def cpu_estimate(resolved: Resolved, on, reps: int, rate: float) -> tuple[float, float]:
    """(FLOPs, seconds) the float8 timing would take on this CPU: its bf16 products at `rate`
    (the CPU's dense rate), its float8 ones at the float8 product's rate at a 512^3 product
    (torch's reference float8 product: several times slower than the dense one here)."""
    scaling = scaling_timed(resolved.recipe)
    if why_not_timed(scaling, on):
        return 0.0, 0.0
    flops = sum(3 * g.flops for g in layer_gemms(resolved)) * (reps + WARMUP)
    probe_s = time_product(_float8_product(scaling), PROBE, on, 3, warmup=1)
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
    return (f"{chosen}) at a layer's shapes, forward and backward: {rate['fp8']:.3g} TFLOP/s "
            f"against bf16's {rate['bf16']:.3g}: fp8_gemm_speedup {profile.fp8_gemm_speedup:.4g}"
            f"{cpu}")
