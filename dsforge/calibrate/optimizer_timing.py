"""Timing the optimizer step alone: DeepSpeed's engine as dsforge configures it for a recipe
(dsforge.translate.deepspeed_config: the same optimizer, the same wrapper around it) over
parameters of the recipe's model's shapes, in a world of one rank.

No Megatron model: the step sees only parameters and their gradients, so a cheap forward (each
parameter summed) fills every gradient. Used by `dsforge calibrate` and by the GPU kit's
adam_step.py (benchmarks/gpu).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
from torch import nn


class _Layer(nn.Module):
    """Some of the model's parameters, held directly (ZeRO-3 gathers a module's own
    parameters when it is called); forward touches each."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        super().__init__()
        for index, shape in enumerate(shapes):
            self.register_parameter(f"w{index}", nn.Parameter(torch.randn(shape) * 0.02))

    def forward(self, total: torch.Tensor) -> torch.Tensor:
        for weight in self.parameters(recurse=False):
            total = total + weight.float().sum()
        return total


class ParameterModel(nn.Module):
    """The parameters of a transformer of `model`'s shapes, one module per layer."""

    def __init__(self, model, divisor: int = 1, layers: int | None = None):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(shapes) for shapes in parameter_shapes(model, divisor, layers))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=scale.device)
        for layer in self.layers:
            total = layer(total)
        return total * scale


def parameter_shapes(model, divisor: int = 1, layers: int | None = None) -> list[list[tuple[int, ...]]]:
    """Per module: the embedding (and an untied output layer), each layer's four projections
    and two norms, the final norm, as dsforge's Llama-style GPT holds them; `layers` of its
    layers (all of them by default)."""
    h, ffn = model.hidden_size // divisor, model.ffn_hidden_size // divisor
    d = max(model.head_dim // divisor, 1)
    heads, groups, vocab = model.num_attention_heads, model.query_groups, max(model.vocab_size // divisor, 1)
    layer = [((heads + 2 * groups) * d, h), (h, heads * d), (2 * ffn, h), (h, ffn), (h,), (h,)]
    outer = [[(vocab, h)]] + ([] if model.tie_embeddings else [[(vocab, h)]])
    count = model.num_layers if layers is None else layers
    return outer + [list(layer) for _ in range(count)] + [[(h,)]]


def engine_config(resolved, device: str) -> tuple[dict, object]:
    """dsforge's DeepSpeed config for the resolved recipe, one microbatch a step."""
    from dsforge.translate.deepspeed_config import deepspeed_config

    r = resolved.recipe
    config = deepspeed_config(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                              device=device)
    micro = resolved.layout.micro_batch
    config.update(train_batch_size=micro, train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=1)
    return config, r.model


def init_world(device: torch.device) -> None:
    """One rank of a world of one, as DeepSpeed's launcher would set it up."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device.type == "cpu":
        from dsforge.runtime.assemble.cpu_backend import skip_deepspeed_shm_allreduce

        skip_deepspeed_shm_allreduce()  # the CPU all-reduce op DeepSpeed would compile
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


def build_environment(resolved) -> dict[str, str]:
    """What a dsforge rank on a GPU sets before DeepSpeed builds the recipe's ops (nothing
    where no op is built or the list is readable already), and says so."""
    from dsforge.translate.build_env import arch_list_for_rank

    mapped, line = arch_list_for_rank(resolved, "cuda", os.environ)
    if line:  # dsforge's own line, to the terminal: stdout goes to the engine log meanwhile
        print(line, file=sys.stderr)
    return mapped


def timed_step(engine, device: torch.device) -> float:
    """Seconds of one engine.step() after a backward that filled every gradient."""
    scale = torch.full((), 1e-6, device=device)
    engine.backward(engine(scale))
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    engine.step()
    return time.perf_counter() - begin


def time_optimizer(resolved, device: torch.device, reps: int, divisor: int = 1,
                   layers: int | None = None) -> dict:
    """One engine for the resolved recipe (its ZeRO stage and train.adam_impl): the wrapper
    DeepSpeed put around which optimizer, the median step after one warm-up step (which makes
    the optimizer's state), the parameters and the peak memory. init_world first."""
    import gc

    import deepspeed

    config, model = engine_config(resolved, device.type)
    if device.type == "cuda":
        os.environ.update(build_environment(resolved))
        torch.cuda.reset_peak_memory_stats(device)
    network = ParameterModel(model, divisor, layers).to(device)
    parameters = sum(p.numel() for p in network.parameters())
    engine, _, _, _ = deepspeed.initialize(model=network, config=config)
    try:
        timed_step(engine, device)
        seconds = [timed_step(engine, device) for _ in range(reps)]
        basic = engine.basic_optimizer
        fused = " (fused)" if basic.defaults.get("fused") else ""
        optimizer = f"{type(engine.optimizer).__name__} around {type(basic).__name__}{fused}"
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        engine.destroy()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"optimizer": optimizer, "step_s": statistics.median(seconds), "steps_s": seconds,
            "parameters": parameters, "peak_memory_bytes": peak}
