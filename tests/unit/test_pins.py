"""The engines dsforge drives internals of are installed at exactly the pinned versions."""

from __future__ import annotations

import configparser
import re
from importlib.metadata import version

import pytest

from tests.conftest import REPO


def _pins() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    pins = {}
    for line in cfg["options"]["install_requires"].strip().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line.strip())
        if match:
            pins[match[1]] = match[2]
    return pins


def test_deepspeed_and_megatron_core_are_pinned():
    assert set(_pins()) == {"deepspeed", "megatron-core"}


@pytest.mark.parametrize("package, pinned", sorted(_pins().items()))
def test_installed_version_matches_the_pin(package, pinned):
    assert version(package) == pinned, (
        f"{package} {version(package)} is installed but dsforge pins {pinned}: re-run the "
        "README's install command, or re-check docs/validation.md and the CPU backend facts "
        "before moving the pin")


def test_megatron_dataset_internals_dsforge_relies_on():
    """dsforge/data/samples.py leaves unread parts out by setting them to None in the config's
    split_matrix, which the builder reads per part; and gives GPTDataset a tokenizer stand-in
    whose pad raises (Megatron then pads with -1, no real id)."""
    import dataclasses
    import inspect

    from megatron.core.datasets import blended_megatron_dataset_builder as builder
    from megatron.core.datasets import megatron_dataset
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig

    assert "split_matrix" in {f.name for f in dataclasses.fields(BlendedMegatronDatasetConfig)}
    assert "self.config.split_matrix" in inspect.getsource(builder.BlendedMegatronDatasetBuilder)
    assert megatron_dataset._PAD_TOKEN_ID == -1
