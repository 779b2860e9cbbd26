"""Clock marks inside the engines for the step breakdown (runtime/breakdown.py).

Installed for one step and removed after it, so evaluation, checkpoints and a run without
the breakdown meet the engines untouched:

| phase | marked around |
|---|---|
| dp_comm | `engine.allreduce_gradients` (ZeRO 0/1: the data-parallel reduction at the step's boundary; ZeRO 2/3: the last bucket after each backward); ZeRO-1/2's `reduce_ipg_grads` (each bucket reduced during the backward) and its `optimizer_allgather` timer (the updated parameters gathered after the optimizer step); ZeRO-3's `fetch_sub_module` (each module's parameters gathered before its forward and backward) and its bucket reduce-scatter |
| forward, backward, pipeline_wait | Megatron-Core's schedule timers (`config.timers`, timers.py): with pp > 1 |
| recompute | the forward that Megatron's `CheckpointFunction.backward` runs again (activation checkpointing) |

Wrappers are instance attributes over DeepSpeed's methods (a method calls them through `self`),
so they reach exactly this engine; the one class attribute, CheckpointFunction.backward, is
restored after the step. tests/unit/test_breakdown.py pins the names.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from dsforge.runtime.breakdown import StepClock
from dsforge.runtime.timers import PhaseTimers, optimizer_phase, schedule_phase

# ZeRO-3's reduce-scatter of a bucket: a private method, reached through its mangled name.
ZERO3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


@contextlib.contextmanager
def marking(clock: StepClock, engine, chunks) -> Iterator[None]:
    undo: list[Callable[[], None]] = []
    try:
        for owner, name in communication(engine):
            _set(owner, name, _timed(clock, "dp_comm", getattr(owner, name)), undo)
        if hasattr(engine.optimizer, "reduce_ipg_grads"):  # ZeRO-1/2 report through timers
            _set(engine.optimizer, "timers", PhaseTimers(clock, optimizer_phase), undo)
        for chunk in chunks:
            _set(chunk.config, "timers", PhaseTimers(clock, schedule_phase), undo)
        _mark_recompute(clock, undo)
        yield
    finally:
        for restore in reversed(undo):
            restore()


def communication(engine) -> list[tuple[object, str]]:
    """(object, method name) of each data-parallel reduction or ZeRO gather this engine has."""
    optimizer = engine.optimizer
    found = [(engine, "allreduce_gradients")]
    found += [(optimizer, name) for name in ("reduce_ipg_grads", ZERO3_REDUCE)
              if hasattr(optimizer, name)]
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is not None:
        found.append((offload.get_param_coordinator(), "fetch_sub_module"))
    return found


def _timed(clock: StepClock, phase: str, function: Callable) -> Callable:
    def timed(*args, **kwargs):
        clock.enter(phase)
        try:
            return function(*args, **kwargs)
        finally:
            clock.exit()

    return timed


def _set(owner, name: str, value, undo: list) -> None:
    """owner.name = value, with its undo: the earlier instance attribute, or none."""
    had = name in vars(owner)
    previous = vars(owner).get(name)
    setattr(owner, name, value)
    undo.append(lambda: setattr(owner, name, previous) if had else delattr(owner, name))


def _mark_recompute(clock: StepClock, undo: list) -> None:
    """The forward run again inside a checkpointed segment's backward is `recompute`; the
    rest of that backward stays `backward`."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    original = vars(CheckpointFunction)["backward"]  # the staticmethod itself

    def backward(ctx, *grads):
        run = ctx.run_function
        ctx.run_function = _timed(clock, "recompute", run)
        try:
            return original.__func__(ctx, *grads)
        finally:
            ctx.run_function = run

    CheckpointFunction.backward = staticmethod(backward)
    undo.append(lambda: setattr(CheckpointFunction, "backward", original))
