"""Host memory a process can still use on this machine: what the launcher's fit check counts
(launch/probe.py) and what a rank's checkpoint staging takes its share of
(runtime/checkpoint/staging.py). Standard library only, and self-contained functions:
preflight sends their text to other hosts inside probe.py's (launch/preflight.host_script).
"""

from __future__ import annotations


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
