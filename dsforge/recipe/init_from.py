"""`model.init_from`: is a Hugging Face folder the recipe's model? (rules I1-I5, no torch).

Checked by the recipe's validation, before any rank starts. Nothing here loads a weight:
config.json is JSON, and a safetensors file starts with an 8-byte little-endian header length
and a JSON header naming every tensor's dtype, shape and offsets, so the folder's tensors are
checked against the recipe's model from their headers alone.
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

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dsforge.problems import Problem

if TYPE_CHECKING:
    from dsforge.recipe.schema import ModelConfig

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
LLAMA_ARCH, MIXTRAL_ARCH = "LlamaForCausalLM", "MixtralForCausalLM"
FIELD = "model.init_from"
_FLOATS = {"F32", "F16", "BF16", "F64"}
_MAX_HEADER = 100 << 20  # bytes; safetensors itself refuses headers over 100 MB
# What transformers assumes for a field config.json leaves out (LlamaConfig / MixtralConfig
# defaults in transformers 4 and 5). Shape fields have no default here: they must be written.
_DEFAULTS = {
    LLAMA_ARCH: {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                 "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    MIXTRAL_ARCH: {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
                   "hidden_act": "silu"},
}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the folder, from its file's header."""

    file: str
    dtype: str
    shape: tuple[int, ...]


class FolderError(ValueError):
    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


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


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of `folder` (FolderError I1 when there is none that reads as an object)."""
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a directory"
        raise FolderError(_problem("I1", folder, f"{what}; model.init_from names a Hugging Face "
                                   "model folder (config.json and safetensors weights)",
                                   "give the path of such a folder (relative paths are read "
                                   "from the recipe's directory), or remove model.init_from"))
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FolderError(_problem("I1", folder, f"has no {CONFIG}, so it is not a Hugging Face "
                                   "model folder", "name the folder that holds config.json and "
                                   "the *.safetensors files")) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FolderError(_problem("I1", folder, f"its {CONFIG} cannot be read as JSON ({exc})",
                                   "use an intact model folder")) from None
    if not isinstance(config, dict):
        raise FolderError(_problem("I1", folder, f"its {CONFIG} is not a JSON object",
                                   "use an intact model folder"))
    return config


def architecture_of(config: dict[str, Any]) -> str | None:
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    return {"llama": LLAMA_ARCH, "mixtral": MIXTRAL_ARCH}.get(config.get("model_type"))


def _architecture(model: ModelConfig, arch: str | None, folder: Path) -> Iterator[Problem]:
    if arch not in (LLAMA_ARCH, MIXTRAL_ARCH):
        yield _problem("I2", folder, f"holds a {arch or 'model of no named architecture'}; "
                       f"dsforge starts from {LLAMA_ARCH} (dense) or {MIXTRAL_ARCH} (MoE) folders",
                       "use a Llama or Mixtral folder, or remove model.init_from")
    elif model.moe is None and arch == MIXTRAL_ARCH:
        yield _problem("I2", folder, f"holds a {MIXTRAL_ARCH} (MoE), the recipe's model is dense",
                       "add model.moe (num_experts, top_k, ffn_hidden_size from its config.json; "
                       "frequency: 1), or use a Llama folder")
    elif model.moe is not None and arch == LLAMA_ARCH:
        yield _problem("I2", folder, f"holds a {LLAMA_ARCH} (dense), the recipe's model is MoE",
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


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the folder's safetensors weights, from the headers (FolderError I5)."""
    index, single = folder / INDEX, folder / SINGLE
    if index.is_file():
        files = _weight_map(index, folder)
    elif single.is_file():
        files = None
    else:
        raise FolderError(_no_safetensors(folder))
    tensors: dict[str, Tensor] = {}
    for file in sorted(set(files.values())) if files is not None else [SINGLE]:
        for name, tensor in _header(folder / file, folder).items():
            if files is None or files.get(name) == file:
                tensors[name] = tensor
    if files is not None:
        absent = sorted(set(files) - set(tensors))
        if absent:
            raise FolderError(_problem("I5", folder, f"{INDEX} names {len(absent)} tensors its "
                                       f"files do not hold ({_some(absent)})",
                                       "use an intact model folder (download it again)"))
    return tensors


def _no_safetensors(folder: Path) -> Problem:
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles:
        return _problem(
            "I5", folder, f"holds PyTorch pickles ({_some(pickles)}) and no safetensors; dsforge "
            "reads safetensors only and never unpickles (loading a pickle can run code)",
            "convert the folder once, where you trust its files: python -c \"from transformers "
            "import AutoModelForCausalLM as M; M.from_pretrained('IN').save_pretrained('OUT')\" "
            "(writes safetensors), then set model.init_from: OUT")
    return _problem("I5", folder, f"holds no weights ({SINGLE}, or {INDEX} and its shards)",
                    "name the folder that holds the *.safetensors files")


def _weight_map(index: Path, folder: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        files = data["weight_map"]
        if not isinstance(files, dict) or not all(isinstance(f, str) for f in files.values()):
            raise ValueError("weight_map is not a mapping of tensor names to file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise FolderError(_problem("I5", folder, f"its {INDEX} cannot be read ({exc!r})",
                                   "use an intact model folder")) from None
    outside = sorted({f for f in files.values() if Path(f).name != f})
    if outside:
        raise FolderError(_problem("I5", folder, f"its {INDEX} names files outside the folder "
                                   f"({_some(outside)})", "use an intact model folder"))
    missing = sorted({f for f in files.values() if not (folder / f).is_file()})
    if missing:
        raise FolderError(_problem("I5", folder, f"its {INDEX} names files that are not there "
                                   f"({_some(missing)})",
                                   "download the missing shards, or use an intact folder"))
    return files


def _header(path: Path, folder: Path) -> dict[str, Tensor]:
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length).decode("utf-8"))
        return {name: Tensor(path.name, str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
                for name, entry in header.items() if name != "__metadata__"}
    except (OSError, struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError,
            AttributeError) as exc:
        raise FolderError(_problem("I5", folder, f"{path.name} is not a safetensors file "
                                   f"({type(exc).__name__}: {exc})",
                                   "use an intact model folder (download it again)")) from None


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
        found.append(_problem("I5", folder, f"its weights lack {len(missing)} tensors the "
                              f"recipe's model needs ({_some(missing)})",
                              "use a folder saved by transformers' save_pretrained (Mixtral "
                              "with the hub's block_sparse_moe names), or an intact one"))
    if wrong:
        found.append(_problem("I5", folder, f"its weights do not match its {CONFIG}: "
                              + "; ".join(wrong[:3]) + ("; ..." if len(wrong) > 3 else ""),
                              "use an intact model folder"))
    return found


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _problem(rule: str, folder: Path | str, message: str, fix: str) -> Problem:
    return Problem(rule=rule, fields={FIELD: str(folder)}, message=message, fix=fix)
