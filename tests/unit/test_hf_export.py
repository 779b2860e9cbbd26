"""dsforge export: the Megatron -> Hugging Face name map, config.json, the streaming shard
writer, every refusal, and the real check: dsforge's own model and the exported folder loaded
by transformers give the same logits (fp32, tiny dense Llama and all-MoE top-2 Mixtral).

dsforge's models are built in one child interpreter (`python -m tests.unit.test_hf_export
FOLDER`, with tests/hf_check.py: the CPU backend patches the whole process, and Megatron-Core's
import is seconds pytest's process does not need), which saves each model's global tensors,
recipe and logits; a fake reader serves those tensors to export. The same check through real
checkpoints (train, resume on another layout, export) is tests/distributed/test_checkpoint_path.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dsforge.cli import main
from dsforge.hf import names as hfnames
from dsforge.hf.config import export_problems, exportable, hf_config
from dsforge.hf.export import ExportRefused, export
from dsforge.hf.names import from_hf, global_shapes, model_config, pieces, to_hf
from dsforge.hf.shards import Entry, parse_size, plan_shards, write_shards
from dsforge.recipe import Topology, resolve
from dsforge.schema import padded_vocab_size
from tests.conftest import EOD, REPO, make_recipe
from tests.hf_check import TOLERANCE, transformers_logits

# The models the child builds: (name, overrides). Two layers each; vocabulary 250 is padded to
# 256 by Megatron, so the strip is exercised; the dense model has a head dim (8) other than
# hidden / heads (16) and GQA (4 heads, 2 groups).
MODELS = {
    "dense": ("model.num_layers=2", "model.vocab_size=250", "model.kv_channels=8"),
    "dense_bias_tied": ("model.num_layers=2", "model.vocab_size=250", "model.bias=true",
                        "model.tie_embeddings=true", "model.rotary_base=500000",
                        "model.norm_epsilon=1e-6"),
    "moe": ("model.preset=tiny-moe", "model.num_layers=2", "model.vocab_size=250"),
}


def _resolved(overrides: tuple[str, ...]):
    return resolve(make_recipe("parallel.dp=1", *overrides), Topology(world_size=1))


def _recipe_dict(overrides: tuple[str, ...]) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(_resolved(overrides).recipe)))


# ----------------------------------------------------------------------------- fakes

class FakeReader:
    """The layout-free reader's interface over a dict of global tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], recipe: dict, padded: int,
                 fp32: dict[str, torch.Tensor] | None = None):
        self.recipe, self.padded_vocab_size = recipe, padded
        self._states = {"param": tensors, **({"fp32": fp32} if fp32 is not None else {})}

    def names(self) -> list[str]:
        return list(self._states["param"])

    def has_state(self, state: str) -> bool:
        return state in self._states

    def full(self, name: str, state: str = "param") -> torch.Tensor:
        return self._states[state][name]


def _random_state(recipe: dict, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    model = model_config(recipe)
    padded = padded_vocab_size(model.vocab_size, 1)
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype)
            for name, shape in global_shapes(model, padded).items()}


def _checkpoint(run_dir: Path, recipe: dict, *, step: int = 4, layout_free: bool = True) -> Path:
    """RUN_DIR/checkpoints/stepNNNNNNNN as checkpoint.save publishes it: files, then the
    completion marker listing them with their sizes, then latest."""
    root = run_dir / "checkpoints"
    tag = f"step{step:08d}"
    directory = root / tag
    directory.mkdir(parents=True)
    (directory / "mp_rank_00_model_states.pt").write_bytes(b"x" * 64)
    (directory / "dsforge_rng_rank00000.pt").write_bytes(b"r" * 32)
    if layout_free:
        (directory / "dsforge_state").mkdir()
        (directory / "dsforge_state" / "rank00000.safetensors").write_bytes(b"p" * 128)
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / "dsforge_complete.json").write_text(json.dumps(
        {"step": step, "tag": tag, "world_size": 1, "recipe": recipe, "files": files}))
    (root / "latest").write_text(tag)
    return directory


def _opener(reader: FakeReader):
    return lambda checkpoint: reader


