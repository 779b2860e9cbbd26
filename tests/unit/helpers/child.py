"""Tests that build Megatron-Core models run them in a child process (Megatron-Core's import
and a process group stay out of pytest's): the child is a test module run with `python -m` on
a folder, where it writes its results as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def run_child(module: str, folder: Path, results: str, timeout_s: float = 300):
    """`python -m MODULE FOLDER` from the repository root; the JSON it wrote to FOLDER/RESULTS."""
    child = subprocess.run([sys.executable, "-m", module, str(folder)], cwd=REPO,
                           capture_output=True, text=True, timeout=timeout_s)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads((folder / results).read_text())
