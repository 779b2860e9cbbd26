"""Clear DeepSpeed op build locks left behind by killed builds.

DeepSpeed compiles its ops (fused_adam, cpu_adam, ...) with torch's JIT extension builder on
first use. Every process that loads an op first takes a lock file in the op's build directory
(torch.utils.file_baton): it is created with O_EXCL, holds no owner, and a process that finds
it waits for it to disappear, with no time limit. A rank killed while it holds the lock (a
Ctrl-C, a timeout, a crash in the first step) leaves the file behind, and every later run on
that machine waits forever at its first op load.

A build that is alive keeps writing into its directory (object files, ninja's log), so a lock
whose directory has not changed for STALE_AFTER_S is one nobody holds any more.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# A cold compile of DeepSpeed's largest CPU op on two cores writes its objects in ~2 minutes.
STALE_AFTER_S = 600.0


def extensions_root() -> Path:
    """The directory torch builds JIT extensions in (same rule as torch.utils.cpp_extension)."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def _last_change(directory: Path) -> float:
    times = [directory.stat().st_mtime]
    for entry in directory.iterdir():
        try:
            times.append(entry.stat().st_mtime)
        except FileNotFoundError:  # a live build renamed or removed it meanwhile
            times.append(time.time())
    return max(times)


def stale_locks(root: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Lock files under `root` whose build directory has been idle for `stale_after_s`."""
    root = extensions_root() if root is None else root
    now, found = time.time(), []
    for lock in sorted(root.glob("*/lock")):
        try:
            if now - _last_change(lock.parent) > stale_after_s:
                found.append(lock)
        except FileNotFoundError:
            continue
    return found


def clear_stale_locks(root: Path | None = None, stale_after_s: float = STALE_AFTER_S,
                      log=print) -> list[Path]:
    """Remove stale locks and say so; returns what was removed.

    Call it before any process of the job can load an op: dsforge does it on each node's
    local rank 0 before the process group forms, so no rank of this job is building yet.
    """
    removed = []
    for lock in stale_locks(root, stale_after_s):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(lock)
        log(f"dsforge: removed a stale op build lock left by a killed build: {lock} "
            f"(its directory was idle for over {stale_after_s / 60:.0f} minutes)")
    return removed
