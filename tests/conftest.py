"""Shared helpers: the repository layout and a way to build recipes from small changes."""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from pathlib import Path

import pytest

from dsforge.recipe.loader import apply_overrides, build_recipe, parse_overrides
from dsforge.problems import RecipeError

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))  # studies live in recipes/bench
HOSTFILES = sorted((REPO / "hostfiles").glob("*"))


def load_tool(name: str):
    """tools/NAME.py as a module, registered under its name: the dataclasses a tool defines
    look their module up while it runs, and a tool importing another finds it there."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# A small valid dense recipe; tests change it with dotted overrides.
BASE = {
    "name": "t",
    "model": {"preset": "tiny"},
    "parallel": {"tp": 1, "pp": 1, "dp": -1},
    "zero": {"stage": 1},
    "train": {"seq_len": 64, "global_batch": 8, "micro_batch": 1, "steps": 10, "lr": 1e-3,
              "precision": "fp32"},
}


def make_recipe(*overrides: str, base: dict | None = None):
    """A Recipe from BASE with `section.field=value` overrides applied."""
    return build_recipe(apply_overrides(base or BASE, parse_overrides(overrides)))


def rule_ids(exc_or_problems) -> set[str]:
    problems = exc_or_problems.problems if isinstance(exc_or_problems, RecipeError) else exc_or_problems
    return {p.rule for p in problems}


# Ctrl-C where the suite runs as a background job of a script: such a job inherits SIGINT
# ignored (POSIX: an asynchronous list without job control), every process it starts keeps it
# ignored across exec, and Python then installs no KeyboardInterrupt. A test that interrupts a
# process starts it, or runs the code, as a terminal's foreground job has it.
def as_foreground_job() -> None:
    """preexec_fn for a process a test sends SIGINT: the signal's default action, which its
    own processes inherit and Python turns into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this process for the test, as in a terminal's
    foreground job; what it was is restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def recipe_file(tmp_path):
    """Write YAML text to a file and return its path."""
    def write(text: str, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


# The data tests' tokenizer: a real BPE made here, since tests may download none.
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
