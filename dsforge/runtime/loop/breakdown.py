"""Where a step's time goes: exclusive seconds per named phase, measured without a host sync.

A StepClock takes a mark at each phase boundary: on a GPU a CUDA event recorded on the current
stream, so an interval is how long the compute stream spent in that phase, host launches and
waits for other streams included; on a CPU `time.perf_counter()`. Each interval between two
marks belongs to the phase innermost at the time: nested phases subtract from their parent
(a ZeRO gather inside a forward counts as dp_comm, not forward). "other" is the step's
time outside every named phase, so the phases sum to the step's time. The events are read
once the device has passed the step's last mark (StepTimings), which the host's read of the
step's guard all-reduce (runtime/guard/health.py) guarantees on every rank; a reading that is
not ready then is read a step later rather than synchronised. Megatron-LM's timers
synchronise the device instead; torchtitan profiles.

Phase names: dsforge.job.metrics_file.PHASES. DSFORGE_BREAKDOWN in the ranks' environment: `on`
(the default), `off` (no clock: the overhead benchmark's other side,
benchmarks/overhead/README.md), or `gathers`: also ZeRO-3's gather of each module's parameters
as dp_comm, at two marks per module per pass (off by default: measured at 1-2% of a step).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dsforge.job.metrics_file import PHASES
from dsforge.job.steps import step_text

OTHER = "other"
# Steps whose readings a rank keeps for its summary's medians (ranks/*.json): ~10 MB at most.
KEPT_READINGS = 10_000
ENV = "DSFORGE_BREAKDOWN"
MODES = ("on", "off", "gathers")


def mode(environ=os.environ) -> str:
    """DSFORGE_BREAKDOWN's value: on, off or gathers; ValueError for anything else."""
    value = environ.get(ENV, "on").strip().lower() or "on"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(MODES)}")
    return value


@dataclass(frozen=True)
class Reading:
    """One step: seconds per phase (every name of PHASES; the phases sum to the step's time),
    inclusive seconds per span (Megatron's schedule timers), and how many marks it took."""
    phases: dict[str, float]
    spans: dict[str, float]
    marks: int


# How far the named phases may exceed their step before the reading is called wrong: the
# device's clock and the host's disagree by a timer tick, not by more.
TOLERANCE = 1e-3


def overrun(reading: Reading, step: int, step_time_s: float) -> str | None:
    """What is wrong with a reading whose named phases add up to more than the step they are
    part of (its `other` negative beyond TOLERANCE of the step); None when it is right."""
    if reading.phases[OTHER] >= -TOLERANCE * step_time_s:
        return None
    named = step_time_s - reading.phases[OTHER]
    return (f"step breakdown: the phases of {step_text(step)} add up to {named * 1e3:.3f} ms, more "
            f"than the step's {step_time_s * 1e3:.3f} ms; its breakdown_s is not right")


class HostMarker:
    take = staticmethod(time.perf_counter)

    @staticmethod
    def ready(marks: list) -> bool:
        return True

    @staticmethod
    def seconds(marks: list[float]) -> list[float]:
        return [t - marks[0] for t in marks]


