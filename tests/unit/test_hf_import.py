"""model.init_from: a Hugging Face folder as the start of a recipe's model.

Tiny Llama and Mixtral folders are written by transformers itself (save_pretrained, fp32,
random weights); the recipe's model is checked against them (rules I1-I5, every shape field
one at a time), and the weights read as dsforge global tensors give the folder's tensors back
bitwise through the export map. The multi-rank check (loss equal to transformers', the round
trip through a tp2 and a pp2 run and `dsforge export`) is tests/distributed/test_hf_import.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsforge.hf.load import HFWeights
from dsforge.hf.names import to_hf
from dsforge.recipe import load_recipe, validate
from dsforge.schema import padded_vocab_size
from tests.conftest import make_recipe

VOCAB = 250  # padded to 256 by Megatron: the padding rows are exercised
DENSE = ("model.num_layers=2", f"model.vocab_size={VOCAB}", "model.kv_channels=8")
MOE = ("model.preset=tiny-moe", "model.num_layers=2", f"model.vocab_size={VOCAB}",
       "model.rotary_base=1000000")


def _save_llama(folder: Path, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, rms_norm_eps=1e-5, **overrides)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _save_mixtral(folder: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5)
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"llama": _save_llama(root / "llama"), "mixtral": _save_mixtral(root / "mixtral")}


@pytest.fixture
def llama(folders, tmp_path) -> Path:
    """A copy of the Llama folder that a test may change."""
    return Path(shutil.copytree(folders["llama"], tmp_path / "llama"))


def _problems(folder: Path, *overrides: str):
    return validate(make_recipe(*overrides, f"model.init_from={folder}"), None)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# ----------------------------------------------------------------------------- validation

def test_matching_folders_pass(folders):
    assert _problems(folders["llama"], *DENSE) == []
    assert _problems(folders["mixtral"], *MOE) == []


# (override, the field named, the folder's value written in the fix)
DENSE_MISMATCHES = [
    ("model.num_layers=3", "model.num_layers", "2"),
    ("model.hidden_size=128", "model.hidden_size", "64"),
    ("model.num_attention_heads=8", "model.num_attention_heads", "4"),
    ("model.num_kv_heads=4", "model.num_kv_heads", "2"),
    ("model.kv_channels=16", "model.kv_channels", "8"),
    ("model.ffn_hidden_size=128", "model.ffn_hidden_size", "176"),
    ("model.vocab_size=256", "model.vocab_size", "250"),
    ("model.norm_epsilon=1e-6", "model.norm_epsilon", "1e-05"),
    ("model.rotary_base=500000", "model.rotary_base", "10000"),
    ("model.tie_embeddings=true", "model.tie_embeddings", "false"),
    ("model.bias=true", "model.bias", "false"),
]
MOE_MISMATCHES = [
    ("model.moe.num_experts=8", "model.moe.num_experts", "4"),
    ("model.moe.top_k=3", "model.moe.top_k", "2"),
    ("model.moe.ffn_hidden_size=128", "model.moe.ffn_hidden_size", "96"),
    ("model.rotary_base=10000", "model.rotary_base", "1000000"),
]


@pytest.mark.parametrize("override, field, theirs", DENSE_MISMATCHES + MOE_MISMATCHES,
                         ids=[m[0] for m in DENSE_MISMATCHES + MOE_MISMATCHES])
def test_each_mismatched_field_is_named_with_both_values_and_the_fix(folders, override, field, theirs):
    moe = (override, field, theirs) in MOE_MISMATCHES
    base = MOE if moe else DENSE
    problems = _problems(folders["mixtral" if moe else "llama"], *base, override)
    assert len(problems) == 1, "\n".join(map(str, problems))
    (problem,) = problems
    ours = override.split("=", 1)[1]
    assert problem.rule == "I3" and field in problem.fields
    assert f": {theirs}, the recipe " in problem.message
    assert f"set {field}: {theirs}, or use a folder" in problem.fix
    assert ours.lower() in str(problem.fields[field]).lower() or field == "model.norm_epsilon"


def test_the_architecture_must_be_the_recipes(folders, llama):
    (dense_vs_mixtral,) = _problems(folders["mixtral"], *DENSE)
    assert dense_vs_mixtral.rule == "I2" and "add model.moe" in dense_vs_mixtral.fix
    (moe_vs_llama,) = _problems(folders["llama"], *MOE)
    assert moe_vs_llama.rule == "I2" and "remove model.moe" in moe_vs_llama.fix
    (dense_layers,) = _problems(folders["mixtral"], *MOE, "model.moe.frequency=2")
    assert dense_layers.rule == "I2" and dense_layers.fix == "set model.moe.frequency: 1"
    (biases,) = [p for p in _problems(folders["mixtral"], *MOE, "model.bias=true")
                 if p.rule.startswith("I")]  # E8 refuses biases without ep as well
    assert biases.rule == "I3" and biases.fix == "set model.bias: false"
    _edit_config(llama, architectures=["GPT2LMHeadModel"])
    (other,) = _problems(llama, *DENSE)
    assert other.rule == "I2" and "GPT2LMHeadModel" in other.message


def test_a_folder_that_is_not_there_or_not_a_model_folder(tmp_path, llama):
    file = tmp_path / "file"
    file.write_text("x")
    (llama / "config.json").write_text("{not json")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {tmp_path / "absent": "does not exist", file: "is not a directory",
             empty: "has no config.json", llama: "cannot be read as JSON"}
    for folder, words in cases.items():
        (problem,) = _problems(folder, *DENSE)
        assert problem.rule == "I1" and words in problem.message, str(problem)
        assert problem.fields == {"model.init_from": str(folder)}


@pytest.mark.parametrize("changes, words", [
    ({"hidden_act": "gelu"}, "hidden_act gelu"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},
     "rope scaling of type llama3"),
    ({"mlp_bias": True}, "biases in attention but not in the MLP"),
    ({"sliding_window": 16}, "sliding-window attention over 16 tokens"),
])
def test_what_dsforge_does_not_compute_is_refused(llama, changes, words):
    _edit_config(llama, **changes)
    problems = _problems(llama, *DENSE)
    assert [p.rule for p in problems] == ["I4"], "\n".join(map(str, problems))
    assert words in problems[0].message


def test_transformers_4_config_fields_are_read(llama):
    """rope_theta at the top level (transformers 4), defaults for what is left out."""
    config = json.loads((llama / "config.json").read_text())
    del config["rope_parameters"], config["rms_norm_eps"], config["tie_word_embeddings"]
    config["rope_theta"] = 500000.0
    (llama / "config.json").write_text(json.dumps(config))
    problems = _problems(llama, *DENSE, "model.rotary_base=500000")
    assert [(p.rule, *p.fields) for p in problems] == [("I3", "model.norm_epsilon", "model.init_from")]
    assert "rms_norm_eps: 1e-06" in problems[0].message  # transformers' Llama default


def test_pickled_weights_are_refused_with_how_to_convert(llama):
    (llama / "model.safetensors").rename(llama / "pytorch_model.bin")
    (problem,) = _problems(llama, *DENSE)
    assert problem.rule == "I5" and "never unpickles" in problem.message
    assert "save_pretrained('OUT')" in problem.fix and "model.init_from: OUT" in problem.fix
    (llama / "pytorch_model.bin").unlink()
    (problem,) = _problems(llama, *DENSE)
    assert problem.rule == "I5" and "holds no weights" in problem.message


def test_missing_and_misshapen_tensors_are_named(llama):
    path = llama / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, str(path))
    problems = _problems(llama, *DENSE)
    assert [p.rule for p in problems] == ["I5", "I5"]
    assert "lack 1 tensors" in problems[0].message
    assert "model.layers.1.mlp.up_proj.weight" in problems[0].message
    assert "model.norm.weight is F32 [32], the recipe's model needs [64]" in problems[1].message
    path.write_bytes(b"\x10\x00")
    (problem,) = _problems(llama, *DENSE)
    assert problem.rule == "I5" and "is not a safetensors file" in problem.message


def test_a_sharded_folder_with_a_missing_shard(folders, tmp_path):
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(folders["llama"]).save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").exists()
    assert _problems(sharded, *DENSE) == []
    shards[-1].unlink()
    (problem,) = _problems(sharded, *DENSE)
    assert problem.rule == "I5" and shards[-1].name in problem.message


def test_a_relative_init_from_is_read_from_the_recipes_directory(folders, tmp_path):
    shutil.copytree(folders["llama"], tmp_path / "models" / "llama")
    (tmp_path / "r.yaml").write_text(
        "model: {preset: tiny, num_layers: 2, vocab_size: 250, kv_channels: 8, "
        "init_from: models/llama}\n"
        "train: {seq_len: 64, global_batch: 8, micro_batch: 1, steps: 2, lr: 1.0e-3}\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    assert recipe.model.init_from == str(tmp_path / "models" / "llama")
    assert validate(recipe, None) == []


# ----------------------------------------------------------------------------- reading

@pytest.mark.parametrize("name, overrides", [("llama", DENSE), ("mixtral", MOE)])
def test_folder_to_global_tensors_to_export_gives_the_folder_back_bitwise(folders, name, overrides):
    model = make_recipe(*overrides).model
    padded = padded_vocab_size(model.vocab_size, 2)  # tp2's padding: 250 -> 256
    with safe_open(str(folders[name] / "model.safetensors"), "pt") as f:
        original = {key: f.get_tensor(key) for key in f.keys()}
    with HFWeights(folders[name], model, padded) as weights:
        full = {n: weights.full(n) for n in weights.names()}
    embedding = full["embedding.word_embeddings.weight"]
    assert embedding.shape == (256, 64) and not embedding[VOCAB:].any()  # padding rows: zeros
    exported = {piece.hf_name: tensor for piece, tensor in to_hf(model, padded, full.__getitem__)}
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


def test_a_global_tensor_reads_only_its_own_pieces(folders, monkeypatch):
    model = make_recipe(*DENSE).model
    read = []
    weights = HFWeights(folders["llama"], model, 256)
    original = weights.read_tensor
    monkeypatch.setattr(weights, "read_tensor", lambda n: read.append(n) or original(n))
    with weights:
        qkv = weights.full("decoder.layers.1.self_attention.linear_qkv.weight")
    assert qkv.shape == ((4 + 2 * 2) * 8, 64)
    assert sorted(read) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"]


def test_the_tiny_run_of_such_a_recipe_draws_its_tiny_model(folders):
    from dsforge.recipe.tiny import tiny_model

    model = make_recipe(*DENSE, f"model.init_from={folders['llama']}").model
    assert tiny_model(model, tp=2, etp=2, pp=1, vpp=1).init_from is None
