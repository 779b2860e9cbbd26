"""A rank's failure record made from its exception (the record itself is job/failure.py's).

An out-of-memory gets the memory measured right then; a failed build of a DeepSpeed op, a
Triton kernel or torch.compile graph its cause and fix (runtime/guard/build_failure.py).
"""

from __future__ import annotations

import os
import traceback

from dsforge.job.failure import Failure
from dsforge.runtime.guard import build_failure, oom


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
    return Failure(rank=rank, step=step, kind="exception", message=message, detail=detail)


def _exception_line(exc: BaseException) -> str:
    return traceback.format_exception_only(exc)[-1].strip()
