"""The step breakdown's pure parts (docs/breakdown.md): exclusive attribution of nested phases,
Megatron's and DeepSpeed's timers on the clock, reading without waiting, the engine hooks and
their removal, the summaries, the report's table and plot, the profiler's trace of steps A..B
and `dsforge run --profile`. tests/distributed/test_breakdown.py runs it in real layouts."""

from __future__ import annotations

import gzip
import inspect
import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from dsforge.bench.report import write_report
from dsforge.bench.store import Row, Store
from dsforge.cli import main
from dsforge.job.metrics_file import PHASES, median_breakdown
from dsforge.job.run_dir import RunDir
from dsforge.runtime.loop import breakdown, phase_hooks
from dsforge.runtime.loop.breakdown import Marked, StepClock, StepTimings
from dsforge.runtime.loop.metrics import MetricsWriter, format_breakdown, make_record
from dsforge.runtime.loop.profiler import StepProfiler, trace_path
from dsforge.runtime.loop.timers import PhaseTimers, bubble_share, optimizer_phase, schedule_phase
from tests.conftest import REPO


class ScriptedTime:
    """A host marker whose clock reads the given times, one per mark."""

    def __init__(self, times):
        self.times = list(times)

    def take(self):
        return self.times.pop(0)

    ready = staticmethod(breakdown.HostMarker.ready)
    seconds = staticmethod(breakdown.HostMarker.seconds)


def _clock(times) -> StepClock:
    return StepClock(torch.device("cpu"), marker=ScriptedTime(times))


def test_nested_phases_count_only_in_the_innermost_and_other_is_the_rest():
    clock = _clock([0, 1, 3, 4, 6, 6, 7, 8, 10, 11])
    clock.start()                      # 0
    with clock.phase("forward"):       # 1 .. 6
        with clock.phase("dp_comm"):   # 3 .. 4: a gather inside the forward
            pass
    with clock.phase("backward"):      # 6 .. 10
        with clock.phase("recompute"):  # 7 .. 8
            pass
    reading = clock.stop().read(step_time_s=12.0)  # 11; the step ends at 12
    assert reading.phases == {"data": 0.0, "forward": 4.0, "backward": 3.0, "recompute": 1.0,
                              "experts": 0.0, "optimizer": 0.0, "dp_comm": 1.0,
                              "pipeline_wait": 0.0, "guard": 0.0, "other": 3.0}
    assert sum(reading.phases.values()) == 12.0 and reading.marks == 10


def test_the_same_phase_nested_takes_no_mark_and_outside_a_step_nothing_is_marked():
    clock = _clock([0, 1, 5, 6])
    clock.enter("forward")  # no step running: ignored
    clock.exit()
    clock.start()
    with clock.phase("dp_comm"):
        with clock.phase("dp_comm"):  # a bucket reduced inside allreduce_gradients
            pass
    reading = clock.stop().read(step_time_s=6.0)
    assert reading.phases["dp_comm"] == 4.0 and reading.marks == 4


def test_marks_that_do_not_pair_up_leave_the_step_unread_not_the_run_ended():
    """A phase left open, or left twice (a hook firing without its partner), is a measuring
    bug: that step has no reading and says why; the next step is measured again."""
    clock = _clock(range(20))
    clock.start()
    clock.enter("forward")
    assert clock.stop() is None and "forward" in clock.problem
    clock.start()
    clock.exit()
    with clock.phase("backward"):
        pass
    assert clock.stop() is None and clock.problem == "a phase was left that was never entered"
    clock.start()
    with clock.phase("backward"):
        pass
    assert clock.stop().read(step_time_s=100.0).phases["backward"] > 0 and clock.problem is None


def test_a_long_run_keeps_a_bounded_number_of_readings():
    clock, timings = _clock(range(1000)), StepTimings(kept=3)
    for step in range(5):
        clock.start()
        timings.add(step, clock.stop(), step_time_s=10.0)
    assert list(timings.readings) == [2, 3, 4]


def test_megatron_schedule_timers_mark_phases_spans_and_the_bubble():
    clock = _clock([0, 0, 1, 3, 3, 5, 5, 8, 10, 10])
    timers = PhaseTimers(clock, schedule_phase)
    clock.start()                                                   # 0
    timers("forward-backward", log_level=1).start(barrier=True)     # 0
    timers("forward-compute", log_level=2).start()                  # 1
    timers("forward-compute").stop()                                # 3
    timers("backward-recv", log_level=2).start()                    # 3: waiting on the next stage
    timers("backward-recv").stop()                                  # 5
    timers("backward-compute", log_level=2).start()                 # 5
    timers("backward-compute").stop()                               # 8
    timers("forward-backward").stop()                               # 10
    timers("all-grads-sync").start()  # a timer of no phase marks nothing
    timers("all-grads-sync").stop()
    reading = clock.stop().read(step_time_s=10.0)                   # 10
    assert (reading.phases["forward"], reading.phases["backward"]) == (2, 3)
    assert (reading.phases["pipeline_wait"], reading.phases["other"]) == (2, 3)
    assert reading.spans == {"forward-compute": 2, "backward-compute": 3, "forward-backward": 10}
    assert bubble_share(reading) == pytest.approx(0.5)
    assert optimizer_phase("optimizer_allgather") == "dp_comm"
    assert optimizer_phase("optimizer_step") is None


