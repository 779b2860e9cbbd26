"""Timing the kernels a training step runs, at a model's shapes: its GEMMs in the three
passes of training, dsforge's attention per SDPA backend, and the device's memory bandwidth.

Used by `dsforge calibrate` (calibrate/command.py), which turns the figures into a
--profile file, and by the GPU kit's gemm.py (benchmarks/gpu). CUDA events on a GPU,
perf_counter on a CPU; medians of `reps` after `warmup` calls.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int  # tokens
    k: int  # input features
    n: int  # output features
    count: int  # how many a step runs per microbatch (layers, or 1 for the output layer)

    @property
    def flops(self) -> float:
        """FLOPs of one pass (forward, input gradient or weight gradient): 2 m k n."""
        return 2.0 * self.m * self.k * self.n


# Calls before the timed ones (the first pays for allocation, a GPU's kernel choice) in every
# kernel timing here, and the small product a CPU's rate is estimated from before a long
# calibration is refused (calibrate/command.py).
WARMUP = 2
PROBE = Gemm("probe", 512, 512, 512, 1)


def model_gemms(model, tokens: int, divisor: int = 1, tp: int = 1) -> list[Gemm]:
    """The products of one microbatch through the model (dsforge's Llama-style layer), on one
    of `tp` tensor-parallel ranks: column-parallel outputs (QKV, fc1, the vocabulary) and
    row-parallel inputs (proj, fc2) divided by tp."""
    h, ffn, d = model.hidden_size // divisor, model.ffn_hidden_size // divisor, max(model.head_dim // divisor, 1)
    heads, groups = model.num_attention_heads, model.query_groups
    vocab = max(model.vocab_size // divisor, 1)
    layers = model.num_layers
    return [Gemm("qkv", tokens, h, (heads + 2 * groups) * d // tp, layers),
            Gemm("proj", tokens, heads * d // tp, h, layers),
            Gemm("fc1", tokens, h, 2 * ffn // tp, layers),
            Gemm("fc2", tokens, ffn // tp, h, layers),
            Gemm("logits", tokens, h, vocab // tp, 1)]


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
    """dsforge's core attention (runtime/assemble/layers.py SDPAttention: causal, grouped KV heads as
    they are, Megatron's [seq, batch, heads, dim] layout), forward and backward, with each
    `model.sdpa_backend`; FLOPs counted as dsforge does (full s x s matrix: 12 b s^2 heads d),
    about twice what a causal kernel computes. A backend torch has no kernel for at these
    shapes is recorded with its error."""
    from types import SimpleNamespace

    from dsforge.runtime.assemble.layers import SDPAttention

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


def device_name(device: torch.device) -> str:
    """What a measurement on `device` was made on: the GPU's name, or the CPU and its cores."""
    import os

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def rank_tokens(resolved) -> int:
    """The tokens of one microbatch on a rank, what its products run over: micro_batch x
    seq_len, a context-parallel shard of it under cp (as the cost model counts them,
    cost/step_time.py modelled_gemm_rate)."""
    return resolved.layout.micro_batch * resolved.recipe.train.seq_len // resolved.layout.cp


def recipe_dtype(resolved) -> torch.dtype:
    """What the recipe's products run in: fp32, or bf16 for a 16-bit recipe."""
    return torch.float32 if resolved.recipe.train.precision == "fp32" else torch.bfloat16


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability, what decides its float8 and grouped GEMM kernels; None on
    a CPU."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def measured_on(device: torch.device) -> str:
    """The device and today's date: what a measured profile is true of (its `measured_on`)."""
    return f"{device_name(device)}, {time.strftime('%Y-%m-%d', time.gmtime())}"


def memory_bandwidth(device: torch.device, megabytes: int, reps: int = 5) -> float:
    """Bytes a second of a copy of `megabytes` (read and write counted)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, reps, warmup=2)
    return 2 * source.numel() / seconds
