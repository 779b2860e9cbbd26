"""The data rules (D7-D16, docs/validation.md): every bad Megatron dataset, blend, split,
tokenizer or cache directory is a problem naming the recipe fields, found before any rank
starts, from the .idx and the dataset's record alone; and `dsforge data inspect`."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from dsforge.cli import main
from dsforge.data.indexed import megatron_indexed_dataset, split_ranges
from dsforge.data.prepare import prepare
from dsforge.problems import RecipeError
from dsforge.recipe import Topology, validate
from dsforge.recipe.data_rules import datasets as dataset_rules
from tests.conftest import REPO, make_recipe

BYTES_VOCAB = "model.vocab_size=257"  # the bytes tokenizer's 256 bytes and its EOD
WORLD = 8  # BASE: seq_len 64, global_batch 8, micro_batch 1, dp 8


def bytes_dataset(folder: Path, name: str, documents: int, words: int = 20) -> str:
    """A dsforge dataset of `documents` documents of about 5 x words + 10 byte tokens each."""
    jsonl = folder / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"doc {i}: " + "word " * words}) + "\n"
                             for i in range(documents)))
    prepare([str(jsonl)], tokenizer="bytes", output=folder / name, workers=0)
    return str(folder / name)


def megatron_dataset(folder: Path, name: str, documents: int) -> str:
    """A dataset as Megatron-LM's tools write it: no dsforge record beside it."""
    import torch

    module = megatron_indexed_dataset()
    prefix = folder / name
    builder = module.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i in range(documents):
        builder.add_document((torch.arange(30) + 7 * i) % 250, [30])  # ids 0..249
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory, bpe_tokenizer) -> SimpleNamespace:
    folder = tmp_path_factory.mktemp("datasets")
    jsonl = folder / "bpe.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"Ariel {i} flies over the isle."}) + "\n"
                             for i in range(100)))
    prepare([str(jsonl)], tokenizer=str(bpe_tokenizer), output=folder / "bpe", workers=0)
    return SimpleNamespace(
        folder=folder,
        wiki=bytes_dataset(folder, "wiki", 200),  # ~22,000 tokens
        code=bytes_dataset(folder, "code", 100),
        small=bytes_dataset(folder, "small", 50),  # "99,1,0": round(49.5) = 50, no validation
        bpe=str(folder / "bpe"),
        megatron=megatron_dataset(folder, "megatron", 100),
        tokenizer=str(bpe_tokenizer))


def problems(*overrides: str, world: int | None = WORLD) -> list:
    recipe = make_recipe(*overrides)
    return validate(recipe, Topology(world_size=world) if world else None)


def only(found: list, rule: str):
    """The one problem of `rule`; no other rule broken."""
    assert [p.rule for p in found] == [rule], [str(p) for p in found]
    return found[0]


def blend(*parts: tuple[str, float]) -> str:
    return "data.source=[" + ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in parts) + "]"


def suggested_split(fix: str) -> str:
    return re.search(r'data\.split: "([^"]+)"', fix).group(1)


# ------------------------------------------------------------------------------- accepted

def test_a_two_dataset_blend_with_validation_is_clean(data):
    assert problems(blend((data.wiki, 0.7), (data.code, 0.3)), 'data.split="98,1,1"',
                    "train.eval_every=5", BYTES_VOCAB, "data.tokenizer=bytes") == []


def test_a_blend_recipe_file_plans_with_exit_0(data, tmp_path):
    recipe = tmp_path / "r.yaml"
    shutil.copy(f"{data.wiki}.bin", tmp_path / "w.bin")
    shutil.copy(f"{data.wiki}.idx", tmp_path / "w.idx")
    shutil.copy(f"{data.wiki}.tokenizer.json", tmp_path / "w.tokenizer.json")
    recipe.write_text(
        "name: blend\nmodel: {preset: tiny, vocab_size: 257}\nparallel: {dp: -1}\n"
        "train: {seq_len: 64, global_batch: 8, micro_batch: 1, steps: 10, lr: 1.0e-3, "
        "precision: fp32, eval_every: 5}\n"
        f"data: {{source: [{{path: w, weight: 0.7}}, {{path: {data.code}, weight: 0.3}}], "
        "split: '98,1,1'}\n")
    result = CliRunner().invoke(main, ["plan", str(recipe), "--world-size", "8"])
    assert result.exit_code == 0, result.output