def test_a_reading_waits_for_the_device_only_at_the_end():
    class Pending(ScriptedTime):
        done = False

        def ready(self, marks):
            return self.done

    marker = Pending([])
    timings = StepTimings()
    marked = Marked(marker=marker, marks=[0.0, 2.0], owners=["forward"])
    assert timings.add(3, marked, step_time_s=2.5) is None  # the device is still busy
    marker.done = True
    later = Marked(marker=marker, marks=[0.0, 1.0], owners=["backward"])
    assert timings.add(4, later, 1.0).phases["backward"] == 1.0
    assert timings.readings[3].phases["other"] == 0.5  # read in order once ready
    marker.done = False
    timings.add(5, Marked(marker=marker, marks=[0.0, 1.0], owners=["optimizer"]), 1.0)
    timings.finish()
    assert sorted(timings.readings) == [3, 4, 5]


def test_the_breakdown_is_on_unless_the_environment_says_otherwise():
    assert breakdown.mode({}) == "on" == breakdown.mode({"DSFORGE_BREAKDOWN": ""})
    assert breakdown.mode({"DSFORGE_BREAKDOWN": "OFF"}) == "off"
    assert breakdown.mode({"DSFORGE_BREAKDOWN": "gathers"}) == "gathers"
    with pytest.raises(ValueError, match="use one of on, off, gathers"):
        breakdown.mode({"DSFORGE_BREAKDOWN": "0"})


# --- the hooks into the engines -------------------------------------------------------------

def test_the_engine_hook_points_exist_in_the_pinned_versions():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from megatron.core.tensor_parallel.random import CheckpointFunction

    assert callable(DeepSpeedEngine.allreduce_gradients)
    assert "self.allreduce_gradients()" in inspect.getsource(DeepSpeedEngine._backward_epilogue)
    zero12 = stage_1_and_2.DeepSpeedZeroOptimizer
    assert "self.reduce_ipg_grads(" in inspect.getsource(zero12)
    assert "self.timers(OPTIMIZER_ALLGATHER_TIMER).start()" in inspect.getsource(zero12.step)
    assert stage_1_and_2.OPTIMIZER_ALLGATHER_TIMER == "optimizer_allgather"
    assert hasattr(stage3.DeepSpeedZeroOptimizer_Stage3, phase_hooks.ZERO3_REDUCE)
    assert "fetch_sub_module(" in inspect.getsource(DeepSpeedZeRoOffload.pre_sub_module_forward_function)
    assert callable(DeepSpeedZeRoOffload.get_param_coordinator)
    assert callable(PartitionedParameterCoordinator.fetch_sub_module)
    assert isinstance(vars(CheckpointFunction)["backward"], staticmethod)
    assert "ctx.run_function(*detached_inputs)" in inspect.getsource(CheckpointFunction.backward)


class FakeOptimizer:
    def __init__(self, clock):
        self.timers, self.clock, self.calls = None, clock, []

    def reduce_ipg_grads(self):
        self.calls.append(self.clock.current_phase)

    def step(self):  # as ZeRO-1/2 does: the gather of the updated parameters is timed
        self.timers("optimizer_step").start()
        self.timers("optimizer_step").stop()
        self.timers("optimizer_allgather").start()
        self.calls.append(self.clock.current_phase)
        self.timers("optimizer_allgather").stop()
        self.timers.log(["optimizer_allgather"])


class FakeEngine:
    def __init__(self, clock):
        self.optimizer = FakeOptimizer(clock)

    def allreduce_gradients(self):
        self.optimizer.reduce_ipg_grads()  # nested: still dp_comm, no extra mark


