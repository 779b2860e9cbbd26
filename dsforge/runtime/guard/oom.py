"""A rank's out-of-memory: telling one apart, and what the rank measured when it happened.

torch raises torch.OutOfMemoryError when its allocator cannot get memory (a RuntimeError that
says "CUDA out of memory" where code re-raises it as text); a host raises MemoryError. The rank
records its allocator's figures right then (job/failure.py), and `dsforge run` sets them
against the memory model's prediction (launch/diagnose.py). Figures are bytes in a dict, the
record's JSON: source and peak (what runtime/loop/metrics.py reports every step), capacity, device,
requested (the allocation that failed), and on a GPU allocated and reserved.
"""

from __future__ import annotations

import os
import re
import resource
from typing import Any

from dsforge.runtime.guard.chain import exception_chain
from dsforge.units import GiB, KiB, MiB

# How torch says it ran out, when it is not its own exception class.
# cuBLAS's and NCCL's own words for a device that ran out (NCCL's "Cuda failure 'out of
# memory'"), which must not pass for a failed kernel or collective (runtime/guard/record.py).
_OOM_TEXT = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
             "failure 'out of memory'")
_REQUESTED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": 1024 * GiB}


def out_of_memory(exc: BaseException) -> bool:
    """`exc`, or an exception it was raised from, says the device or the host ran out."""
    import torch

    return any(isinstance(raised, (MemoryError, torch.OutOfMemoryError)) or
               (isinstance(raised, RuntimeError) and any(t in str(raised) for t in _OOM_TEXT))
               for raised in exception_chain(exc))


def measure_memory(message: str) -> dict[str, Any]:
    """What this rank's device held, now that an allocation failed. On a GPU, torch's
    allocator statistics (the memory model predicts max_memory_allocated); on CPU the process's
    peak RSS against the host's memory shared by its ranks on this node."""
    import torch

    requested = requested_bytes(message)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
        peak, source = peak_memory(device)
        return {"source": source, "peak": peak, "allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device),
                "capacity": torch.cuda.get_device_properties(device).total_memory,
                "device": torch.cuda.get_device_name(device), "requested": requested}
    peak, source = peak_memory(torch.device("cpu"))
    ranks = max(1, int(os.environ.get("LOCAL_SIZE", 1)))  # this node's, set by the launcher
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shared = f"the host's memory over its {ranks} rank{'s' if ranks > 1 else ''}"
    return {"source": source, "peak": peak, "capacity": host // ranks, "device": shared,
            "requested": requested}


def requested_bytes(message: str) -> int | None:
    """The size of the allocation torch's out-of-memory message says failed."""
    match = _REQUESTED.search(message)
    return int(float(match[1]) * _UNITS[match[2]]) if match else None


def peak_memory(device) -> tuple[int, str]:
    """(bytes, where the figure comes from): the peak the memory model predicts, on `device`
    (a torch.device)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    # Linux reports ru_maxrss in KiB: the whole process's peak resident memory, not a split
    # into parameters / activations.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"