# ----------------------------------------------------------------------------- the name map

def test_qkv_split_matches_a_per_head_construction():
    """linear_qkv rows are, per query group, [its q heads; k; v]: q_proj must be the query
    heads in head order, k_proj and v_proj the groups' k and v."""
    recipe = _recipe_dict(MODELS["dense"])
    model = model_config(recipe)
    nq, ng, d, h = model.num_attention_heads, model.query_groups, model.head_dim, model.hidden_size
    q = [torch.randn(d, h) for _ in range(nq)]
    k, v = [torch.randn(d, h) for _ in range(ng)], [torch.randn(d, h) for _ in range(ng)]
    per = nq // ng
    qkv = torch.cat([t for g in range(ng) for t in (*q[g * per:(g + 1) * per], k[g], v[g])])
    qkv_name = "decoder.layers.0.self_attention.linear_qkv.weight"
    by_part = {p.part: p for p in pieces(model, 256) if p.source == qkv_name}
    assert torch.equal(hfnames.take(model, by_part["q"], qkv), torch.cat(q))
    assert torch.equal(hfnames.take(model, by_part["k"], qkv), torch.cat(k))
    assert torch.equal(hfnames.take(model, by_part["v"], qkv), torch.cat(v))


def test_fc1_splits_into_gate_and_up_and_the_vocabulary_padding_is_dropped():
    recipe = _recipe_dict(MODELS["dense"])
    model = model_config(recipe)
    state = _random_state(recipe)
    out = dict((p.hf_name, t) for p, t in to_hf(model, 256, state.__getitem__))
    fc1, ffn = state["decoder.layers.1.mlp.linear_fc1.weight"], model.ffn_hidden_size
    assert torch.equal(out["model.layers.1.mlp.gate_proj.weight"], fc1[:ffn])
    assert torch.equal(out["model.layers.1.mlp.up_proj.weight"], fc1[ffn:])
    assert torch.equal(out["model.layers.1.mlp.down_proj.weight"],
                       state["decoder.layers.1.mlp.linear_fc2.weight"])
    assert out["model.embed_tokens.weight"].shape == (250, model.hidden_size)
    assert torch.equal(out["lm_head.weight"], state["output_layer.weight"][:250])


