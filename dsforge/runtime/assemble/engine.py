"""Build a rank: Megatron-Core's parallel state, the model chunks and DeepSpeed's engine.

`build_rank` is the one place parallelism is applied inside a rank; its docstring gives the
order. The rest of this module is the glue it uses between Megatron-Core and DeepSpeed.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dsforge.recipe import Resolved
from dsforge.runtime.assemble import megatron_fixes
from dsforge.runtime.assemble.grads import sum_sequence_parallel_grads
from dsforge.runtime.assemble.init import init_from_hugging_face, init_layout_invariant
from dsforge.runtime.assemble.kernels import loadable
from dsforge.runtime.assemble.model import build_model_chunks
from dsforge.runtime.assemble.moe_glue import deepspeed_sees_megatron_moe, register_experts
from dsforge.runtime.assemble.schedule import make_scheduler
from dsforge.runtime.startup import StartupClock
from dsforge.translate.deepspeed_config import deepspeed_config, scheduler_section
from dsforge.translate.experts import ExpertsChoice, choose_experts
from dsforge.translate.kernels import (KernelChoice, choose_kernels, documents_for,
                                      liger_installed)
from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                        parallel_state_kwargs, transformer_config_kwargs)


@dataclass(frozen=True)
class RankParts:
    """What `build_rank` makes: this rank's model chunks (one per virtual pipeline stage) and
    the DeepSpeed engine around them (`engine.module.chunks` are the same modules)."""

    chunks: list[nn.Module]
    engine: Any  # deepspeed.DeepSpeedEngine
    kernels: KernelChoice  # what the model's norms, SwiGLU and loss run on
    experts: ExpertsChoice | None = None  # how MoE layers run their experts; None: dense


def build_rank(resolved: Resolved, *, device: torch.device, backend: str,
               timeout_s: float, startup: StartupClock | None = None) -> RankParts:
    """Apply parallelism inside this rank, in this order (each step needs the ones before):

      1. Megatron-Core's own bugs worked around (megatron_fixes.py), and the CPU backend
         (cpu_backend.py) when `device` is the CPU, before anything touches torch.cuda or
         DeepSpeed's comm layer;
      2. torch.distributed and DeepSpeed's comm layer on `backend` (nccl / gloo), collectives
         timing out after `timeout_s`;
      3. Megatron-Core parallel state from the translated kwargs, model-parallel RNG seeded;
      4. model chunks built (one per virtual stage) from the TransformerConfig translated for
         this device and its kernels (translate/kernels.py), then initialised
         layout-invariantly (model.py, init.py): drawn, or read from the Hugging Face folder
         model.init_from names;
      5. gradient hooks: sequence-parallel parameters summed over TP, expert parameters named
         and their groups registered with DeepSpeed (grads.py, moe_glue.py);
      6. deepspeed.initialize on a container of the chunks with the DeepSpeed config translated
         for this device and `MegatronMPU`, so DeepSpeed reduces gradients over Megatron's
         data-parallel group and computes the gradient norm over the tensor x pipeline group.

    `startup` (runtime/startup.py) is told when the process group, the model, its weights and
    the engine are ready.
    """
    startup = startup or StartupClock()
    container, has_experts, kernels, experts = build_model(
        resolved, device=device, backend=backend, timeout_s=timeout_s, startup=startup)
    recipe = resolved.recipe
    ds_config = deepspeed_config(model=recipe.model, train=recipe.train, zero=recipe.zero,
                                 layout=resolved.layout, device=device.type)
    engine = initialize_deepspeed(container, ds_config, has_experts,
                                  lr_scheduler=make_scheduler(scheduler_section(recipe.train)))
    startup.mark("engine")
    return RankParts(chunks=list(container.chunks), engine=engine, kernels=kernels,
                     experts=experts)


def build_model(resolved: Resolved, *, device: torch.device, backend: str, timeout_s: float,
                startup: StartupClock) -> tuple[ModelChunks, bool, KernelChoice, ExpertsChoice | None]:
    """Steps 1-5 of build_rank: (the chunks as one module, whether it has experts, the
    kernels, how MoE layers run their experts). `dsforge calibrate` times this model's forward
    under an engine of its own."""
    recipe, layout = resolved.recipe, resolved.layout
    megatron_fixes.apply()
    if device.type == "cpu":
        from dsforge.runtime.assemble import cpu_backend

        cpu_backend.activate()
    init_distributed(backend, timeout_s)
    init_parallel_state(parallel_state_kwargs(layout), recipe.train.seed, timeout_s)
    startup.mark("distributed")
    kernels = loadable(choose_kernels(recipe.model, device=device.type,
                                      liger_available=liger_installed()), recipe.model.kernels)
    config = build_transformer_config(transformer_config_kwargs(
        model=recipe.model, train=recipe.train, layout=layout, device=device.type,
        kernels=kernels.impl))
    gpt_kwargs = gpt_model_kwargs(model=recipe.model, layout=layout)
    capability = _capability(device)  # what the experts' kernel and float8 GEMMs need
    experts = choose_experts(recipe.model, device=device.type,
                             precision=recipe.train.precision, capability=capability)
    chunks = build_model_chunks(config, gpt_kwargs, device, vocab_size=recipe.model.vocab_size,
                                kernels=kernels.impl, sdpa_backend=recipe.model.sdpa_backend,
                                experts=experts.impl if experts else "sequential",
                                documents=documents_for(recipe.data, device=device.type,
                                                        sdpa_backend=recipe.model.sdpa_backend))
    startup.mark("model")
    if recipe.model.init_from:
        init_from_hugging_face(chunks, folder=recipe.model.init_from, model=recipe.model,
                               padded_vocab=gpt_kwargs["vocab_size"])
    else:
        init_layout_invariant(chunks, seed=recipe.train.seed, std=recipe.model.init_std,
                              num_layers=recipe.model.num_layers,
                              vocab_size=recipe.model.vocab_size)
    startup.mark("weights")
    if recipe.train.fp8 != "none":  # before compiling, so compiled layers fuse the casts
        from dsforge.runtime.assemble.fp8 import device_check, float8_linears

        device_check(recipe.train.fp8, device, capability)
        float8_linears(chunks, recipe.train.fp8)
    if recipe.model.compile == "layers":  # after the weights: compiling changes no parameter
        from dsforge.runtime.assemble.compile import compile_layers

        compile_layers(chunks, selective=recipe.train.activation_checkpointing == "selective")
    container = ModelChunks(chunks)
    return container, attach_gradient_hooks(container), kernels, experts


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


class MegatronMPU:
    """The `mpu` interface DeepSpeed asks for, answered from megatron.core.parallel_state.

    DeepSpeed counts a replicated (non tensor-parallel) parameter's gradient norm only where
    the *tensor*-parallel rank is 0, then all-reduces over the model-parallel group; that group
    must span tp x pp so every pipeline stage's parameters are counted exactly once.
    """

    def __init__(self):
        from megatron.core import parallel_state

        self._ps = parallel_state

    # Data parallelism for DeepSpeed is Megatron's dp x cp group: the context-parallel ranks
    # hold one sequence's shards, so their gradients are summed with the replicas' and every
    # one is divided by dp x cp (each rank's loss is the mean over its shard, equal in size).
    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group(with_context_parallel=True)

    def get_data_parallel_rank(self):
        return self._ps.get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self):
        return self._ps.get_data_parallel_world_size(with_context_parallel=True)

    def get_model_parallel_group(self):
        return self._ps.get_model_parallel_group()

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank(group=self.get_model_parallel_group())

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size(group=self.get_model_parallel_group())

    def get_tensor_model_parallel_rank(self):
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self):
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()


class ModelChunks(nn.Module):
    """The rank's model chunks as one module for DeepSpeed; forward runs the only chunk."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def forward(self, *args, **kwargs):
        assert len(self.chunks) == 1, "forward() is for the unpipelined path"
        return self.chunks[0](*args, **kwargs)


