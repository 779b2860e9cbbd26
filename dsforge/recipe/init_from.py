"""`model.init_from`: is a Hugging Face folder the recipe's model? (rules I1-I5, no torch).

Checked by the recipe's validation, before any rank starts. Nothing here loads a weight: the
folder's config.json and tensors are read from their headers alone (hf/folder.py).
- I1: the folder exists and holds a config.json that is a JSON object;
- I2: its architecture is the recipe's: LlamaForCausalLM for a dense model, MixtralForCausalLM
  for a model whose every layer is MoE (Mixtral has experts in every layer and no biases);
- I3: every shape field of config.json equals the recipe's (hidden size, layers, heads, query
  groups, head dim, ffn size, vocabulary, experts, top-k, norm eps, rope theta, tied
  embeddings, biases): one problem per field, with both values;
- I4: config.json asks for something dsforge's model does not compute (another activation,
  rope scaling, a sliding window shorter than the sequence, biases in attention but not in
  the MLP, a fractional rope theta, Mixtral top-1 routing): no recipe can match it;
- I5: the weights are safetensors (PyTorch pickles are refused: dsforge does not unpickle)
  and hold every tensor the recipe's model needs with its shape.
The name map itself is hf/names.py; reading the tensors is hf/load.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dsforge.hf.folder import (CONFIG, FIELD, LLAMA_ARCH, MIXTRAL_ARCH, FolderError, Tensor,
                               architecture_of, folder_problem, read_config, read_tensors,
                               some_names)
from dsforge.problems import Problem

if TYPE_CHECKING:
    from dsforge.schema import ModelConfig

_FLOATS = {"F32", "F16", "BF16", "F64"}
# What transformers assumes for a field config.json leaves out (LlamaConfig / MixtralConfig
# defaults in transformers 4 and 5). Shape fields have no default here: they must be written.
_DEFAULTS = {
    LLAMA_ARCH: {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                 "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    MIXTRAL_ARCH: {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
                   "hidden_act": "silu"},
}


def init_from_problems(model: ModelConfig) -> list[Problem]:
    """Every reason `model.init_from` cannot start `model` (empty: it can, or it is not set)."""
    if model.init_from is None:
        return []
    folder = Path(model.init_from)
    try:
        config = read_config(folder)
    except FolderError as exc:
        return [exc.problem]
    arch = architecture_of(config)
    wrong_arch = list(_architecture(model, arch, folder))
    if wrong_arch:
        return wrong_arch
    found = list(_fields(model, config, arch)) + list(_unsupported(model, config, arch))
    try:
        tensors = read_tensors(folder)
    except FolderError as exc:
        return found + [exc.problem]
    if not found:
        found += _tensor_problems(model, tensors, folder)
    return found


def _architecture(model: ModelConfig, arch: str | None, folder: Path) -> Iterator[Problem]:
    if arch not in (LLAMA_ARCH, MIXTRAL_ARCH):
        yield folder_problem("I2", folder, f"holds a {arch or 'model of no named architecture'}; "
                       f"dsforge starts from {LLAMA_ARCH} (dense) or {MIXTRAL_ARCH} (MoE) folders",
                       "use a Llama or Mixtral folder, or remove model.init_from")
    elif model.moe is None and arch == MIXTRAL_ARCH:
        yield folder_problem("I2", folder, f"holds a {MIXTRAL_ARCH} (MoE), the recipe's model is dense",
                       "add model.moe (num_experts, top_k, ffn_hidden_size from its config.json; "
                       "frequency: 1), or use a Llama folder")
    elif model.moe is not None and arch == LLAMA_ARCH:
        yield folder_problem("I2", folder, f"holds a {LLAMA_ARCH} (dense), the recipe's model is MoE",
                       "remove model.moe, or use a Mixtral folder")
    elif model.moe is not None and model.moe.frequency != 1:
        yield Problem(rule="I2", fields={FIELD: str(folder), "model.moe.frequency": model.moe.frequency},
                      message=f"every layer of a {MIXTRAL_ARCH} is MoE, the recipe's model has "
                              "dense layers between its MoE layers",
                      fix="set model.moe.frequency: 1")


def _fields(model: ModelConfig, config: dict[str, Any], arch: str) -> Iterator[Problem]:
    """I3: each shape field of config.json against the recipe's."""
    moe = arch == MIXTRAL_ARCH
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    groups = config.get("num_key_value_heads") or heads  # transformers: null means no GQA
    head_dim = config.get("head_dim")
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads  # transformers' default
    theta = _rope_theta(config, arch)
    pairs = [
        ("hidden_size", hidden, "model.hidden_size", model.hidden_size),
        ("num_hidden_layers", config.get("num_hidden_layers"), "model.num_layers", model.num_layers),
        ("num_attention_heads", heads, "model.num_attention_heads", model.num_attention_heads),
        ("num_key_value_heads", groups, "model.num_kv_heads", model.query_groups),
        ("head_dim", head_dim, "model.kv_channels", model.head_dim),
        ("vocab_size", config.get("vocab_size"), "model.vocab_size", model.vocab_size),
        ("rms_norm_eps", _get(config, arch, "rms_norm_eps"), "model.norm_epsilon", model.norm_epsilon),
        ("rope_theta", theta, "model.rotary_base", model.rotary_base),
        ("tie_word_embeddings", _get(config, arch, "tie_word_embeddings"), "model.tie_embeddings",
         model.tie_embeddings),
    ]
    if moe:
        pairs += [
            ("intermediate_size", config.get("intermediate_size"), "model.moe.ffn_hidden_size",
             model.moe.ffn_hidden_size),
            ("num_local_experts", config.get("num_local_experts"), "model.moe.num_experts",
             model.moe.num_experts),
            ("num_experts_per_tok", config.get("num_experts_per_tok"), "model.moe.top_k",
             model.moe.top_k),
        ]
        if model.bias:
            yield Problem(rule="I3", fields={"model.bias": True, FIELD: model.init_from},
                          message=f"a {MIXTRAL_ARCH}'s linear layers have no biases",
                          fix="set model.bias: false")
    else:
        pairs += [
            ("intermediate_size", config.get("intermediate_size"), "model.ffn_hidden_size",
             model.ffn_hidden_size),
            ("attention_bias", _get(config, arch, "attention_bias"), "model.bias", model.bias),
        ]
    for key, theirs, field, ours in pairs:
        problem = _compare(key, theirs, field, ours, model.init_from)
        if problem:
            yield problem


