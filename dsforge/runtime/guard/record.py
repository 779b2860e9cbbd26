"""A rank's failure record made from its exception (the record itself is job/failure.py's).

An out-of-memory gets the memory measured right then; a failed build of a DeepSpeed op, a
Triton kernel or torch.compile graph its cause and fix (runtime/guard/build_failure.py); a
failed collective or a CUDA error its own kind, which `dsforge run --max-restarts` retries
(launch/restart.py).
"""

from __future__ import annotations

import os
import re
import traceback

from dsforge.job.failure import Failure
from dsforge.runtime.guard import build_failure, oom
from dsforge.runtime.guard.chain import exception_chain


def record_for(exc: BaseException, *, rank: int, step: int, detail: str) -> Failure:
    """The record of a rank's exception: an out-of-memory with the memory measured now, a
    build with its cause, or any other exception."""
    message = _exception_line(exc)
    if oom.out_of_memory(exc):
        try:
            memory = oom.measure_memory(message)
        except Exception:  # a device in an error state: the record matters more than figures
            memory = None
        return Failure(rank=rank, step=step, kind="oom", message=message, detail=detail,
                       memory=memory)
    try:
        built = build_failure.diagnose(build_failure.evidence(exc), os.environ)
    except Exception:  # reading the frames' objects must never cost the record itself
        built = None
    if built is not None:
        return Failure(rank=rank, step=step, kind="build", message=message, detail=detail,
                       what=built.what, cause=built.cause, fix=built.fix)
    try:
        kind = passing_kind(exc) or "exception"
    except Exception:  # as above: the record itself matters more
        kind = "exception"
    return Failure(rank=rank, step=step, kind=kind, message=message, detail=detail)


# What a collective's failure says when torch raises it as a plain RuntimeError: gloo's
# transport and NCCL's watchdog name themselves, a lost peer's socket is closed or reset.
_COLLECTIVE_TEXT = re.compile(r"NCCL|gloo|Connection (closed|reset) by peer|Broken pipe|"
                              r"ProcessGroup|TCPStore|Socket Timeout|Timed out waiting")
_DEVICE_TEXT = re.compile(r"CUDA error|cudaError|CUBLAS_STATUS|CUDNN_STATUS|ECC error")


def passing_kind(exc: BaseException) -> str | None:
    """"collective" or "device" when `exc`, or an exception it was raised from, is a failed
    collective or a CUDA error; None for any other exception (a bug or a bad input, which
    running again would only repeat)."""
    import torch

    # Both are RuntimeErrors in the torch versions that have them (AcceleratorError: 2.8).
    dist_error = getattr(torch.distributed, "DistError", ())
    accelerator_error = getattr(torch, "AcceleratorError", ())
    for raised in exception_chain(exc):
        text = str(raised)
        if isinstance(raised, dist_error) or \
                (isinstance(raised, RuntimeError) and _COLLECTIVE_TEXT.search(text)):
            return "collective"
        if isinstance(raised, accelerator_error) or \
                (isinstance(raised, RuntimeError) and _DEVICE_TEXT.search(text)):
            return "device"
    return None


def _exception_line(exc: BaseException) -> str:
    return traceback.format_exception_only(exc)[-1].strip()
