"""Clock marks inside the engines for the step breakdown (runtime/loop/breakdown.py).

Installed for one step and removed after it, so evaluation, checkpoints and a run without
the breakdown meet the engines untouched:

| phase | marked around |
|---|---|
| dp_comm | `engine.allreduce_gradients` (ZeRO 0/1: the data-parallel reduction at the step's boundary; ZeRO 2/3: the last bucket after each backward); ZeRO-1/2's `reduce_ipg_grads` (each bucket reduced during the backward) and its `optimizer_allgather` timer (the updated parameters gathered after the optimizer step); ZeRO-3's bucket reduce-scatter, and with DSFORGE_BREAKDOWN=gathers its `fetch_sub_module` for each module holding parameters (gathered before its forward and backward) |
| forward, backward, pipeline_wait | Megatron-Core's schedule timers (`config.timers`, timers.py): with pp > 1 |
| recompute | the forward that Megatron's `CheckpointFunction.backward` runs again (activation checkpointing) |
| experts | MoE layers' expert MLPs (Megatron's SequentialMLP, or dsforge's grouped experts, its subclass): each forward (module hooks), and its backward, from the gradient reaching its output to the gradient of its input (tensor hooks), in forward, recompute and backward alike |

Wrappers are instance attributes over DeepSpeed's methods (a method calls them through `self`),
so they reach exactly this engine. CheckpointFunction.backward is a class attribute: it is
replaced once per process, so no class changes while training runs, and marks only while a
step's clock is set (RECOMPUTE).
tests/unit/test_breakdown.py pins the names.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch

from dsforge.runtime.loop.breakdown import StepClock
from dsforge.runtime.loop.timers import PhaseTimers, optimizer_phase, schedule_phase

# ZeRO-3's reduce-scatter of a bucket: a private method, reached through its mangled name.
ZERO3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


@contextlib.contextmanager
def marking(clock: StepClock, engine, chunks) -> Iterator[None]:
    """For one step: the engine's reductions and gathers, its ZeRO-1/2 optimizer's timers,
    Megatron's schedule timers and the recompute report to `clock`; all undone afterwards."""
    undo: list[Callable[[], None]] = []
    try:
        for owner, name, marked in communication(clock, engine):
            _set(owner, name, marked, undo)
        if hasattr(engine.optimizer, "reduce_ipg_grads"):  # ZeRO-1/2 report through timers
            _set(engine.optimizer, "timers", PhaseTimers(clock, optimizer_phase), undo)
        for chunk in chunks:
            _set(chunk.config, "timers", PhaseTimers(clock, schedule_phase), undo)
        RECOMPUTE.install()
        RECOMPUTE.clock = clock
        undo.append(RECOMPUTE.stop)
        _mark_experts(clock, chunks, undo)
        yield
    finally:
        for restore in reversed(undo):
            restore()


def communication(clock: StepClock, engine) -> list[tuple[object, str, Callable]]:
    """(object, method name, its marked replacement) for each data-parallel reduction or ZeRO
    gather this engine has."""
    optimizer = engine.optimizer
    found = [(owner, name, _timed(clock, "dp_comm", getattr(owner, name)))
             for owner, name in [(engine, "allreduce_gradients"), (optimizer, "reduce_ipg_grads"),
                                 (optimizer, ZERO3_REDUCE)] if hasattr(owner, name)]
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is not None and clock.gathers:
        coordinator = offload.get_param_coordinator()
        found.append((coordinator, "fetch_sub_module",
                      _timed_fetch(clock, coordinator.fetch_sub_module)))
    return found


def _timed_fetch(clock: StepClock, fetch: Callable) -> Callable:
    """ZeRO-3's fetch, marked for modules that hold parameters: the others' (a layer, its MLP)
    gather nothing, and leaving them unmarked halves the marks a step takes. Inline: it runs
    for every module of every pass, which is why it is off by default (docs/breakdown.md)."""
    def fetch_sub_module(module, *args, **kwargs):
        if not module._parameters:
            return fetch(module, *args, **kwargs)
        clock.enter("dp_comm")
        try:
            return fetch(module, *args, **kwargs)
        finally:
            clock.exit()

    return fetch_sub_module


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


def _mark_experts(clock: StepClock, chunks, undo: list) -> None:
    """The expert loop of every MoE layer is `experts`: a step of an MoE model shows its share.
    Its forward lies between the module's pre-hook and hook; its backward, when autograd runs
    one, from the gradient reaching its output to the gradient of its input (tensor hooks,
    set only where both ends get a gradient, so every enter has its exit)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    def after(module, args, output) -> None:
        clock.exit()
        tokens, out = args[0], output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and tokens.requires_grad and out.requires_grad:
            out.register_hook(lambda grad: clock.enter("experts"))
            tokens.register_hook(lambda grad: clock.exit())

    handles = []
    for module in (m for chunk in chunks for m in _expert_loops(chunk, SequentialMLP)):
        handles.append(module.register_forward_pre_hook(lambda m, a: clock.enter("experts")))
        handles.append(module.register_forward_hook(after))
    undo.append(lambda: [handle.remove() for handle in handles])


_EXPERT_LOOPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _expert_loops(chunk, loop_class) -> tuple:
    """The chunk's expert loops, found once (a model's modules do not change between steps;
    walking them at every step would cost each step of a dense model for nothing)."""
    if chunk not in _EXPERT_LOOPS:
        _EXPERT_LOOPS[chunk] = tuple(m for m in chunk.modules() if isinstance(m, loop_class))
    return _EXPERT_LOOPS[chunk]


class _RecomputeMarks:
    """Megatron-Core's CheckpointFunction.backward, replaced once: while `clock` is set (inside
    a step's `marking`), the forward a checkpointed segment runs again inside its backward is
    `recompute`; the rest of that backward stays `backward`. Otherwise it is Megatron's."""

    def __init__(self):
        self.clock: StepClock | None = None
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        from megatron.core.tensor_parallel.random import CheckpointFunction

        original = vars(CheckpointFunction)["backward"].__func__

        def backward(ctx, *grads):
            clock = self.clock
            if clock is None:
                return original(ctx, *grads)
            run = ctx.run_function
            ctx.run_function = _timed(clock, "recompute", run)
            try:
                return original(ctx, *grads)
            finally:
                ctx.run_function = run

        CheckpointFunction.backward = staticmethod(backward)
        self._installed = True

    def stop(self) -> None:
        self.clock = None


RECOMPUTE = _RecomputeMarks()
