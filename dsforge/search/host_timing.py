"""Timing the host's share of a layer: the floor under each layer's forward (cost.host_wait),
measured by `dsforge calibrate`.

The recipe's model, at one and at three of its layers, runs its grad-enabled forward at a
handful of tokens under DeepSpeed's engine, as a rank builds it (runtime/build/engine.py),
once at ZeRO-0 and once at ZeRO-3 (whose per-module fetches and hooks are host work). At so
few tokens the device's work is microseconds a layer (weight reads), so on a GPU, where
kernels launch asynchronously, a forward takes what the host needs to launch it: the slope
between the two layer counts is the floor, `host_layer_s` and `host_layer_zero3_s`.

Measured at tp = pp = cp = 1 on one device: a tensor-parallel layer's collectives launch from
the host too and are not in the figure. The engine has no optimizer (a forward does not need
one), so a large model's layers fit. On a CPU the host is the device: the same figures are
measured and reported, and the refit (`--measure`) fits the CPU's additive costs instead.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import torch

from dsforge.recipe.layout import Topology
from dsforge.recipe.resolve import Resolved, resolve
from dsforge.schema import ParallelConfig

HOST_SEQ_LEN = 128  # tokens of the timed microbatch
LAYER_COUNTS = (1, 3)  # the floor is the slope between them
STAGES = (0, 3)  # ZeRO 0-2 share one floor (no per-module hooks below 3), ZeRO-3 has its own
WARMUP = 3  # forwards before timing: ZeRO-3 records its fetch order in the first


def host_floors(resolved: Resolved, device: torch.device, reps: int) -> dict[int, dict]:
    """Per ZeRO stage: the seconds of one forward at each layer count, and their slope."""
    measured = {}
    for stage in STAGES:
        seconds = {n: forward_seconds(small_recipe(resolved, n, stage), device, reps)
                   for n in LAYER_COUNTS}
        (few, few_s), (many, many_s) = seconds.items()
        measured[stage] = {"forward_s": seconds,
                           "per_layer_s": max(0.0, (many_s - few_s) / (many - few))}
    return measured


def small_recipe(resolved: Resolved, layers: int, stage: int) -> Resolved:
    """The recipe's model with `layers` layers on one device at ZeRO `stage`: one microbatch of
    HOST_SEQ_LEN tokens of synthetic data, no checkpointing, no offload."""
    recipe = resolved.recipe
    m = recipe.model
    moe = m.moe and dataclasses.replace(m.moe, frequency=min(m.moe.frequency, layers))
    model = dataclasses.replace(m, num_layers=layers, moe=moe, init_from=None,
                                max_seq_len=max(m.max_seq_len, HOST_SEQ_LEN))
    train = dataclasses.replace(recipe.train, seq_len=HOST_SEQ_LEN, micro_batch=1, grad_accum=1,
                                global_batch=None, activation_checkpointing="none")
    zero = dataclasses.replace(recipe.zero, stage=stage, offload_optimizer="none",
                               offload_params="none")
    data = dataclasses.replace(recipe.data, source="synthetic", tokenizer=None)
    small = dataclasses.replace(recipe, name=f"{recipe.name[:80]}-host", model=model,
                                parallel=ParallelConfig(dp=1), train=train, zero=zero, data=data,
                                cluster=None)
    return resolve(small, Topology(world_size=1))


def forward_seconds(resolved: Resolved, device: torch.device, reps: int) -> float:
    """The median seconds of the engine's grad-enabled forward (synchronised on a GPU), after
    WARMUP; the engine, its process groups and its memory freed after."""
    from megatron.core import parallel_state

    from dsforge.runtime.build.engine import build_model, initialize_deepspeed
    from dsforge.runtime.startup import StartupClock
    from dsforge.translate.deepspeed_config import deepspeed_config

    r = resolved.recipe
    backend = "nccl" if device.type == "cuda" else "gloo"
    container, has_experts, _ = build_model(resolved, device=device, backend=backend,
                                            timeout_s=600, startup=StartupClock())
    config = deepspeed_config(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                              device=device.type)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    engine = initialize_deepspeed(container, config, has_experts)
    try:
        tokens = torch.randint(0, r.model.vocab_size, (1, r.train.seq_len), device=device)
        positions = torch.arange(r.train.seq_len, device=device).unsqueeze(0)
        times = [_timed_forward(engine, tokens, positions, device) for _ in range(WARMUP + reps)]
    finally:
        engine.destroy()
        del engine, container
        parallel_state.destroy_model_parallel()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return statistics.median(times[WARMUP:])


def _timed_forward(engine, tokens, positions, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    output = engine(tokens, positions, None, labels=tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - begin
    del output  # the graph goes with it: the next forward starts afresh
    return seconds
