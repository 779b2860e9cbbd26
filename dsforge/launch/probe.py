"""What a machine has for a job: CPU cores, available host memory, GPUs and their memory.

Standard library only, and runnable as a script, because preflight sends this file's text
over ssh to every host of a hostfile (`python -c SOURCE`) where dsforge may not be importable.
GPUs are read from nvidia-smi, never from torch: initialising CUDA here would leave a context
(hundreds of MiB) on every GPU for the whole job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

MiB = 1024**2


def probe() -> dict:
    return {"cpus": len(os.sched_getaffinity(0)), "memory_available": memory_available(),
            "gpus": visible_gpus()}


def memory_available() -> int | None:
    """Bytes a new process can still use: MemAvailable, lowered by a cgroup limit if any."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    limit = _cgroup_headroom()
    return min(available, limit) if available is not None and limit is not None else available


def _cgroup_headroom() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def visible_gpus() -> list[dict]:
    """name, total and free bytes of each GPU this process may use (CUDA_VISIBLE_DEVICES)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = "--query-gpu=index,uuid,name,memory.total,memory.free"
    try:
        out = subprocess.run([smi, query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        index, uuid, name, total, free = [part.strip() for part in line.split(",")]
        gpus.append({"index": index, "uuid": uuid, "name": name,
                     "memory_total": int(float(total)) * MiB, "memory_free": int(float(free)) * MiB})
    return _only_visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _only_visible(gpus: list[dict], visible: str | None) -> list[dict]:
    if visible is None:
        return gpus
    by_key = {g["index"]: g for g in gpus} | {g["uuid"]: g for g in gpus}
    chosen = [by_key.get(item.strip()) for item in visible.split(",") if item.strip()]
    return [g for g in chosen if g is not None]


if __name__ == "__main__":
    print(json.dumps(probe()))
