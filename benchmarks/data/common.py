"""What bench_loader.py and bench_open.py share: where the checkout is, the environment their
`python -m dsforge` children run in (the checkout first on PYTHONPATH, so a fresh clone runs
installed or not), and the load average they quote beside their figures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "smoke.yaml"
TEMPEST = REPO / "data" / "tempest"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this process imports dsforge from the checkout too


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
