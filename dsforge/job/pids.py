"""Pid files: RUN_DIR/ranks/rankNNNNN.pid ("host pid"), written by each rank as it starts.

`dsforge run` reads them to end a job's ranks by saved PID and to name the ranks that started
but neither reported completion nor recorded a failure (launch/diagnose.py).
"""

from __future__ import annotations


from dsforge.files import write_atomic
from dsforge.job.run_dir import RunDir


def write_pid(run_dir: RunDir, rank: int, host: str, pid: int) -> None:
    path = run_dir.pid_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, f"{host} {pid}\n")


def started_ranks(run_dir: RunDir) -> dict[int, str]:
    """rank -> "host pid" for every rank that got as far as starting."""
    found = {}
    for rank, path in run_dir.pid_files():
        try:
            found[rank] = path.read_text().strip()
        except OSError:
            continue
    return found
