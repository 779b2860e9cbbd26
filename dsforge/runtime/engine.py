"""Glue between Megatron-Core's parallel state and DeepSpeed's engine.

Order of application, inside a rank (each step needs the previous one):
  1. torch.distributed and DeepSpeed's comm layer on the chosen backend (nccl / gloo);
  2. Megatron-Core parallel state from the translated kwargs, model-parallel RNG seeded;
  3. model chunks built (one per virtual stage) and initialised layout-invariantly;
  4. gradient hooks for sequence-parallel parameters, expert parameters named for DeepSpeed
     (grads.py, moe_glue.py);
  5. deepspeed.initialize on a container of the chunks, with `MegatronMPU` so DeepSpeed
     reduces gradients over Megatron's data-parallel group and computes the gradient norm
     over the tensor x pipeline group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any

import torch
from torch import nn


class MegatronMPU:
    """The `mpu` interface DeepSpeed asks for, answered from megatron.core.parallel_state.

    DeepSpeed counts a replicated (non tensor-parallel) parameter's gradient norm only where
    the *tensor*-parallel rank is 0, then all-reduces over the model-parallel group; that group
    must span tp x pp so every pipeline stage's parameters are counted exactly once.
    """

    def __init__(self):
        from megatron.core import parallel_state

        self._ps = parallel_state

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()

    def get_data_parallel_rank(self):
        return self._ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return self._ps.get_data_parallel_world_size()

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


def wrap_with_deepspeed(chunks: list[nn.Module], ds_config: dict[str, Any]):
    import deepspeed

    from dsforge.runtime.grads import sum_sequence_parallel_grads
    from dsforge.runtime.moe_glue import deepspeed_sees_megatron_moe, register_experts

    container = ModelChunks(chunks)
    sum_sequence_parallel_grads(container)
    has_experts = register_experts(container)
    with deepspeed_sees_megatron_moe() if has_experts else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=container,
                                               model_parameters=list(container.parameters()),
                                               config=ds_config, mpu=MegatronMPU())
    _clip_fp32_with_a_correct_norm(engine, has_experts)
    return engine


def _clip_fp32_with_a_correct_norm(engine, has_experts: bool) -> None:
    """ZeRO 0 in fp32 clips with DeepSpeed's clip_grad_norm_, whose norm is wrong with
    pipeline stages or experts and is then dropped; use dsforge's norm and keep it."""
    from dsforge.runtime.grads import clip_grads_

    def clip_and_record():
        engine._global_grad_norm = clip_grads_(engine.module.parameters(),
                                               engine.gradient_clipping(), has_experts)

    engine.clip_fp32_gradients = clip_and_record