def test_marking_wraps_this_engine_for_one_step_and_restores_everything():
    clock = StepClock(torch.device("cpu"))
    engine = FakeEngine(clock)
    config = SimpleNamespace(timers=None)
    clock.start()
    chunk = torch.nn.Module()  # no MoE layer
    chunk.config = config
    with phase_hooks.marking(clock, engine, [chunk] * 2):
        assert isinstance(config.timers, PhaseTimers)
        assert phase_hooks.RECOMPUTE.clock is clock
        with clock.phase("backward"):
            engine.optimizer.reduce_ipg_grads()  # a bucket full during the backward
            engine.allreduce_gradients()
        with clock.phase("optimizer"):
            engine.optimizer.step()
    reading = clock.stop().read(step_time_s=1.0)
    assert engine.optimizer.calls == ["dp_comm", "dp_comm", "dp_comm"]
    assert reading.phases["dp_comm"] > 0
    assert "allreduce_gradients" not in vars(engine) and "reduce_ipg_grads" not in vars(engine.optimizer)
    assert engine.optimizer.timers is None and config.timers is None
    assert phase_hooks.RECOMPUTE.clock is None


@pytest.mark.parametrize("gathers", [False, True])
def test_zero3_gathers_are_marked_on_request_for_modules_holding_parameters(gathers):
    clock = StepClock(torch.device("cpu"), gathers=gathers)
    seen = []
    coordinator = SimpleNamespace(fetch_sub_module=lambda module, forward: seen.append(clock.current_phase))
    engine = SimpleNamespace(allreduce_gradients=lambda: None, optimizer=SimpleNamespace(
        parameter_offload=SimpleNamespace(get_param_coordinator=lambda: coordinator)))
    layer = torch.nn.Sequential(torch.nn.Linear(2, 2))
    clock.start()
    with phase_hooks.marking(clock, engine, []), clock.phase("forward"):
        coordinator.fetch_sub_module(layer, forward=True)     # a container: nothing to gather
        coordinator.fetch_sub_module(layer[0], forward=True)  # its weights
    if gathers:
        assert seen == ["forward", "dp_comm"] and clock.stop().read(1.0).marks == 6
    else:
        assert seen == ["forward", "forward"] and clock.stop().read(1.0).marks == 4
    assert "fetch_sub_module" in vars(coordinator)  # the coordinator's own attribute, back


def test_recompute_is_the_forward_run_again_inside_a_checkpoints_backward(monkeypatch):
    from megatron.core.tensor_parallel.random import CheckpointFunction

    # Megatron's backward stood in by one that only runs the segment's forward again.
    monkeypatch.setattr(CheckpointFunction, "backward",
                        staticmethod(lambda ctx, *grads: ctx.run_function()))
    marks = phase_hooks._RecomputeMarks()
    marks.install()
    clock = StepClock(torch.device("cpu"))
    seen = []
    ctx = SimpleNamespace(run_function=lambda: seen.append(clock.current_phase))
    run = ctx.run_function
    clock.start()
    with clock.phase("backward"):
        CheckpointFunction.backward(ctx)  # no step's clock set: Megatron's own
        marks.clock = clock
        CheckpointFunction.backward(ctx)
        marks.stop()
    assert clock.stop().read(1.0).phases["recompute"] > 0
    assert seen == ["backward", "recompute"] and ctx.run_function is run


# --- records, summaries, the report ----------------------------------------------------------

def _phases(**ms) -> dict[str, float]:
    return {phase: ms.get(phase, 0.0) / 1e3 for phase in PHASES}


def test_records_summary_and_the_terminal_line_carry_the_breakdown(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for step, forward in enumerate((50.0, 30.0, 40.0)):
        writer.write(make_record(step=step, warmup=step == 0, loss=1.0, grad_norm=None, lr=0.1,
                                 step_time_s=0.1, tokens_per_step=100, world_size=1,
                                 flops_per_token=1.0, hardware_flops_per_token=1.0,
                                 peak_flops=None, device=torch.device("cpu"),
                                 breakdown_s=_phases(forward=forward, backward=50.0,
                                                     other=50.0 - forward)))
    summary = writer.summary()
    assert summary["median_breakdown_s"]["forward"] == pytest.approx(0.035)
    line = format_breakdown(summary)
    assert line.startswith("step breakdown, median ms (share of the 100.0 ms step): ")
    assert "forward 35.0 (35%), backward 50.0 (50%), other 15.0 (15%)" in line
    assert "recompute" not in line  # a phase that took no time is left out
    written = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert set(written["breakdown_s"]) == set(PHASES)
    writer.keep_steps_before(2)  # a resumed run reads the breakdown back
    assert writer.records[1].breakdown_s["forward"] == pytest.approx(0.03)
    assert median_breakdown([None, None]) is None


def test_the_report_shows_where_each_cells_step_goes(tmp_path):
    store = Store(tmp_path / "r.db")
    figures = {"step_times_s": [0.1, 0.1], "tokens_per_s": 1000.0, "tokens_per_s_per_gpu": 500.0,
               "mfu": None, "hfu": None, "final_loss": 2.0, "peak_memory_bytes": 2**30,
               "memory_source": "process peak RSS", "bubble_share_by_stage": {}}
    for repeat, forward in enumerate((40.0, 20.0)):
        store.write(Row(study="s", cell="a", repeat=repeat, axes={"zero.stage": 1}, status="ok",
                        figures={**figures, "breakdown_s": _phases(forward=forward, dp_comm=10.0,
                                                                   other=50.0 - forward)}))
    store.write(Row(study="s", cell="b", repeat=0, axes={"zero.stage": 3}, status="ok",
                    figures=figures))  # measured without a breakdown: not in its table
    store.close()
    report = write_report(tmp_path / "r.db", tmp_path / "out").read_text()
    assert "| zero.stage | step ms | data ms | forward ms |" in report
    assert "| 1 | 100.0 | 0.0 | 30.0 | 0.0 | 0.0 | 0.0 | 0.0 | 10.0 | 0.0 | 0.0 | 20.0 |" in report
    assert "| 3 | 100.0 | 0.0" not in report
    assert "![s-breakdown](s-breakdown.png)" in report
    assert (tmp_path / "out" / "s-breakdown.png").stat().st_size > 1000


# --- the profiler -----------------------------------------------------------------------------

def _train(profiler: StepProfiler, steps: range) -> None:
    weights = torch.randn(64, 64)
    for n in steps:
        with profiler.step(n):
            (weights @ weights).sum()


def _traced_steps(path) -> set[str]:
    events = json.loads(gzip.open(path).read())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("dsforge step")}


