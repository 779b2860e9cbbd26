"""What a Hugging Face folder can express of a dsforge model, and its config files (pure).

dsforge's model (schema/model.py ModelConfig) is a Llama block: RMSNorm, SwiGLU with silu,
rotary embeddings without scaling on all of each head, optional GQA, no QK norm; its
translation (translate/megatron.py) fixes those, so only these recipe fields can make a model
that Llama or Mixtral cannot hold (rules EX1-EX4):
- EX1: MoE with dense layers (moe.frequency > 1): Mixtral has experts in every layer;
- EX2: top-1 routing: dsforge weights the chosen expert by its softmax probability over all
  experts (translate/megatron.py, moe_router_pre_softmax), Mixtral renormalises the top-k
  weights to sum to 1, so with k = 1 the outputs would differ;
- EX3: biases in an MoE model: Mixtral's linear layers have none;
- EX4: a saved recipe this dsforge cannot read as a model.
Top-k >= 2 routing matches: Megatron's softmax over the k chosen logits equals Mixtral's
softmax over all experts followed by top-k and renormalisation. Every field of config.json is
written explicitly, so no transformers default decides what the model is.
"""

from __future__ import annotations

from typing import Any, Mapping

from dsforge.hf.names import LLAMA, architecture, model_config
from dsforge.problems import Problem
from dsforge.schema import ModelConfig

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export_problems(recipe: Mapping[str, Any]) -> list[Problem]:
    """Why the model of a saved recipe cannot be a Llama or Mixtral folder; empty when it can."""
    try:
        model = model_config(recipe)
    except Exception as exc:  # a recipe from another dsforge version: any field may be off
        first = str(exc).splitlines()[0] if str(exc) else ""
        return [Problem(rule="EX4", fields={"recipe.model": recipe.get("model")},
                        message=f"the checkpoint's recipe is not a model this dsforge knows "
                                f"({type(exc).__name__}: {first})",
                        fix="export it with the dsforge version that trained it")]
    if model.moe is None:
        return []
    moe, found = model.moe, []
    if moe.frequency > 1:
        dense = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
        found.append(Problem(
            rule="EX1", fields={"model.moe.frequency": moe.frequency},
            message=f"layers {_listed(dense)} are dense and the others MoE; Mixtral has experts "
                    "in every layer and Llama in none, so no Hugging Face architecture dsforge "
                    "writes holds this model",
            fix="export models with model.moe.frequency: 1 (every layer MoE) or without "
                "model.moe; this checkpoint cannot be exported"))
    if moe.top_k == 1:
        found.append(Problem(
            rule="EX2", fields={"model.moe.top_k": 1},
            message="dsforge scales the chosen expert by its softmax probability over all "
                    "experts; Mixtral renormalises the top-k weights to 1, so the exported model "
                    "would compute other outputs",
            fix="train with model.moe.top_k >= 2 to export to Mixtral; this checkpoint cannot "
                "be exported"))
    if model.bias:
        found.append(Problem(
            rule="EX3", fields={"model.bias": True, "model.moe.num_experts": moe.num_experts},
            message="Mixtral's linear layers have no biases, so this MoE model's biases have "
                    "no place in it",
            fix="train MoE models with model.bias: false to export them; this checkpoint "
                "cannot be exported"))
    return found


def exportable(recipe: Mapping[str, Any]) -> list[str]:
    """The reasons the model of a saved recipe cannot be exported (empty: it can)."""
    return [str(problem) for problem in export_problems(recipe)]


def _listed(layers: list[int]) -> str:
    return ", ".join(map(str, layers[:8])) + (f" and {len(layers) - 8} more" if len(layers) > 8 else "")


def hf_config(model: ModelConfig, *, dtype: str, bos_token_id: int | None = None,
              eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """config.json of `model` stored in `dtype` ("fp32" | "bf16" | "fp16")."""
    theta = float(model.rotary_base)
    config: dict[str, Any] = {
        "vocab_size": model.vocab_size,  # unpadded: Megatron's padding rows are not exported
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.query_groups,
        "head_dim": model.head_dim,  # kv_channels may differ from hidden_size / heads
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "initializer_range": model.init_std,
        "rms_norm_eps": model.norm_epsilon,  # transformers' Llama default is 1e-6, dsforge's 1e-5
        # transformers 4 reads rope_theta, 5 prefers rope_parameters; both say the same.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": TORCH_DTYPES[dtype],  # transformers 4's name
        "dtype": TORCH_DTYPES[dtype],  # transformers 5's
    }
    if architecture(model) == LLAMA:
        config.update({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "intermediate_size": model.ffn_hidden_size, "pretraining_tp": 1,
            "attention_bias": model.bias, "mlp_bias": model.bias,
        })
    else:
        moe = model.moe
        config.update({
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": moe.ffn_hidden_size,  # per expert
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None,
        })
    return dict(sorted(config.items()))


def generation_config(*, bos_token_id: int | None, eos_token_id: int | None,
                      pad_token_id: int | None = None) -> dict[str, Any]:
    """generation_config.json as transformers derives it from config.json."""
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    return {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