def init_distributed(backend: str, timeout_s: float) -> None:
    """torch.distributed + DeepSpeed comm from the launcher's env (RANK, WORLD_SIZE, ...)."""
    import deepspeed

    timeout = datetime.timedelta(seconds=timeout_s)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=timeout,
                                             rank=int(os.environ["RANK"]),
                                             world_size=int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def init_parallel_state(parallel_kwargs: dict[str, Any], seed: int, timeout_s: float) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        **parallel_kwargs, distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        create_gloo_process_groups=False)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def attach_gradient_hooks(container: ModelChunks) -> bool:
    """Sequence-parallel gradients summed over TP; expert parameters registered for DeepSpeed.
    Returns whether the model has experts."""
    sum_sequence_parallel_grads(container)
    return register_experts(container)


def initialize_deepspeed(container: ModelChunks, ds_config: dict[str, Any], has_experts: bool,
                         lr_scheduler=None):
    """`lr_scheduler`: a schedule DeepSpeed's config cannot name (schedule.py), else None."""
    import deepspeed

    with deepspeed_sees_megatron_moe() if has_experts else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=container,
                                               model_parameters=list(container.parameters()),
                                               config=ds_config, mpu=MegatronMPU(),
                                               lr_scheduler=lr_scheduler)
    _guard_fp32_zero0_steps(engine, has_experts)
    _count_replicated_grads_once_per_stage(engine)
    start_schedule(engine.lr_scheduler)
    return engine


