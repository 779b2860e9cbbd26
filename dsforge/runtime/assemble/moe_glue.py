"""Make DeepSpeed reduce Megatron-Core's expert gradients over the expert-data-parallel group.

With expert parallelism, ranks of one data-parallel group hold *different* experts, so an
expert's gradient must be reduced only over the ranks that hold the same expert (Megatron's
expert-data-parallel group). DeepSpeed knows how to do that for its own MoE layers: it keys
expert parameters by `param.group_name` into `deepspeed.utils.groups`' expert group tables.
dsforge fills those tables with Megatron-Core's groups, names Megatron's expert parameters
(which Megatron marks `allreduce=False`), and lets DeepSpeed treat Megatron's MoELayer as an
MoE layer while the engine is built.
"""

from __future__ import annotations

import contextlib

import torch


def expert_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if not getattr(p, "allreduce", True)]


def register_experts(module: torch.nn.Module) -> bool:
    """Name expert parameters and register their groups with DeepSpeed; False if none."""
    from deepspeed.utils import groups
    from megatron.core import parallel_state as ps

    experts = expert_parameters(module)
    if not experts:
        return False
    # DeepSpeed parses the expert-parallel size out of names of this form.
    name = f"ep_size_{ps.get_expert_model_parallel_world_size()}"
    ep_group, edp_group = ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group()
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = torch.distributed.get_process_group_ranks(ep_group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = torch.distributed.get_process_group_ranks(edp_group)
    for param in experts:
        param.group_name = name
    for layer in _moe_layers(module):
        layer.num_experts = layer.config.num_moe_experts  # DeepSpeed reads it
    return True


def _moe_layers(module: torch.nn.Module):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in module.modules() if isinstance(m, MoELayer)]


@contextlib.contextmanager
def deepspeed_sees_megatron_moe():
    """While building the engine, DeepSpeed's MoE check (`isinstance(m, MoE)`) also accepts
    Megatron-Core's MoELayer, which switches on its expert-group gradient handling."""
    import deepspeed.runtime.engine as ds_engine
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = ds_engine.MoE
    ds_engine.MoE = (original, MoELayer)
    try:
        yield
    finally:
        ds_engine.MoE = original
