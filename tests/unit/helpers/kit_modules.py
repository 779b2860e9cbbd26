"""The GPU kit's modules (benchmarks/gpu) as tests import them: the kit is no package, its
modules import one another by name from their folder."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO

KIT = REPO / "benchmarks" / "gpu"


def load_kit_module(name: str):
    """benchmarks/gpu/NAME.py, registered under its name: a dataclass it defines looks its
    module up while it is made."""
    spec = importlib.util.spec_from_file_location(name, KIT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