def test_the_profiler_traces_exactly_steps_a_to_b(tmp_path):
    said = []
    run_dir = RunDir(tmp_path)
    profiler = StepProfiler(2, 3, start_step=0, run_dir=run_dir, device=torch.device("cpu"),
                            say=said.append)
    _train(profiler, range(6))
    path = trace_path(run_dir, 2, 3)
    assert path.name == "rank0-steps2-3.pt.trace.json.gz"
    assert _traced_steps(path) == {"dsforge step 2", "dsforge step 3"}  # step 1 warmed it up
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert str(path) in said[0] and "ui.perfetto.dev" in said[0]


def test_a_trace_from_the_first_step_and_one_cut_short(tmp_path):
    a, b = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    first = StepProfiler(0, 1, start_step=0, run_dir=a, device=torch.device("cpu"),
                         say=lambda text: None)
    _train(first, range(3))
    assert _traced_steps(trace_path(a, 0, 1)) == {"dsforge step 0", "dsforge step 1"}
    cut = StepProfiler(1, 5, start_step=0, run_dir=b, device=torch.device("cpu"),
                       say=lambda text: None)
    _train(cut, range(3))  # the run stops after step 2
    cut.close()
    assert _traced_steps(trace_path(b, 1, 2)) == {"dsforge step 1", "dsforge step 2"}


def test_run_profile_is_the_recipe_field():
    runner = CliRunner()
    late = runner.invoke(main, ["run", str(REPO / "recipes" / "tiny.yaml"), "--world-size", "2",
                                "--profile", "3:25", "--dry-run"])
    assert late.exit_code == 2 and "tracking.profile='3:25'" in late.output  # R4: 20 steps
    ok = runner.invoke(main, ["run", str(REPO / "recipes" / "tiny.yaml"), "--world-size", "2",
                              "--profile", "3:5", "--dry-run"])
    assert ok.exit_code == 0, ok.output
    assert """--set 'tracking.profile="3:5"'""" in ok.output
    # A planner's profile file given to run's --profile: named as the flag, not the field.
    path = runner.invoke(main, ["run", str(REPO / "recipes" / "tiny.yaml"), "--profile", "h200.yaml"])
    assert path.exit_code == 2 and "--profile 'h200.yaml' is not a step range" in path.output
    assert "--profile 3:5" in path.output and "dsforge plan --search --profile" in path.output


def test_phases_adding_up_to_more_than_their_step_are_called_wrong():
    clock = _clock([0, 1, 2, 3])
    clock.start()
    with clock.phase("forward"):
        pass
    marked = clock.stop()
    assert breakdown.overrun(marked.read(step_time_s=3.0), 7, 3.0) is None
    wrong = Marked(marker=breakdown.HostMarker(), marks=[0.0, 1.0, 3.0], owners=["forward", "backward"])
    problem = breakdown.overrun(wrong.read(step_time_s=2.0), 7, 2.0)
    assert "phases of step 8 add up to 3000.000 ms, more than the step's 2000.000 ms" in problem
    # every reading is checked where it is made, a late one (a rank without the loss) too
    timings = StepTimings()
    timings.add(6, marked, step_time_s=3.0)
    assert timings.problem is None
    timings.add(7, wrong, step_time_s=2.0)
    assert timings.problem == problem