class CudaMarker:
    """CUDA events with timing, recorded on the current stream; reused once read."""

    def __init__(self):
        self._free: list[torch.cuda.Event] = []

    def take(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def ready(marks: list) -> bool:
        return marks[-1].query()

    def seconds(self, marks: list) -> list[float]:
        marks[-1].synchronize()  # at once when ready(): the caller waited for the device already
        first = marks[0]
        times = [0.0] + [first.elapsed_time(event) / 1e3 for event in marks[1:]]
        self._free.extend(marks)
        return times


@dataclass
class Marked:
    """One step's marks: `owners[i]` is the phase of the interval ending at mark i + 1."""
    marker: HostMarker | CudaMarker
    marks: list = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    spans: list[tuple[str, int, int]] = field(default_factory=list)

    def ready(self) -> bool:
        return self.marker.ready(self.marks)

    def read(self, step_time_s: float) -> Reading:
        times = self.marker.seconds(self.marks)
        phases = dict.fromkeys(PHASES, 0.0)
        for owner, begin, end in zip(self.owners, times, times[1:]):
            phases[owner] += end - begin
        phases[OTHER] = step_time_s - sum(v for k, v in phases.items() if k != OTHER)
        spans: dict[str, float] = {}
        for name, begin, end in self.spans:
            spans[name] = spans.get(name, 0.0) + times[end] - times[begin]
        return Reading(phases=phases, spans=spans, marks=len(self.marks))


class StepClock:
    """Marks phase boundaries within one step: start(), enter(phase)/exit() (nested freely),
    stop() -> Marked. Outside start()..stop() enter and exit do nothing (evaluation,
    checkpoints). With `span`, enter/exit also time that name inclusively. `gathers`: the
    engine hooks also mark ZeRO-3's per-module gathers (runtime/loop/phase_hooks.py)."""

    def __init__(self, device: torch.device, *, gathers: bool = False, marker=None):
        self.gathers = gathers
        # `marker`: what takes and reads the marks (tests script the times)
        self._marker = marker or (CudaMarker() if device.type == "cuda" else HostMarker())
        self._step: Marked | None = None
        self._stack: list[str] = []
        self._open: dict[str, int] = {}
        self._contexts: dict[str, _Phase] = {}

    @property
    def current_phase(self) -> str:
        """The innermost phase entered and not left."""
        return self._stack[-1]

    def start(self) -> None:
        self._step = Marked(marker=self._marker)
        self._stack, self._open = [OTHER], {}
        self.problem: str | None = None  # why this step's marks do not pair up
        self._step.marks.append(self._marker.take())

    def enter(self, phase: str, span: str | None = None) -> None:
        if self._step is None:
            return
        if span or phase != self._stack[-1]:  # the same phase nested needs no mark
            self._take(self._stack[-1])
        self._stack.append(phase)
        if span:
            self._open[span] = len(self._step.marks) - 1

    def exit(self, span: str | None = None) -> None:
        if self._step is None:
            return
        if len(self._stack) < 2:  # a hook fired without its partner: this step is not read
            self.problem = "a phase was left that was never entered"
            return
        phase = self._stack.pop()
        if span or phase != self._stack[-1]:
            self._take(phase)
        if span:
            self._step.spans.append((span, self._open.pop(span), len(self._step.marks) - 1))

    def stop(self) -> Marked | None:
        """The step's marks; None when they do not pair up (an exit without its enter, or a
        phase still open), with `problem` saying how: the step trains on, unread. Measuring
        must never end a run."""
        step, self._step = self._step, None
        if self._stack != [OTHER] and self.problem is None:
            self.problem = f"phases {self._stack[1:]} entered and not left"
        if self.problem is not None:
            return None
        step.owners.append(OTHER)
        step.marks.append(self._marker.take())
        return step

    def phase(self, name: str) -> "_Phase":
        """`with clock.phase("forward"): ...`"""
        if name not in self._contexts:
            self._contexts[name] = _Phase(self, name)
        return self._contexts[name]

    def _take(self, owner: str) -> None:
        self._step.owners.append(owner)
        self._step.marks.append(self._marker.take())


class _Phase:
    def __init__(self, clock: StepClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.clock.enter(self.name)

    def __exit__(self, *exc) -> None:
        self.clock.exit()


class _Off:
    """The clock's interface doing nothing: the steps of a run without the breakdown."""

    _NULL = contextlib.nullcontext()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        return None

    def phase(self, name: str) -> contextlib.nullcontext:
        return self._NULL


OFF = _Off()


class StepTimings:
    """Each step's Reading, read once the device has passed the step's last mark. add() reads
    what is ready without waiting; finish() waits for the rest (the end of the run)."""

    def __init__(self, kept: int = KEPT_READINGS):
        self._waiting: deque[tuple[int, Marked, float]] = deque()
        self.readings: dict[int, Reading] = {}  # the newest `kept` steps, oldest first
        self._kept = kept
        self.problem: str | None = None  # the first reading whose phases overran its step

    def add(self, step: int, marked: Marked, step_time_s: float) -> Reading | None:
        """Step `step`'s reading if it is ready now (always on CPU, and after a loss's .item())."""
        self._waiting.append((step, marked, step_time_s))
        self._read(wait=False)
        return self.readings.get(step)

    def finish(self) -> None:
        self._read(wait=True)

    def _read(self, wait: bool) -> None:
        while self._waiting and (wait or self._waiting[0][1].ready()):
            step, marked, step_time_s = self._waiting.popleft()
            self.readings[step] = marked.read(step_time_s)
            self.problem = self.problem or overrun(self.readings[step], step, step_time_s)
            if len(self.readings) > self._kept:  # a long run's memory stays bounded
                del self.readings[next(iter(self.readings))]