@pytest.mark.parametrize("name", list(MODELS))
def test_to_hf_then_from_hf_gives_the_tensors_back_bitwise(name):
    recipe = _recipe_dict(MODELS[name])
    model = model_config(recipe)
    state = _random_state(recipe, dtype=torch.bfloat16)
    for vocab_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if vocab_name in state:
            state[vocab_name][model.vocab_size:] = 0  # padding rows come back as zeros
    hf = {p.hf_name: t.clone() for p, t in to_hf(model, 256, state.__getitem__)}
    back = from_hf(model, 256, hf)
    assert back.keys() == state.keys()
    for key, tensor in state.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_from_hf_names_a_missing_or_misshapen_tensor():
    recipe = _recipe_dict(MODELS["dense"])
    model = model_config(recipe)
    hf = {p.hf_name: t for p, t in to_hf(model, 256, _random_state(recipe).__getitem__)}
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        from_hf(model, 256, {**hf, "model.norm.weight": torch.ones(3)})
    del hf["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(KeyError, match="k_proj"):
        from_hf(model, 256, hf)


# ----------------------------------------------------------------------------- config, refusals

def test_exportable_models_and_the_refusals():
    assert exportable(_recipe_dict(MODELS["dense"])) == []
    assert exportable(_recipe_dict(MODELS["dense_bias_tied"])) == []
    assert exportable(_recipe_dict(MODELS["moe"])) == []
    mixed = _recipe_dict((*MODELS["moe"], "model.moe.frequency=2"))
    top1 = _recipe_dict((*MODELS["moe"], "model.moe.top_k=1", "model.moe.aux_loss_coeff=0"))
    biased = _recipe_dict(MODELS["moe"])
    biased["model"]["bias"] = True  # valid with ep >= 2 (rule E8)
    assert [p.rule for p in export_problems(mixed)] == ["EX1"]
    assert "layers 1 are dense" in exportable(mixed)[0]
    assert [p.rule for p in export_problems(top1)] == ["EX2"]
    assert [p.rule for p in export_problems(biased)] == ["EX3"]
    unknown = _recipe_dict(MODELS["dense"])
    unknown["model"]["activation"] = "gelu"  # a field of another dsforge version
    assert [p.rule for p in export_problems(unknown)] == ["EX4"]


def test_config_json_says_everything_explicitly():
    dense = hf_config(model_config(_recipe_dict(MODELS["dense"])), dtype="bf16", eos_token_id=7)
    assert dense["architectures"] == ["LlamaForCausalLM"] and dense["model_type"] == "llama"
    assert (dense["vocab_size"], dense["hidden_size"], dense["intermediate_size"]) == (250, 64, 176)
    assert (dense["num_attention_heads"], dense["num_key_value_heads"], dense["head_dim"]) == (4, 2, 8)
    assert dense["rms_norm_eps"] == 1e-5 and dense["rope_theta"] == 10000.0
    assert dense["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert dense["tie_word_embeddings"] is False and dense["attention_bias"] is False
    assert dense["torch_dtype"] == dense["dtype"] == "bfloat16" and dense["eos_token_id"] == 7
    tied = hf_config(model_config(_recipe_dict(MODELS["dense_bias_tied"])), dtype="fp32")
    assert tied["tie_word_embeddings"] and tied["attention_bias"] and tied["mlp_bias"]
    assert tied["rms_norm_eps"] == 1e-6 and tied["rope_parameters"]["rope_theta"] == 500000.0
    moe = hf_config(model_config(_recipe_dict(MODELS["moe"])), dtype="fp32")
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["intermediate_size"] == 96
    assert (moe["num_local_experts"], moe["num_experts_per_tok"]) == (4, 2)
    assert moe["router_aux_loss_coef"] == 0.01 and moe["router_jitter_noise"] == 0.0
    assert "attention_bias" not in moe


# ----------------------------------------------------------------------------- shards

def test_sizes_and_shard_plan():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5MB") == 1_500_000 and parse_size("123") == 123
    for bad in ("", "GB", "-1GB", "5 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    entries = [Entry(f"t{i}", (n,), torch.float32) for i, n in enumerate((10, 10, 30, 5))]
    assert [[e.name for e in s] for s in plan_shards(entries, 80)] == [["t0", "t1"], ["t2"], ["t3"]]


def test_shards_stream_one_tensor_at_a_time_and_load_back(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    entries = [Entry(f"w{i}", (4, 8), torch.bfloat16) for i in range(5)]
    made, alive = {}, []

    def produce():
        for entry in entries:
            # Every tensor produced before is already written and dropped.
            assert all(ref() is None for ref in alive)
            made[entry.name] = torch.randn(entry.shape)
            tensor = made[entry.name].clone()
            alive.append(weakref.ref(tensor))
            yield entry.name, tensor
            del tensor

    files = write_shards(tmp_path, entries, produce(), max_bytes=150)
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)] + \
        ["model.safetensors.index.json"]
    index = json.loads((tmp_path / files[-1]).read_text())
    assert index["metadata"]["total_size"] == 5 * 64
    loaded = {}
    for name in files[:-1]:
        loaded.update(safetensors.load_file(tmp_path / name))
    assert {n: f for n, f in index["weight_map"].items()} == \
        {n: files[i // 2] for i, n in enumerate(made)}
    for name, tensor in made.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16))


# ----------------------------------------------------------------------------- export refusals

@pytest.fixture
def dense_run(tmp_path):
    recipe = _recipe_dict(MODELS["dense"])
    _checkpoint(tmp_path / "run", recipe)
    return tmp_path / "run", FakeReader(_random_state(recipe), recipe, 256)


def _refused(source, out, reader, rules, **options) -> str:
    partial = out.with_name(out.name + ".partial")
    before = partial.exists()
    with pytest.raises(ExportRefused) as info:
        export(source, out, open_state=_opener(reader), **options)
    assert [p.rule for p in info.value.problems] == rules, str(info.value)
    assert partial.exists() == before
    return str(info.value)


def test_export_writes_a_whole_folder_and_refuses_to_overwrite(dense_run, tmp_path):
    run, reader = dense_run
    out = tmp_path / "hf"
    result = export(run, out, open_state=_opener(reader))
    assert result.step == 4 and result.architecture == "llama" and result.state == "param"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert not (tmp_path / "hf.partial").exists()
    text = _refused(run, out, reader, ["EX8"])
    assert "not empty" in text and "Fix:" in text
    (tmp_path / "file").write_text("x")
    _refused(run, tmp_path / "file", reader, ["EX8"])
    (tmp_path / "empty").mkdir()
    export(run / "checkpoints" / "step00000004", tmp_path / "empty", open_state=_opener(reader))
    (tmp_path / "killed.partial").mkdir()
    assert "was killed" in _refused(run, tmp_path / "killed", reader, ["EX8"])
    _refused(run, tmp_path / "x", reader, ["EX9"], max_shard_size="lots")


def test_export_refuses_checkpoints_that_are_not_there_or_not_whole(dense_run, tmp_path):
    run, reader = dense_run
    out = tmp_path / "hf"
    assert "does not exist" in _refused(tmp_path / "nothing-here-yet", out, reader, ["EX5"])
    (tmp_path / "a-file").write_text("x")
    assert "is not a directory" in _refused(tmp_path / "a-file", out, reader, ["EX5"])
    mistyped = _refused(run / "checkpoints" / "step00000099", out, reader, ["EX5"])
    assert "does not exist" in mistyped and "this run saved step0000" in mistyped
    (tmp_path / "empty-run").mkdir()
    assert "holds no complete checkpoint" in _refused(tmp_path / "empty-run", out, reader, ["EX5"])
    root = run / "checkpoints"
    (root / "latest").write_text("step00000009")
    assert "does not exist" in _refused(run, out, reader, ["CK1"])
    (root / "latest").write_text("../../elsewhere")
    _refused(run, out, reader, ["CK1"])
    (root / "latest").write_text("step00000004")
    piece = root / "step00000004" / "dsforge_state" / "rank00000.safetensors"
    piece.write_bytes(b"p" * 100)  # cut short
    assert "rank00000.safetensors (100 bytes, saved with 128)" in \
        _refused(run, out, reader, ["CK4"])
    assert not out.exists()


def test_export_refuses_a_checkpoint_from_before_the_layout_free_format(tmp_path):
    recipe = _recipe_dict(MODELS["dense"])
    _checkpoint(tmp_path / "run", recipe, layout_free=False)
    reader = FakeReader(_random_state(recipe), recipe, 256)
    text = _refused(tmp_path / "run", tmp_path / "hf", reader, ["EX6"])
    assert "resume it once with this dsforge" in text
    result = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--to", str(tmp_path / "hf")])
    assert result.exit_code == 2 and "EX6" in result.output and "resume it once" in result.output


def test_export_refuses_unexportable_and_mismatched_models(tmp_path):
    mixed = _recipe_dict((*MODELS["moe"], "model.moe.frequency=2"))
    _checkpoint(tmp_path / "mixed", mixed)
    _refused(tmp_path / "mixed", tmp_path / "hf", FakeReader({}, mixed, 256), ["EX1"])
    recipe = _recipe_dict(MODELS["dense"])
    state = _random_state(recipe)
    _checkpoint(tmp_path / "run", recipe)
    missing = {k: v for k, v in state.items() if "layers.1.mlp" not in k}
    text = _refused(tmp_path / "run", tmp_path / "hf", FakeReader(missing, recipe, 256), ["EX7"])
    assert "2 missing (decoder.layers.1.mlp.linear_fc1.weight" in text
    wrong = {**state, "decoder.layers.1.mlp.linear_fc2.weight": torch.zeros(64, 100)}
    text = _refused(tmp_path / "run", tmp_path / "hf", FakeReader(wrong, recipe, 256), ["EX7"])
    assert "linear_fc2.weight has shape (64, 100)" in text and not (tmp_path / "hf").exists()

    class Failing(FakeReader):  # a piece that is unreadable only when its turn comes
        def full(self, name, state="param"):
            if name == "decoder.final_layernorm.weight":
                raise RuntimeError("rank00001.safetensors cannot be read")
            return super().full(name, state)

    text = _refused(tmp_path / "run", tmp_path / "hf", Failing(state, recipe, 256), ["EX6"])
    assert "final_layernorm.weight (param): rank00001" in text and not (tmp_path / "hf").exists()


def test_the_command_prints_what_it_wrote(dense_run, tmp_path, monkeypatch):
    run, reader = dense_run
    fake = types.ModuleType("dsforge.ckpt.reader")
    fake.open_state = _opener(reader)
    monkeypatch.setitem(sys.modules, "dsforge.ckpt.reader", fake)
    out = tmp_path / "hf"
    result = CliRunner().invoke(main, ["export", str(run), "--to", str(out), "--dtype", "bf16",
                                       "--max-shard-size", "20KB"])
    assert result.exit_code == 0, result.output
    assert "exported step 4" in result.output and "as llama (bfloat16" in result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "fp32 weights from the fp32" not in result.output


def test_fp32_master_weights_are_preferred(dense_run, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    run, reader = dense_run
    bf16 = {k: v.to(torch.bfloat16) for k, v in reader._states["param"].items()}
    recipe = {**reader.recipe, "train": {**reader.recipe["train"], "precision": "bf16"}}
    with_master = FakeReader(bf16, recipe, 256, fp32=reader._states["param"])
    result = export(run, tmp_path / "a", open_state=_opener(with_master))
    assert result.state == "fp32" and result.dtype == "bf16"
    export(run, tmp_path / "b", dtype="fp32", open_state=_opener(with_master))
    weights = safetensors.load_file(tmp_path / "b" / "model.safetensors")
    assert torch.equal(weights["model.norm.weight"],
                       reader._states["param"]["decoder.final_layernorm.weight"])
    result = export(run, tmp_path / "c", dtype="fp32",
                    open_state=_opener(FakeReader(bf16, recipe, 256)))
    assert result.state == "param" and "no fp32 master weights" in result.notes[0]


# ----------------------------------------------------------------------------- tokenizer

def test_the_tokenizer_travels_with_the_model(tmp_path, bpe_tokenizer):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    recipe = _recipe_dict((*MODELS["dense"], "model.vocab_size=512"))
    recipe["data"]["tokenizer"] = str(bpe_tokenizer)
    _checkpoint(tmp_path / "run", recipe)
    out = tmp_path / "hf"
    export(tmp_path / "run", out, open_state=_opener(FakeReader(_random_state(recipe), recipe, 512)))
    assert (out / "tokenizer.json").read_bytes() == bpe_tokenizer.read_bytes()
    loaded = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "Full fathom five thy father lies"
    assert loaded(text)["input_ids"] == Tokenizer.from_file(str(bpe_tokenizer)).encode(text).ids
    assert loaded.eos_token == EOD
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == loaded.eos_token_id
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == loaded.eos_token_id


def test_the_eod_a_dataset_was_prepared_with_is_the_exports_eos(tmp_path):
    """A dataset prepared with --eod-token <|doc|> (the tokenizer's default would be
    <|endoftext|>): the exported tokenizer and config end a sequence where the model learned
    to, and a recipe's data.eod_id names it where there is no record."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dsforge.data.identity import write_record
    from dsforge.data.tokenizers import TokenizerSpec, load_tokenizer
    from dsforge.hf.tokenizer import tokenizer_files

    vocab = {"<unk>": 0, "<|endoftext|>": 1, "<|doc|>": 2, **{c: i + 3 for i, c in enumerate("abc")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|doc|>"])
    tokenizer.save(str(tmp_path / "tok.json"))
    identity = load_tokenizer(TokenizerSpec(str(tmp_path / "tok.json"), eod_token="<|doc|>")).identity
    write_record(tmp_path / "corpus", identity, {"documents": 1})
    for out, data in ((tmp_path / "a", {"source": str(tmp_path / "corpus")}),
                      (tmp_path / "b", {"source": str(tmp_path / "tokens.bin"), "eod_id": 2,
                                        "tokenizer": str(tmp_path / "tok.json")})):
        out.mkdir()
        files = tokenizer_files({"data": data}, out)
        assert files.eos_token_id == 2, data
        assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|doc|>"


def test_bytes_and_missing_tokenizers_are_reported_not_copied(dense_run, tmp_path):
    run, reader = dense_run
    recipe = {**reader.recipe, "data": {**reader.recipe["data"], "tokenizer": "bytes"}}
    result = export(run, tmp_path / "a", open_state=_opener(FakeReader(reader._states["param"], recipe, 256)))
    assert "bytes tokenizer" in result.notes[0]
    assert json.loads((tmp_path / "a" / "config.json").read_text())["eos_token_id"] == 256
    recipe = {**reader.recipe, "data": {**reader.recipe["data"], "tokenizer": str(tmp_path / "gone.json")}}
    result = export(run, tmp_path / "b", open_state=_opener(FakeReader(reader._states["param"], recipe, 256)))
    assert "cannot be loaded here" in result.notes[0]
    assert not (tmp_path / "b" / "tokenizer.json").exists()


# ----------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Each of MODELS built by dsforge in one child: global tensors, recipe, logits."""
    folder = tmp_path_factory.mktemp("models")
    child = subprocess.run([sys.executable, "-m", "tests.unit.test_hf_export", str(folder)],
                           cwd=REPO, capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr[-4000:]
    return folder


def _exported(built: Path, name: str, tmp_path: Path) -> tuple[Path, dict]:
    saved = torch.load(built / f"{name}.pt", weights_only=True)
    _checkpoint(tmp_path / name, saved["recipe"])
    reader = FakeReader(saved["tensors"], saved["recipe"], saved["padded"])
    export(tmp_path / name, tmp_path / f"{name}-hf", open_state=_opener(reader))
    return tmp_path / f"{name}-hf", saved


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_loads_every_tensor_and_gives_dsforges_logits(built, name, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder, saved = _exported(built, name, tmp_path)
    assert set(saved["tensors"]) == set(global_shapes(model_config(saved["recipe"]), saved["padded"]))
    model, logits = transformers_logits(folder)
    expected = transformers.AutoModelForCausalLM.from_config(model.config).state_dict().keys()
    produced = {p.hf_name for p in pieces(model_config(saved["recipe"]), saved["padded"])}
    if name != "moe":  # Mixtral's names are the hub's; transformers 5 fuses the experts on load
        assert produced | ({"lm_head.weight"} if model.config.tie_word_embeddings else set()) \
            == set(expected)
    vocab = model_config(saved["recipe"]).vocab_size
    difference = (logits - saved["logits"][..., :vocab]).abs().max().item()
    print(f"{name}: max |logits difference| {difference:.3g}, max |logit| "
          f"{logits.abs().max().item():.3g}")
    assert difference <= TOLERANCE


# ----------------------------------------------------------------------------- the child

def _child(folder: Path) -> None:
    from dsforge.runtime.assemble.init import init_layout_invariant
    from tests.hf_check import build_chunk, logits, single_process

    single_process(folder / "store")
    for name, overrides in MODELS.items():
        resolved = _resolved(overrides)
        r = resolved.recipe
        chunk, padded = build_chunk(resolved)
        init_layout_invariant([chunk], seed=r.train.seed, std=r.model.init_std,
                              num_layers=r.model.num_layers, vocab_size=r.model.vocab_size)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # norms and biases away from their initial ones and zeros
            for param_name, param in chunk.named_parameters():
                if "norm" in param_name or param_name.endswith(".bias"):
                    param.add_(0.1 * torch.randn(param.shape, generator=g))
        torch.save({"tensors": {n: p.detach().clone() for n, p in chunk.named_parameters()},
                    "recipe": json.loads(json.dumps(dataclasses.asdict(r))),
                    "padded": padded, "logits": logits(chunk)},
                   folder / f"{name}.pt")


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
