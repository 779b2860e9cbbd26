"""Timing the recipe's own layers, for `dsforge calibrate`: the host's floor under each
layer's forward (cost.host_wait) and the layer's work outside its GEMMs and attention (cost.py
`other`).

The recipe's model, at one and at three of its layers, runs under DeepSpeed's engine as a
rank builds it (runtime/assemble/engine.py), on one device at tp = pp = cp = 1, without an
optimizer (neither measurement needs one, and a large model's layers then fit). The slope
between the two layer counts is one layer's cost; the embedding and the output layer cancel.

- The floors: the grad-enabled forward at a handful of tokens, once at ZeRO-0 and once at
  ZeRO-3 (whose per-module fetches and hooks are host work). At so few tokens the device's
  work is microseconds a layer, so on a GPU, where kernels launch asynchronously, the forward
  takes what the host needs to launch it: `host_layer_s` and `host_layer_zero3_s`.
- The layer's work: the forward and the backward at the recipe's micro-batch and sequence at
  ZeRO-0; less the layer's GEMMs and attention (timed by calibrate on their own), it is the
  work the `other` row stands for.
- The ZeRO-3 forward at the recipe's micro-batch and sequence: set beside the ZeRO-0 one, it
  says whether ZeRO-3's fetches pace the layer at the recipe's own shapes, where a bare layer
  at a handful of tokens asks less of the host than the recipe's does
  (calibrate_layers.zero3_floor).

A tensor-parallel layer's collectives launch from the host too and are in neither figure. On
a CPU the host is the device: the figures are measured and reported, and the profile keeps
neither (calibrate_command.py).
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

HOST_SEQ_LEN = 128  # tokens of the microbatch the floors are timed at
LAYER_COUNTS = (1, 3)  # a layer's cost is the slope between them
STAGES = (0, 3)  # ZeRO 0-2 share one floor (no per-module hooks below 3), ZeRO-3 has its own
WARMUP = 3  # passes before timing: ZeRO-3 records its fetch order in the first


def host_floors(resolved: Resolved, device: torch.device, reps: int) -> dict[int, dict]:
    """Per ZeRO stage: the seconds of one forward at HOST_SEQ_LEN tokens at each layer count,
    and their slope."""
    measured = {}
    for stage in STAGES:
        seconds = {n: time_passes(small_recipe(resolved, n, stage), device, reps,
                                  backward=False)["forward_s"] for n in LAYER_COUNTS}
        measured[stage] = {"forward_s": seconds, "per_layer_s": _slope(seconds)}
    return measured


def layer_work(resolved: Resolved, device: torch.device, reps: int) -> dict:
    """At the recipe's micro-batch and sequence, ZeRO-0: the seconds of the forward and of the
    forward with the backward at each layer count, and one layer's (the slopes)."""
    timed = {n: time_passes(recipe_shaped(resolved, n, 0), device, reps, backward=True)
             for n in LAYER_COUNTS}
    forward = {n: t["forward_s"] for n, t in timed.items()}
    both = {n: t["forward_backward_s"] for n, t in timed.items()}
    return {"tokens": _tokens(resolved), "forward_s": forward, "forward_backward_s": both,
            "forward_per_layer_s": _slope(forward), "per_layer_s": _slope(both)}


def zero3_forward(resolved: Resolved, device: torch.device, reps: int) -> dict:
    """At the recipe's micro-batch and sequence, ZeRO-3: the seconds of the forward at each
    layer count, and one layer's (the slope)."""
    forward = {n: time_passes(recipe_shaped(resolved, n, 3), device, reps,
                              backward=False)["forward_s"] for n in LAYER_COUNTS}
    return {"tokens": _tokens(resolved), "forward_s": forward, "per_layer_s": _slope(forward)}


def recipe_shaped(resolved: Resolved, layers: int, stage: int) -> Resolved:
    """small_recipe at the recipe's own micro-batch and sequence."""
    return small_recipe(resolved, layers, stage, micro_batch=resolved.layout.micro_batch,
                        seq_len=resolved.recipe.train.seq_len)


def _tokens(resolved: Resolved) -> int:
    return resolved.layout.micro_batch * resolved.recipe.train.seq_len


def _slope(seconds: dict[int, float]) -> float:
    """One layer's seconds; 0 where the larger count took no longer (calibrate_layers.rises
    tells the caller)."""
    (few, few_s), (many, many_s) = seconds.items()
    return max(0.0, (many_s - few_s) / (many - few))


