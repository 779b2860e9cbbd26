"""Build the GPT/MoE model chunks of this rank with Megatron-Core's GPTModel.

One chunk per virtual pipeline stage (vpp of them; 1 without interleaving). The layer spec is
Megatron-Core's local spec with dsforge's RMSNorm (sequence-parallel aware) and SDPA core
attention; MoE layers come from the same spec when the recipe has `model.moe`.
"""

from __future__ import annotations

from typing import Any

import torch

from dsforge.runtime.layers import RMSNorm, SDPAttention


def layer_spec(num_experts: int | None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def block_spec(config, vp_stage: int, pp_rank: int):
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(config.num_moe_experts)] * layers,
                                      layer_norm=RMSNorm)


def build_model_chunks(config, gpt_kwargs: dict[str, Any], device: torch.device) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in range(vpp):
        chunk = GPTModel(
            config=config, transformer_layer_spec=block_spec(config, vp_stage, pp_rank),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, **gpt_kwargs)
        chunks.append(chunk.to(device))
    return chunks