def start_schedule(scheduler) -> None:
    """Make step k run the schedule's iteration k. DeepSpeed's warmup schedulers set step 0's
    rate from iteration -1 (0.0, with or without a warmup), and the engine steps them after
    each optimizer step, so step 1 ran iteration 0, 0.0 again under a linear warmup: two steps
    at rate 0 (the first even with `warmup_steps: 0`, documented as starting at the peak) and
    the warmup's end one step late. Stepped once here, step k runs k / warmup_steps of the peak,
    as Megatron-LM's scheduler does. A resumed run then loads the iteration it saved."""
    if scheduler is not None:
        scheduler.step()


def _count_replicated_grads_once_per_stage(engine) -> None:
    """ZeRO-3 counts a replicated parameter's gradient in the norm only where
    `model_parallel_rank` is 0, and takes that rank from mpu.get_model_parallel_rank(): the rank
    in the tensor x pipeline group. Every pipeline stage but the first then leaves out its
    layer norms (measured, pp2: norm 1.649099 instead of 1.649160, and the clip coefficient
    follows). Stages 1 and 2 ask for the *tensor*-parallel rank, which is what is meant: a
    replicated parameter is a copy across tp, never across pp. (The mpu's own answer stays the
    tp x pp rank: DeepSpeed names its checkpoint files by it.)"""
    if engine.zero_optimization_stage() == 3 and engine.optimizer is not None:
        engine.optimizer.model_parallel_rank = MegatronMPU().get_tensor_model_parallel_rank()


def _guard_fp32_zero0_steps(engine, has_experts: bool) -> None:
    """fp32 at ZeRO 0 is the one configuration in which DeepSpeed steps the torch optimizer
    itself: its clip_grad_norm_ has a norm that is wrong with pipeline stages or experts (and is
    then dropped), and nothing checks that norm is finite (DeepSpeed's 16-bit and ZeRO
    optimizers skip such an update; runtime/guard/health.py). dsforge's norm is taken every
    step, clipping or not, and a non-finite one skips the update as those optimizers do: they
    set `overflow`, which the engine reads to count the skip and hold the schedule."""
    if engine.optimizer is None or engine.fp16_enabled() or engine.bfloat16_enabled() or \
            engine.zero_optimization():
        return
    from dsforge.runtime.assemble.grads import clip_to_norm_, global_grad_norm

    optimizer, step, max_norm = engine.optimizer, engine.optimizer.step, engine.gradient_clipping()

    def guarded_step(*args, **kwargs):
        params = list(engine.module.parameters())
        norm = global_grad_norm(params, has_experts).item()
        engine._global_grad_norm = norm
        optimizer.overflow = not math.isfinite(norm)
        if optimizer.overflow:
            return None
        if max_norm > 0:
            clip_to_norm_(params, max_norm, norm)
        return step(*args, **kwargs)

    optimizer.step = guarded_step
    engine.clip_fp32_gradients = lambda: None  # guarded_step clips
