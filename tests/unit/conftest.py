"""Fixtures for the data tests: a real BPE tokenizer made here, since tests may download none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO

TEMPEST = REPO / "data" / "tempest.txt"
EOD = "<|endoftext|>"


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE (vocabulary 512, EOD <|endoftext|>) trained on data/tempest.txt, saved
    as a Hugging Face tokenizer.json. Skipped without the tokenizers package."""
    pytest.importorskip("tokenizers", reason="needs the tokenizers package: pip install "
                        "'dsforge[data]' (the test extra has it)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(TEMPEST)], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def bpe_model_folder(bpe_tokenizer, tmp_path_factory) -> Path:
    """The same BPE as a Hugging Face model folder: tokenizer.json + tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("bpe-model")
    (folder / "tokenizer.json").write_bytes(bpe_tokenizer.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD}))
    return folder
