"""GEMM and attention throughput at a model's shapes, against the planner's assumption.

For each recipe: the matrix products of one transformer layer and of the output layer, each in
the three shapes a training step runs them (nn.Linear layout, weight [out, in]: forward
X W^T, input gradient dY W, weight gradient dY^T X), timed in bf16 with CUDA events (median of
`reps` after warm-up, random inputs), and torch's scaled_dot_product_attention, causal, forward
and backward, through dsforge's own attention module (runtime/build/layers.py) with each of
`model.sdpa_backend`'s kernels (flash, cudnn, efficient, torch's choice): the SDPA backend
comparison at the models' shapes.
The FLOP-weighted throughput of all of a step's products over the GPU's peak is the figure to
compare with `compute_efficiency` in dsforge/search/profile.py (the share of peak the step-time
model assumes the model's GEMMs reach).

With --cpu-tiny (the kit's dry run, no GPU) the same code runs on the CPU in fp32 with every
width divided by 32 and 64 tokens: it checks the code, not the hardware.

    python benchmarks/gpu/gemm.py --gpu h100 --out gemm.json --recipe benchmarks/gpu/recipes/1b_1gpu.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
TINY_DIVISOR = 32
TINY_TOKENS = 64


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int  # tokens
    k: int  # input features
    n: int  # output features
    count: int  # how many a step runs per microbatch (layers, or 1 for the output layer)


def model_gemms(model, tokens: int, divisor: int = 1) -> list[Gemm]:
    """The products of one microbatch through the model (dsforge's Llama-style layer)."""
    h, ffn, d = model.hidden_size // divisor, model.ffn_hidden_size // divisor, max(model.head_dim // divisor, 1)
    heads, groups = model.num_attention_heads, model.query_groups
    vocab = max(model.vocab_size // divisor, 1)
    layers = model.num_layers
    return [Gemm("qkv", tokens, h, (heads + 2 * groups) * d, layers),
            Gemm("proj", tokens, heads * d, h, layers),
            Gemm("fc1", tokens, h, 2 * ffn, layers),
            Gemm("fc2", tokens, ffn, h, layers),
            Gemm("logits", tokens, h, vocab, 1)]


def median_seconds(fn, device: torch.device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def time_gemm(g: Gemm, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    """Seconds of each pass of one product; 2 m k n FLOPs each."""
    x = torch.randn(g.m, g.k, device=device, dtype=dtype)
    w = torch.randn(g.n, g.k, device=device, dtype=dtype)
    dy = torch.randn(g.m, g.n, device=device, dtype=dtype)
    passes = {"forward": lambda: F.linear(x, w), "input_grad": lambda: dy @ w,
              "weight_grad": lambda: dy.t() @ x}
    return {name: median_seconds(fn, device, reps, warmup) for name, fn in passes.items()}


# dsforge's model.sdpa_backend choices timed here; "auto" leaves the kernel to torch.
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "auto")


def time_attention(model, micro_batch: int, seq: int, device, dtype, reps: int, warmup: int,
                   divisor: int = 1, backends: tuple[str, ...] = SDPA_BACKENDS) -> dict:
    """dsforge's core attention (runtime/build/layers.py SDPAttention: causal, grouped KV heads as
    they are, Megatron's [seq, batch, heads, dim] layout), forward and backward, with each
    `model.sdpa_backend`; FLOPs counted as dsforge does (full s x s matrix: 12 b s^2 heads d),
    about twice what a causal kernel computes. A backend torch has no kernel for at these
    shapes is recorded with its error."""
    from types import SimpleNamespace

    from dsforge.runtime.build.layers import SDPAttention

    heads, groups, d = model.num_attention_heads, model.query_groups, max(model.head_dim // divisor, 1)
    q = torch.randn(seq, micro_batch, heads, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(seq, micro_batch, groups, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(seq, micro_batch, heads * d, device=device, dtype=dtype)
    flops = 12.0 * micro_batch * seq * seq * heads * d
    timed = {}
    for name in backends:
        attention = SDPAttention(SimpleNamespace(attention_dropout=0.0), 1, None, None, sdpa_backend=name)

        def step():
            attention(q, k, v, None).backward(grad)

        try:
            seconds = median_seconds(step, device, reps, warmup)
        except RuntimeError as exc:  # no kernel for these inputs: the finding
            timed[name] = {"error": str(exc).splitlines()[0][:200]}
            continue
        timed[name] = {"seconds": seconds, "tflops_full_matrix": flops / seconds / 1e12}
    return {"shape_sbhd": [seq, micro_batch, heads, d], "kv_heads": groups,
            "flops_full_matrix": flops, "backends": timed}


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
        per_pass = 2.0 * g.m * g.k * g.n
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
    from dsforge.hardware import gpu_by_key
    from dsforge.search.profile import default_profile

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