def small_recipe(resolved: Resolved, layers: int, stage: int, micro_batch: int = 1,
                 seq_len: int = HOST_SEQ_LEN) -> Resolved:
    """The recipe's model with `layers` layers on one device at ZeRO `stage`: one microbatch
    of synthetic tokens, no checkpointing, no offload."""
    recipe = resolved.recipe
    m = recipe.model
    moe = m.moe and dataclasses.replace(m.moe, frequency=min(m.moe.frequency, layers))
    model = dataclasses.replace(m, num_layers=layers, moe=moe, init_from=None,
                                max_seq_len=max(m.max_seq_len, seq_len))
    train = dataclasses.replace(recipe.train, seq_len=seq_len, micro_batch=micro_batch,
                                grad_accum=1, global_batch=None, activation_checkpointing="none")
    zero = dataclasses.replace(recipe.zero, stage=stage, offload_optimizer="none",
                               offload_params="none")
    data = dataclasses.replace(recipe.data, source="synthetic", tokenizer=None)
    small = dataclasses.replace(recipe, name=f"{recipe.name[:80]}-layers", model=model,
                                parallel=ParallelConfig(dp=1), train=train, zero=zero, data=data,
                                cluster=None)
    return resolve(small, Topology(world_size=1))


def time_passes(resolved: Resolved, device: torch.device, reps: int, backward: bool) -> dict:
    """The median seconds of the engine's grad-enabled forward (and, with `backward`, of the
    forward with autograd's backward of its mean loss), synchronised on a GPU, after WARMUP;
    the engine, its process groups and its memory freed after."""
    from megatron.core import parallel_state

    from dsforge.runtime.assemble.engine import initialize_deepspeed
    from dsforge.translate.deepspeed_config import deepspeed_config

    r = resolved.recipe
    container, has_experts = build_layers(resolved, device)
    config = deepspeed_config(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                              device=device.type)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    engine = initialize_deepspeed(container, config, has_experts)
    try:
        tokens, positions = synthetic_batch(resolved, device)
        kinds = (False, True) if backward else (False,)
        medians = {}
        for with_backward in kinds:
            times = [_timed(engine, tokens, positions, device, with_backward)
                     for _ in range(WARMUP + reps)]
            medians["forward_backward_s" if with_backward else "forward_s"] = \
                statistics.median(times[WARMUP:])
    finally:
        engine.destroy()
        del engine, container
        parallel_state.destroy_model_parallel()
        _forget_aux_losses()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return medians


def _forget_aux_losses() -> None:
    """Megatron's routers log their load-balancing loss into a process-wide tracker whose
    tensors are sized by the first model's layer count; the next model (3 layers after 1)
    would index past them."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def build_layers(resolved: Resolved, device: torch.device):
    """(the rank's model chunks as one module, whether it has experts): the resolved recipe's
    model as a rank builds it, on one device; init_world first. Also what
    tools/loss_peak_memory.py and tests/unit/helpers/saved_activations.py measure."""
    from dsforge.runtime.assemble.engine import build_model
    from dsforge.runtime.startup import StartupClock

    backend = "nccl" if device.type == "cuda" else "gloo"
    container, has_experts, _, _ = build_model(resolved, device=device, backend=backend,
                                            timeout_s=600, startup=StartupClock())
    return container, has_experts


def synthetic_batch(resolved: Resolved, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One microbatch of random token ids and their positions, [micro_batch, seq_len] each."""
    r = resolved.recipe
    shape = (resolved.layout.micro_batch, r.train.seq_len)
    tokens = torch.randint(0, r.model.vocab_size, shape, device=device)
    return tokens, torch.arange(r.train.seq_len, device=device).expand(shape)


def _timed(engine, tokens, positions, device, backward: bool) -> float:
    """One pass. With the backward, the engine's module runs alone: autograd's backward is
    what ZeRO-0's is (DeepSpeed adds no hook of its own at stage 0), and DeepSpeed refuses a
    direct backward of its engine's output while the engine, without an optimizer, has none of
    its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    output = (engine.module if backward else engine)(tokens, positions, None, labels=tokens)
    if backward:
        output.float().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - begin
    del output  # the graph goes with it: the next pass starts afresh
    return seconds
