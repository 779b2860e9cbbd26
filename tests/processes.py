"""Which live processes belong to a dsforge job: the leftover check every launch test makes.

A process belongs to the job whose run directory is RUN_DIR when its environment carries
DSFORGE_JOB_DIR=RUN_DIR (set by `dsforge run` for its launcher and inherited by DeepSpeed's
runner, launcher and local ranks) or its command line carries a job word (`--job WORD`) whose
run directory is RUN_DIR (ranks started over ssh, whose environment is not inherited). The run
directory itself never appears in a command line in plain text, so a search of `ps` output
finds nothing even when ranks are orphaned.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsforge.launch.job import JobSpec


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def _belongs(pid: str, run_dir: str) -> bool:
    environ = _read(f"/proc/{pid}/environ").split(b"\0")
    if f"DSFORGE_JOB_DIR={run_dir}".encode() in environ:
        return True
    args = _read(f"/proc/{pid}/cmdline").decode(errors="replace").split("\0")
    for flag, word in zip(args, args[1:]):
        if flag == "--job":
            try:
                return JobSpec.decode(word).run_dir == run_dir
            except Exception:
                return False
    return False


def job_processes(run_dir: Path) -> list[int]:
    """PIDs of live (not zombie) processes of the job with this run directory."""
    target = str(Path(run_dir).resolve())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid() or _read(f"/proc/{pid}/stat").split(b") ")[-1][:1] == b"Z":
            continue
        if _belongs(pid, target):
            found.append(int(pid))
    return found
