"""The rank supervisor (runtime/guard/supervise.py): it ends as its rank ends, and records a rank
that a signal killed as a failure only when the signal was not a request to stop."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from dsforge.job import failure

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from dsforge.runtime.guard.supervise import run_supervised
how = sys.argv[2]
def rank():
    if how == "exit3":
        os._exit(3)
    os.kill(os.getpid(), getattr(signal, how))
    time.sleep(5)
run_supervised(rank, run_dir=Path(sys.argv[1]), rank=7)
"""


@pytest.mark.parametrize("how, code, recorded", [
    ("exit3", 3, False),
    ("SIGKILL", -signal.SIGKILL, True),
    ("SIGSEGV", -signal.SIGSEGV, True),
    ("SIGTERM", -signal.SIGTERM, False),  # DeepSpeed's launcher stopping the node's ranks
])
def test_supervisor_ends_like_its_rank(tmp_path, how, code, recorded):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), how], timeout=60)
    assert done.returncode == code
    records = failure.read_all(tmp_path)
    assert bool(records) == recorded
    if recorded:
        assert records[0].rank == 7 and records[0].kind == "killed"
        assert f"killed by {how}" in records[0].message