def test_synthetic_data_evaluates_from_its_own_stream():
    assert problems("train.eval_every=5", 'data.split="100,0,0"') == []


def test_a_megatron_lm_dataset_without_a_record_is_accepted(data):
    assert problems(f"data.source={data.megatron}", "train.eval_every=5") == []


def test_split_ranges_are_megatrons_own(tmp_path):
    """Compared with BlendedMegatronDatasetBuilder._build_megatron_dataset_splits itself, run
    with a dataset class that records the indices it is given."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder as Builder
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class Recorder:
        build_low_level_dataset = staticmethod(
            lambda path, config: megatron_indexed_dataset().IndexedDataset(path))
        numel_low_level_dataset = staticmethod(GPTDataset.numel_low_level_dataset)

        def __init__(self, low_level, path, indices, size, which, config):
            self.indices = indices

    cases = [("98,1,1", 50), ("99,1,0", 50), ("90,5,5", 784), ("0.7,0.2,0.1", 33),
             ("100,0,0", 7), ("98/1/1", 1), ("1,1,1", 10), ("33.3,33.3,33.4", 3)]
    for sequences in sorted({count for _, count in cases}):
        megatron_dataset(tmp_path, f"d{sequences}", sequences)
    for split, sequences in cases:
        prefix = str(tmp_path / f"d{sequences}")
        config = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8,
                                              blend=([prefix], None), split=split)
        builder = SimpleNamespace(cls=Recorder, config=config, is_built_on_rank=lambda: True,
                                  build_generic_dataset=Builder.build_generic_dataset)
        built = Builder._build_megatron_dataset_splits(builder, prefix, config.split_matrix,
                                                       [None] * 3)
        ours = split_ranges(split, sequences)
        for theirs, mine in zip(built, ours):
            assert (theirs is None) == (mine is None), (split, sequences)
            if mine is not None:
                assert theirs.indices.tolist() == list(range(*mine)), (split, sequences)


# ------------------------------------------------------------------------- D7, D8: files

def _copy(prefix: str, folder: Path, name: str = "d") -> str:
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        if os.path.exists(prefix + suffix):
            shutil.copy(prefix + suffix, folder / f"{name}{suffix}")
    return str(folder / name)


def _damage(prefix: str, how: str) -> None:
    if how == "no idx":
        os.remove(f"{prefix}.idx")
    elif how == "unfinished prepare":
        os.rename(f"{prefix}.bin", f"{prefix}.bin.partial-99999")
        os.remove(f"{prefix}.idx")
    elif how == "short bin":
        with open(f"{prefix}.bin", "r+b") as file:
            file.truncate(os.path.getsize(f"{prefix}.bin") - 10)
    elif how == "cut idx":
        Path(f"{prefix}.idx").write_bytes(Path(f"{prefix}.idx").read_bytes()[:20])
    elif how == "empty bin":
        Path(f"{prefix}.bin").write_bytes(b"")
    elif how == "foreign idx":
        Path(f"{prefix}.idx").write_bytes(b"not an index at all" * 10)
    elif how == "record of other files":
        record = json.loads(Path(f"{prefix}.tokenizer.json").read_text())
        record["dataset"]["tokens"] += 1
        Path(f"{prefix}.tokenizer.json").write_text(json.dumps(record))


@pytest.mark.parametrize("how, says", [
    ("no idx", "d.idx missing"),
    ("unfinished prepare", "a prepare to this prefix has not finished"),
    ("short bin", "the two files do not belong together, or one was cut short"),
    ("cut idx", "d.idx is not a Megatron index (struct.error"),
    ("empty bin", "d.bin is empty"),
    ("foreign idx", "d.idx is not a Megatron index (AssertionError: bad header"),
    ("record of other files", "the record belongs to other files"),
])
def test_a_dataset_that_cannot_be_opened(data, tmp_path, how, says):
    prefix = _copy(data.wiki, tmp_path)
    _damage(prefix, how)
    problem = only(problems(f"data.source={prefix}", BYTES_VOCAB), "D7")
    assert problem.fields == {"data.source": prefix} and says in problem.message
    assert f"--output {prefix}" in problem.fix


def test_a_missing_blend_part_names_its_index(data, tmp_path):
    problem = only(problems(blend((data.wiki, 0.7), (tmp_path / "gone", 0.3)), BYTES_VOCAB), "D7")
    assert problem.fields == {"data.source[1].path": str(tmp_path / "gone")}
    assert "gone.bin and gone.idx missing" in problem.message


def test_a_path_that_names_nothing(tmp_path):
    problem = only(problems(f"data.source={tmp_path / 'corpus'}"), "D7")
    assert "not found" in problem.message
    assert f"--output {tmp_path / 'corpus'}" in problem.fix


def test_a_weight_0_part_is_not_read(data, tmp_path):
    assert problems(blend((data.wiki, 1), (tmp_path / "gone", 0)), BYTES_VOCAB) == []


def test_the_bin_file_named_instead_of_the_prefix(data):
    problem = only(problems(f"data.source={data.wiki}.bin", BYTES_VOCAB), "D8")
    assert problem.fields == {"data.source": f"{data.wiki}.bin"}
    assert problem.fix == f"write the prefix {data.wiki}"
    problem = only(problems(blend((data.code, 1), (f"{data.wiki}.idx", 1)), BYTES_VOCAB), "D8")
    assert problem.fields == {"data.source[1].path": f"{data.wiki}.idx"}


def test_a_directory_is_still_no_token_file(tmp_path):
    problem = only(problems(f"data.source={tmp_path}"), "D2")
    assert "is a directory" in problem.message


# ----------------------------------------------------------------- D9, D12-D15: tokenizers

def test_a_blend_of_datasets_made_with_different_tokenizers(data):
    problem = only(problems(blend((data.wiki, 1), (data.bpe, 1)), "model.vocab_size=512"), "D9")
    assert problem.fields == {"data.source[0].path": data.wiki, "data.source[1].path": data.bpe}
    assert "bytes" in problem.message and "tokenizers" in problem.message
    assert "--tokenizer T" in problem.fix


def test_a_vocabulary_larger_than_the_model_from_the_record(data):
    problem = only(problems(f"data.source={data.wiki}", "model.vocab_size=256"), "D12")
    assert problem.fields == {"model.vocab_size": 256, "data.source": data.wiki}
    assert problem.fix == "set model.vocab_size to at least 257"
    assert problems(f"data.source={data.wiki}", BYTES_VOCAB) == []


def test_a_vocabulary_larger_than_the_model_from_data_tokenizer(data, tmp_path):
    token_file = tmp_path / "tokens.bin"
    (np.arange(1000) % 250).astype(np.uint16).tofile(token_file)
    for source in (data.bpe, str(token_file)):
        problem = only(problems(f"data.source={source}", f"data.tokenizer={data.tokenizer}"), "D12")
        assert problem.fields == {"model.vocab_size": 256, "data.tokenizer": data.tokenizer}
        assert problem.fix == "set model.vocab_size to at least 512"
        assert problems(f"data.source={source}", f"data.tokenizer={data.tokenizer}",
                        "model.vocab_size=512") == []


def test_a_tokenizer_other_than_the_datasets(data):
    problem = only(problems(f"data.source={data.wiki}", f"data.tokenizer={data.tokenizer}",
                            "model.vocab_size=512"), "D13")
    assert problem.fields == {"data.tokenizer": data.tokenizer, "data.source": data.wiki}
    assert "sha256: dataset" in problem.message and "vocab_size: dataset 257, tokenizer 512" \
        in problem.message
    assert problem.fix.startswith("use data.tokenizer: bytes (the dataset's)")


def test_a_tokenizer_path_that_does_not_exist(data, tmp_path):
    problem = only(problems(f"data.source={data.wiki}", BYTES_VOCAB,
                            f"data.tokenizer={tmp_path / 'gpt2'}"), "D14")
    assert problem.fields == {"data.tokenizer": str(tmp_path / "gpt2")}
    assert "no such file or folder" in problem.message and "local" in problem.fix


def test_a_tokenizer_json_without_the_tokenizers_library(data, tmp_path, monkeypatch):
    copy = tmp_path / "tokenizer.json"
    shutil.copy(data.tokenizer, copy)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    problem = only(problems(f"data.source={data.bpe}", "model.vocab_size=512",
                            f"data.tokenizer={copy}"), "D14")
    assert "'tokenizers'" in problem.message and problem.fix == "pip install 'dsforge[data]'"


def test_a_model_folder_without_the_transformers_library(data, tmp_path, monkeypatch):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "</s>": 1}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    monkeypatch.setitem(sys.modules, "transformers", None)
    problem = only(problems(f"data.source={data.wiki}", BYTES_VOCAB,
                            f"data.tokenizer={tmp_path}"), "D14")
    assert "'transformers'" in problem.message and problem.fix == "pip install 'dsforge[hf]'"


def test_a_tokenizer_with_synthetic_data():
    problem = only(problems("data.tokenizer=bytes"), "D15")
    assert problem.fields == {"data.tokenizer": "bytes", "data.source": "synthetic"}
    assert problem.fix.startswith("remove data.tokenizer")


# ------------------------------------------------------------------------ D6, D10, D11: split

def test_a_split_that_leaves_validation_empty(data):
    problem = only(problems(f"data.source={data.small}", BYTES_VOCAB, 'data.split="99,1,0"',
                            "train.eval_every=5"), "D10")
    assert problem.fields == {"data.split": "99,1,0", "train.eval_every": 5,
                              "data.source": data.small}
    assert "empty for data.source (50 sequences)" in problem.message
    assert problem.fix.endswith("or set train.eval_every: 0")
    split = suggested_split(problem.fix)
    assert problems(f"data.source={data.small}", BYTES_VOCAB, f'data.split="{split}"',
                    "train.eval_every=5") == []


def test_a_split_that_leaves_one_blend_parts_validation_empty(data):
    problem = only(problems(blend((data.wiki, 0.7), (data.small, 0.3)), BYTES_VOCAB,
                            'data.split="99,1,0"', "train.eval_every=5"), "D10")
    assert problem.fields == {"data.split": "99,1,0", "train.eval_every": 5,
                              "data.source[1].path": data.small}
    assert "loop forever" in problem.message


def test_a_split_without_a_validation_share(data):
    problem = only(problems(f"data.source={data.wiki}", BYTES_VOCAB, 'data.split="100,0,0"',
                            "train.eval_every=5"), "D10")
    assert problem.fields == {"data.split": "100,0,0", "train.eval_every": 5}
    assert suggested_split(problem.fix) == "99.5,0.5,0"  # 0.1% and 0.2% of 200 round to 0


@pytest.mark.parametrize("split", ["98,1,1", "99,1,0"])
def test_parts_never_read_may_be_empty(data, split, tmp_path):
    """The test part, and the validation part without evaluation, are never built
    (data/samples.py), so they may be empty: Megatron-Core would loop forever on an empty
    part it was asked to build."""
    settings = (f"data.source={data.small}", BYTES_VOCAB, "train.eval_every=0")
    assert problems(*settings, f'data.split="{split}"') == []
    from dsforge.data.samples import build_splits

    splits = build_splits([(str(data.small), 1.0)], split=split, seq_len=64, seed=1,
                          train_samples=8, validation_samples=None, identity=None,
                          cache_dir=tmp_path / "cache")
    assert splits.validation is None and len(splits.train) >= 8


def test_a_dataset_too_small_for_one_global_batch(data):
    found = problems(f"data.source={data.code}", BYTES_VOCAB, "train.global_batch=256")
    problem = only(found, "D11")
    assert problem.fields == {"train.global_batch": 256, "train.micro_batch": 1,
                              "train.seq_len": 64, "data.source": data.code}
    assert "256 x 64 + 1 = 16,385" in problem.message
    largest = int(re.search(r"train\.global_batch in \{[^}]*?(\d+)\}", problem.fix).group(1))
    assert problems(f"data.source={data.code}", BYTES_VOCAB, f"train.global_batch={largest}") == []
    assert only(problems(f"data.source={data.code}", BYTES_VOCAB,
                         f"train.global_batch={largest + 8}"), "D11")


def test_a_split_without_a_training_share(data):
    problem = only(problems(f"data.source={data.wiki}", BYTES_VOCAB, 'data.split="0,50,50"'), "D11")
    assert problem.fields == {"data.split": "0,50,50"} and 'data.split: "98,1,1"' in problem.fix


def test_a_split_megatron_reads_otherwise(data):
    problem = only(problems(f"data.source={data.wiki}", BYTES_VOCAB, 'data.split="9_8,1,1"'), "D6")
    assert problem.fix == 'write plain numbers: data.split: "98,1,1"'


# -------------------------------------------------------------------------- D16: cache_dir

def test_a_cache_dir_that_is_a_file(data, tmp_path):
    file = tmp_path / "cache"
    file.write_text("")
    for cache in (file, file / "indices"):
        problem = only(problems(f"data.source={data.wiki}", BYTES_VOCAB,
                                f"data.cache_dir={cache}"), "D16")
        assert problem.fields == {"data.cache_dir": str(cache)}
        assert "data.cache_dir to a directory this user can write" in problem.fix
    assert problems(f"data.source={data.wiki}", BYTES_VOCAB,
                    f"data.cache_dir={tmp_path / 'new' / 'indices'}") == []


def test_the_default_cache_dir_is_checked_too(data, tmp_path, monkeypatch):
    (tmp_path / "xdg").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    problem = only(problems(f"data.source={data.wiki}", BYTES_VOCAB), "D16")
    assert problem.fields == {"data.cache_dir": None} and "the default" in problem.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any directory")
def test_a_cache_dir_this_user_cannot_write(data, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    only(problems(f"data.source={data.wiki}", BYTES_VOCAB, f"data.cache_dir={locked}"), "D16")


# --------------------------------------------------------------------- cost: index only

def test_a_100_gb_corpus_validates_in_seconds_from_its_index(tmp_path):
    """100,000 sequences of 500,000 tokens: a sparse .bin of 100 GB that is never read."""
    module = megatron_indexed_dataset()
    prefix = tmp_path / "huge"
    lengths = np.full(100_000, 500_000, dtype=np.int32)
    with module._IndexWriter(f"{prefix}.idx", np.uint16) as writer:
        writer.write(lengths, None, np.arange(len(lengths) + 1))
    with open(f"{prefix}.bin", "wb") as file:
        file.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    start = time.monotonic()
    assert problems(f"data.source={prefix}", "train.eval_every=5") == []
    assert time.monotonic() - start < 10


def test_validation_reads_a_dataset_once_and_again_when_it_changes(data, tmp_path, monkeypatch):
    prefix = _copy(data.wiki, tmp_path)
    opened = []
    real = dataset_rules.open_files
    monkeypatch.setattr(dataset_rules, "open_files", lambda p: opened.append(p) or real(p))
    for _ in range(3):
        problems(f"data.source={prefix}", "model.vocab_size=256")  # D12: validated twice
    assert opened == [prefix]
    os.utime(f"{prefix}.idx", ns=(0, 0))
    problems(f"data.source={prefix}", BYTES_VOCAB)
    assert opened == [prefix, prefix]


# ------------------------------------------------------------------------ data inspect

def test_data_inspect_shows_counts_and_the_recorded_tokenizer(data):
    result = CliRunner().invoke(main, ["data", "inspect", data.wiki, "--scan"])
    assert result.exit_code == 0, result.output
    assert "documents  200" in result.output and "dtype      uint16" in result.output
    assert "tokenizer  bytes (vocab_size 257, eod 256" in result.output
    assert "largest id 256 (fits the recorded vocabulary of 257)" in result.output


def test_data_inspect_of_a_megatron_lm_dataset(data):
    result = CliRunner().invoke(main, ["data", "inspect", data.megatron])
    assert result.exit_code == 0, result.output
    assert "no dsforge record: made by Megatron-LM/GPT-NeoX tools?" in result.output
    assert "largest id" not in result.output  # only with --scan
    result = CliRunner().invoke(main, ["data", "inspect", data.megatron, "--scan"])
    assert "largest id 249" in result.output


def test_data_inspect_of_a_bad_prefix_exits_2(tmp_path):
    result = CliRunner().invoke(main, ["data", "inspect", str(tmp_path / "nothing")])
    assert result.exit_code == 2
    assert "nothing.bin and nothing.idx missing" in result.output


def test_tracking_without_its_package_is_refused_before_launch(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    problem = only(problems("tracking.wandb=true"), "X1")
    assert problem.fields == {"tracking.wandb": True} and "dsforge[wandb]" in problem.fix


@pytest.mark.parametrize("source, rule, field, words", [
    ("[{path: a, weight: 1}, {path: b, weight: -1}]", "D5", "data.source[1].weight", "must be >= 0"),
    ("[{path: a, weight: 0}, {path: b, weight: 0.0}]", "D5", "data.source[].weight", "add up to 0"),
    ("[]", "D5", "data.source", "an empty blend"),
    ("[{path: a, weight: heavy}]", "Y2", "data.source[0].weight", "expected a number"),
    ("[{path: a, wieght: 1}]", "Z6", "data.source[0].wieght", "unknown key"),
])
def test_bad_blend_weights_are_refused_when_the_recipe_is_read(source, rule, field, words):
    with pytest.raises(RecipeError) as caught:
        make_recipe(f"data.source={source}")
    (problem,) = caught.value.problems
    assert (problem.rule, list(problem.fields)) == (rule, [field]) and words in problem.message


@pytest.mark.parametrize("split, fix", [
    ("98,1,2", 'data.split: "97.03,0.9901,1.98"'),
    ("969,30,1", 'data.split: "96.9,3,0.1"'),
    ("0,0,0", 'data.split: "98,1,1"'),
    ("a,b", 'data.split: "98,1,1"'),
    ("1,2,3,4", 'data.split: "98,1,1"'),
    ("90,5", 'data.split: "90,5,5" (the rest for the next share)'),
])
def test_a_split_that_does_not_add_up_is_refused_with_one_that_does(split, fix):
    with pytest.raises(RecipeError) as caught:
        make_recipe(f'data.split="{split}"')
    (problem,) = caught.value.problems
    assert problem.rule == "D6" and problem.fields == {"data.split": split} and fix in problem.fix


def test_a_flat_token_file_split_without_validation_windows_is_refused():
    text = REPO / "data" / "tempest.u16.bin"  # 196,878 bytes: 767 windows of 128 + 1 tokens
    problem = only(problems(f"data.source={text}", "train.seq_len=128", 'data.split="100,0,0"',
                            "train.eval_every=5"), "D10")
    assert problem.fields["data.split"] == "100,0,0" and "90,10,0" in problem.fix
    assert problems(f"data.source={text}", "train.seq_len=128", 'data.split="100,0,0"') == []
    assert only(problems(f"data.source={text}", "train.seq_len=128", 'data.split="0,50,50"'),
                "D11")
