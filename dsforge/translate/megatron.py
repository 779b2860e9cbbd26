"""Recipe -> Megatron-Core keyword arguments (pure, JSON-serialisable).

Three dicts: `initialize_model_parallel(**parallel_state_kwargs)`,
`TransformerConfig(**build(transformer_config_kwargs))` and `GPTModel(config, spec,
**gpt_model_kwargs)`. Callables and dtypes appear by name so `dsforge plan --json` can print
them; `build_transformer_config` turns the names into objects. The TransformerConfig depends on
the ranks' device ("cpu" | "cuda"): the CPU-only settings are decided here, not in the runtime.
"""

from __future__ import annotations

from typing import Any

from dsforge.recipe.resolve import Layout
from dsforge.schema import ModelConfig, TrainConfig, padded_vocab_size
from dsforge.translate.device import check_device

# Megatron-Core's rank order: tp varies fastest, so TP groups are consecutive ranks (inside a
# node when tp <= GPUs per node), and pp slowest, so pipeline stages span nodes.
RANK_ORDER = "tp-cp-ep-dp-pp"

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parallel_state_kwargs(layout: Layout) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
        "context_parallel_size": layout.cp,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
        "order": RANK_ORDER,
    }


def transformer_config_kwargs(*, model: ModelConfig, train: TrainConfig, layout: Layout,
                              device: str, kernels: str = "torch") -> dict[str, Any]:
    """TransformerConfig's keyword arguments for ranks on `device` ("cpu" | "cuda") running
    `kernels` ("torch" | "liger", translate/kernels.py)."""
    check_device(device)
    dtype = _DTYPES[train.precision]
    kwargs: dict[str, Any] = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.query_groups,
        "kv_channels": model.head_dim,
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
        "context_parallel_size": layout.cp,
        "sequence_parallel": layout.sequence_parallel,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
        # Llama-style block.
        "normalization": "RMSNorm",
        "layernorm_epsilon": model.norm_epsilon,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": model.bias,
        "add_qkv_bias": model.bias,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": model.init_std,
        # Precision; pipeline_dtype is what stages exchange (rule L5 needs one when pp > 1).
        "bf16": train.precision == "bf16",
        "fp16": train.precision == "fp16",
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        # Megatron initialises the weights on the CPU for CPU ranks (else on the current GPU).
        # Its init must run either way: it marks tensor-parallel parameters (tensor_model_parallel,
        # partition_dim), which DeepSpeed's gradient norm and runtime/assemble/init.py rely on; init.py
        # then overwrites the values layout-invariantly.
        "use_cpu_initialization": device == "cpu",
        # CPU (gloo) pairs same-tag point-to-point messages by posting order, and with pp = 2
        # the next and previous stage are the same peer: batched p2p in interleaved 1F1B then
        # swaps tensors of equal shape silently. The unbatched path orders sends and receives
        # by rank parity.
        "batch_p2p_comm": device != "cpu",
        # The MLP hands its activation module the whole fc1 output (gate and up): the slot
        # runtime/assemble/kernels.py's LigerSwiGLU fills. Megatron names it for Transformer Engine,
        # but any module taking the config fits it.
        "use_te_activation_func": kernels == "liger",
    }
    kwargs.update(_recompute_kwargs(train.activation_checkpointing))
    if model.moe is not None:
        kwargs.update({
            "num_moe_experts": model.moe.num_experts,
            "moe_router_topk": model.moe.top_k,
            # top_k >= 2: softmax over the k chosen logits (Mixtral). top_k 1: that weight would
            # always be 1.0 and the router would get no gradient from the loss, so Megatron
            # refuses it; softmax over all experts first, the chosen expert's probability
            # scaling its output (Switch Transformer).
            "moe_router_pre_softmax": model.moe.top_k == 1,
            "moe_ffn_hidden_size": model.moe.ffn_hidden_size,
            "moe_layer_freq": model.moe.frequency,
            "moe_aux_loss_coeff": model.moe.aux_loss_coeff,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_token_dispatcher_type": "alltoall",
        })
    return kwargs


def _recompute_kwargs(checkpointing: str) -> dict[str, Any]:
    if checkpointing == "full":
        # Every layer recomputed from its input, one layer per checkpoint.
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    if checkpointing == "selective":
        return {"recompute_granularity": "selective"}  # the attention core (Megatron default)
    return {}


def gpt_model_kwargs(*, model: ModelConfig, layout: Layout) -> dict[str, Any]:
    return {
        "vocab_size": padded_vocab_size(model.vocab_size, layout.tp),
        "max_sequence_length": model.max_seq_len,
        "position_embedding_type": "rope",
        "rotary_base": model.rotary_base,
        "share_embeddings_and_output_weights": model.tie_embeddings,
        "parallel_output": True,
    }


def build_transformer_config(kwargs: dict[str, Any]):
    """A Megatron-Core TransformerConfig from `transformer_config_kwargs` output."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    objects = dict(kwargs)
    objects["activation_func"] = {"silu": F.silu, "gelu": F.gelu}[kwargs["activation_func"]]
    for key in ("params_dtype", "pipeline_dtype"):
        objects[key] = getattr(torch, kwargs[key])
    return TransformerConfig(**objects)