def _compare(key: str, theirs: Any, field: str, ours: Any, folder: str) -> Problem | None:
    if theirs is None:
        return Problem(rule="I3", fields={FIELD: folder},
                       message=f"its {CONFIG} does not say {key}, so the folder's model is not "
                               "known", fix=f"use a folder whose {CONFIG} writes {key}")
    if _same(theirs, ours):
        return None
    written = _yaml(theirs)
    return Problem(rule="I3", fields={field: ours, FIELD: folder},
                   message=f"the folder's {CONFIG} says {key}: {written}, the recipe {_yaml(ours)}",
                   fix=f"set {field}: {written}, or use a folder whose {CONFIG} says {key}: "
                       f"{_yaml(ours)}")


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return theirs is ours
    if isinstance(ours, float) or isinstance(theirs, float):
        return isinstance(theirs, (int, float)) and math.isclose(theirs, ours, rel_tol=1e-9)
    return theirs == ours


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _get(config: dict[str, Any], arch: str, key: str) -> Any:
    return config.get(key, _DEFAULTS[arch].get(key))


def _rope_theta(config: dict[str, Any], arch: str) -> Any:
    """transformers 5 writes rope_parameters.rope_theta, 4 rope_theta."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return parameters["rope_theta"]
    return _get(config, arch, "rope_theta")


def _rope_type(config: dict[str, Any]) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type", "default"))
            if kind != "default":
                return str(kind)
    return "default"


def _unsupported(model: ModelConfig, config: dict[str, Any], arch: str) -> Iterator[Problem]:
    """I4: what config.json asks for that dsforge's model does not compute."""
    folder = model.init_from
    found = []
    act = _get(config, arch, "hidden_act")
    if act != "silu":
        found.append(f"hidden_act {act} (dsforge's MLP is SwiGLU with silu)")
    kind = _rope_type(config)
    if kind != "default":
        found.append(f"rope scaling of type {kind} (dsforge's rotary embeddings are unscaled)")
    theta = _rope_theta(config, arch)
    if isinstance(theta, (int, float)) and not float(theta).is_integer():
        found.append(f"rope theta {theta} (model.rotary_base is a whole number)")
    window = config.get("sliding_window")
    if isinstance(window, int) and window < model.max_seq_len:
        found.append(f"sliding-window attention over {window} tokens, shorter than "
                     f"model.max_seq_len {model.max_seq_len} (dsforge attends to the whole "
                     "sequence)")
    if arch == LLAMA_ARCH and _get(config, arch, "attention_bias") != _get(config, arch, "mlp_bias"):
        found.append("biases in attention but not in the MLP, or the reverse (model.bias puts "
                     "them in every linear layer or none)")
    if arch == MIXTRAL_ARCH and config.get("num_experts_per_tok") == 1:
        found.append("top-1 routing (Mixtral weights the chosen expert by 1, dsforge by its "
                     "softmax probability)")
    for what in found:
        yield Problem(rule="I4", fields={FIELD: folder},
                      message=f"its {CONFIG} asks for {what}; no recipe computes that model",
                      fix="use a folder of a model dsforge computes, or remove model.init_from")


def _tensor_problems(model: ModelConfig, tensors: dict[str, Tensor], folder: Path) -> list[Problem]:
    """I5: the tensors the name map needs, each present, floating point and of its shape."""
    from dsforge.hf.names import pieces  # torch: imported only for recipes with init_from

    missing, wrong = [], []
    for piece in pieces(model, model.vocab_size):
        tensor = tensors.get(piece.hf_name)
        if tensor is None:
            missing.append(piece.hf_name)
        elif tensor.shape != piece.shape or tensor.dtype not in _FLOATS:
            wrong.append(f"{piece.hf_name} is {tensor.dtype} {list(tensor.shape)}, the recipe's "
                         f"model needs {list(piece.shape)}")
    found = []
    if missing:
        found.append(folder_problem("I5", folder, f"its weights lack {len(missing)} tensors the "
                              f"recipe's model needs ({some_names(missing)})",
                              "use a folder saved by transformers' save_pretrained (Mixtral "
                              "with the hub's block_sparse_moe names), or an intact one"))
    if wrong:
        found.append(folder_problem("I5", folder, f"its weights do not match its {CONFIG}: "
                              + "; ".join(wrong[:3]) + ("; ..." if len(wrong) > 3 else ""),
                              "use an intact model folder"))
    return found


