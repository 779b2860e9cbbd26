"""GEMM and attention throughput at a model's shapes, against the planner's assumption.

For each recipe: the matrix products of one transformer layer and of the output layer, each in
the three shapes a training step runs them (nn.Linear layout, weight [out, in]: forward
X W^T, input gradient dY W, weight gradient dY^T X), timed in bf16 with CUDA events (median of
`reps` after warm-up, random inputs), and torch's scaled_dot_product_attention, causal, forward
and backward, through dsforge's own attention module (runtime/assemble/layers.py) with each of
`model.sdpa_backend`'s kernels (flash, cudnn, efficient, torch's choice): the SDPA backend
comparison at the models' shapes.
The FLOP-weighted throughput of all of a step's products over the GPU's peak is the figure to
compare with `compute_efficiency` in dsforge/cost/profile.py (the share of peak the step-time
model assumes the model's GEMMs reach).

With --cpu-tiny (the kit's dry run, no GPU) the same code runs on the CPU in fp32 with every
width divided by 32 and 64 tokens: it checks the code, not the hardware.

    python benchmarks/gpu/gemm.py --gpu h100 --out gemm.json --recipe benchmarks/gpu/recipes/1b_1gpu.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the working tree's dsforge first, as run.sh sets it

from dsforge.calibrate.kernel_timing import model_gemms, time_attention, time_gemm  # noqa: E402
TINY_DIVISOR = 32
TINY_TOKENS = 64


def measure_model(recipe: str, device: torch.device, dtype: torch.dtype,
                  reps: int, warmup: int, tiny: bool) -> dict:
    from dsforge.recipe import resolve_file

    resolved = resolve_file(REPO / recipe, world_size=1)
    model, train = resolved.recipe.model, resolved.recipe.train
    divisor = TINY_DIVISOR if tiny else 1
    tokens = TINY_TOKENS if tiny else resolved.layout.micro_batch * train.seq_len
    rows, flops, seconds = [], 0.0, 0.0
    for g in model_gemms(model, tokens, divisor):
        passes = time_gemm(g, device, dtype, reps, warmup)
        per_pass = g.flops
        for name, t in passes.items():
            rows.append({"gemm": g.name, "pass": name, "m": g.m, "k": g.k, "n": g.n,
                         "count": g.count, "seconds": t, "tflops": per_pass / t / 1e12})
            flops, seconds = flops + g.count * per_pass, seconds + g.count * t
    seq = TINY_TOKENS if tiny else train.seq_len
    micro = 1 if tiny else resolved.layout.micro_batch
    attention = time_attention(model, micro, seq, device, dtype, reps, warmup, divisor)
    return {"recipe": recipe, "tokens": tokens, "gemms": rows, "step_gemm_flops": flops,
            "step_gemm_seconds": seconds, "tflops": flops / seconds / 1e12, "attention": attention}


def run(recipes: list[str], gpu: str | None, *, tiny: bool, reps: int, warmup: int) -> dict:
    """Every recipe's figures, with the peak and the planner's efficiency for `gpu`."""
    from dsforge.cost.profile import default_profile
    from dsforge.hardware import gpu_by_key

    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    peak = None if tiny or gpu is None else gpu_by_key(gpu).peak_bf16_flops
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "gpu": gpu, "dtype": str(dtype).removeprefix("torch."), "tiny": tiny,
              "peak_flops": peak, "reps": reps,
              "planner_compute_efficiency": default_profile(gpu).compute_efficiency if gpu else None,
              "models": [measure_model(r, device, dtype, reps, warmup, tiny) for r in recipes]}
    for entry in result["models"]:
        entry["share_of_peak"] = entry["tflops"] * 1e12 / peak if peak else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", action="append", required=True, help="repeatable")
    parser.add_argument("--gpu", help="dsforge GPU key for the peak (h100, h200, ...)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-tiny", action="store_true", help="CPU, fp32, tiny shapes")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if not args.cpu_tiny and not torch.cuda.is_available():
        print("gemm.py: no GPU visible; use --cpu-tiny to check the code on the CPU", file=sys.stderr)
        return 2
    result = run(args.recipe, args.gpu, tiny=args.cpu_tiny, reps=args.reps, warmup=3)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for entry in result["models"]:
        share = f"{entry['share_of_peak']:.1%}" if entry["share_of_peak"] is not None else "n/a"
        attention = ", ".join(f"{name} {t['tflops_full_matrix']:.1f}" if "error" not in t else f"{name} -"
                              for name, t in entry["attention"]["backends"].items())
        print(f"{entry['recipe']}: GEMMs {entry['tflops']:.1f} TFLOP/s ({share} of peak); attention "
              f"TFLOP/s (full-matrix count): {attention}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
