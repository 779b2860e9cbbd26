"""A rank program for the launcher's tests (tests/unit/test_node_launcher.py): writes what it was
given to OUT/rankN.json, then exits with CODE (killed by signal -CODE when negative) if it is
rank FAIL (once every rank has written its file), else sleeps SLEEP s.

python -m tests.unit.helpers.fake_rank --local_rank=N OUT FAIL CODE SLEEP
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
         "MASTER_ADDR", "MASTER_PORT")

if __name__ == "__main__":
    local_rank, out, fail, code, sleep = sys.argv[1:6]
    rank = int(os.environ["RANK"])
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        {"argv": local_rank, "pid": os.getpid(), **{n: os.environ.get(n) for n in NAMES}}))
    if rank == int(fail):  # once every rank has written its file
        deadline = time.monotonic() + 30
        while (len(list(Path(out).glob("rank*.json"))) < int(os.environ["WORLD_SIZE"])
               and time.monotonic() < deadline):
            time.sleep(0.02)
        if int(code) < 0:  # killed by that signal
            os.kill(os.getpid(), -int(code))
        sys.exit(int(code))
    time.sleep(float(sleep))
