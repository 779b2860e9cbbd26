"""Build the GPT/MoE model chunks of this rank with Megatron-Core's GPTModel.

One chunk per virtual pipeline stage (vpp of them; 1 without interleaving). The layer spec is
Megatron-Core's local spec with dsforge's RMSNorm (sequence-parallel aware) and SDPA core
attention; MoE layers come from the same spec when the recipe has `model.moe`, their experts
Megatron's SequentialMLP or dsforge's grouped ones (grouped_moe.py, model.moe.experts). With
`kernels="liger"` the norms, every MLP's SwiGLU (dense, and each expert's) and the loss are
Liger Kernel's (runtime/assemble/kernels.py; the TransformerConfig has use_te_activation_func on,
translate/megatron.py). Every chunk with the output layer masks the vocabulary's padded logits
out of the loss (vocab.py). Packed documents (data.document_masking, reset_position_ids,
eod_mask_loss) choose the attention's kernel, rotate by the position ids and keep the loss per
token (documents.py).
"""

from __future__ import annotations

from typing import Any

import torch

from dsforge.runtime.assemble.documents import rotary_from_position_ids
from dsforge.runtime.assemble.layers import RMSNorm, SDPAttention, UlyssesAttention
from dsforge.runtime.assemble.vocab import masked_vocab_gpt_model
from dsforge.translate.kernels import NO_DOCUMENTS, Documents


def layer_spec(num_experts: int | None, kernels: str = "torch", sdpa_backend: str = "auto",
               cp: int = 1, experts: str = "sequential", local_dispatch: bool = False,
               document_kernel: str = "sdpa-mask"):
    """`experts`: "sequential" (Megatron's SequentialMLP) or "grouped" (grouped_moe.py);
    `local_dispatch`: no token leaves the rank (ep 1, etp 1), so grouped experts take dsforge's
    on-device token dispatch; `document_kernel`: the attention's kernel for packed documents
    (documents.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    if num_experts and experts == "grouped":
        _grouped_experts(spec.submodules.mlp, local_dispatch)
    spec.submodules.input_layernorm = norm_class(kernels)
    spec.submodules.pre_mlp_layernorm = norm_class(kernels)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=UlyssesAttention if cp > 1 else SDPAttention,
        params={"sdpa_backend": sdpa_backend, "document_kernel": document_kernel})
    if kernels == "liger":
        from dsforge.runtime.assemble.kernels import LigerSwiGLU

        for mlp in _mlp_submodules(spec.submodules.mlp):
            mlp.activation_func = LigerSwiGLU
    return spec


def _grouped_experts(moe_spec, local_dispatch: bool) -> None:
    from dsforge.runtime.assemble.grouped_moe import DeviceDispatchMoELayer, GroupedExperts

    moe_spec.submodules.experts.module = GroupedExperts
    if local_dispatch:
        moe_spec.module = DeviceDispatchMoELayer


def _mlp_submodules(mlp_spec) -> list:
    """The MLPSubmodules of a layer's MLP: the dense MLP's, or an MoE layer's experts' and
    shared experts'."""
    sub = mlp_spec.submodules
    if hasattr(sub, "experts"):
        return [s.submodules for s in (sub.experts, sub.shared_experts) if s is not None]
    return [sub]


def norm_class(kernels: str) -> type:
    if kernels == "liger":
        from dsforge.runtime.assemble.kernels import LigerRMSNorm

        return LigerRMSNorm
    return RMSNorm


def block_spec(config, vp_stage: int, pp_rank: int, kernels: str, sdpa_backend: str,
               experts: str = "sequential", document_kernel: str = "sdpa-mask"):
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    local_dispatch = config.expert_model_parallel_size == 1 and \
        (config.expert_tensor_parallel_size or 1) == 1
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(config.num_moe_experts, kernels, sdpa_backend,
                                config.context_parallel_size, experts, local_dispatch,
                                document_kernel)] * layers,
        layer_norm=norm_class(kernels))


def build_model_chunks(config, gpt_kwargs: dict[str, Any], device: torch.device, *,
                       vocab_size: int, kernels: str = "torch", sdpa_backend: str = "auto",
                       experts: str = "sequential", documents: Documents = NO_DOCUMENTS
                       ) -> list[torch.nn.Module]:
    """`gpt_kwargs` from translate/megatron.py (its vocab_size is Megatron's padded one);
    `vocab_size`: the recipe's, the only columns of the logits a loss sees (vocab.py);
    `documents`: how packed documents change the model (documents.py)."""
    from megatron.core import parallel_state as ps

    model_class = _gpt_model_class(kernels, fused_head=not documents.per_token_loss)
    if documents.position_ids:
        model_class = rotary_from_position_ids(model_class)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in range(vpp):
        chunk = model_class(
            config=config, transformer_layer_spec=block_spec(config, vp_stage, pp_rank, kernels,
                                                              sdpa_backend, experts,
                                                              documents.kernel),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, unpadded_vocab_size=vocab_size, **gpt_kwargs)
        chunks.append(chunk.to(device))
    return chunks


def _gpt_model_class(kernels: str, fused_head: bool = True) -> type:
    if kernels == "liger":
        from dsforge.runtime.assemble.kernels import liger_loss_gpt_model

        return liger_loss_gpt_model(fused_head)
    return masked_vocab_gpt_model()
