"""`dsforge run --max-restarts` (launch/restart.py): what is retried and what is not, what a
restart sets aside, and the loop's budget, refusals and job word. The whole job killed and
brought back: tests/distributed/test_restarts.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import torch

from dsforge.job import failure
from dsforge.job.failure import Failure
from dsforge.job.heartbeat import Heartbeat
from dsforge.job.pids import write_pid
from dsforge.job.run_dir import RunDir, set_aside
from dsforge.job.signals import EXIT_NONFINITE, EXIT_RESUMABLE
from dsforge.job.word import JobSpec
from dsforge.launch.refusal import Refused
from dsforge.launch.restart import decide, run_with_restarts
from dsforge.problems import Problem
from dsforge.runtime.guard.record import record_for
from tests.unit.helpers.checkpoints import fake_checkpoint


def _record(run_dir: RunDir, kind: str, *, rank: int = 1, step: int = 5,
            message: str = "boom") -> None:
    failure.write(run_dir, Failure(rank=rank, step=step, kind=kind, message=message))


@pytest.mark.parametrize("kind", ["killed", "stopped", "hang", "collective", "device"])
def test_passing_faults_are_retried(tmp_path, kind):
    run_dir = RunDir(tmp_path)
    _record(run_dir, kind)
    verdict = decide(1, run_dir, earlier=[])
    assert verdict.retry and verdict.cause.kind == kind


@pytest.mark.parametrize("kind, why", [("exception", "repeats"), ("build", "build"),
                                       ("oom", "out-of-memory"), ("nonfinite", "went bad")])
def test_faults_that_would_repeat_are_not_retried(tmp_path, kind, why):
    run_dir = RunDir(tmp_path)
    _record(run_dir, kind)
    verdict = decide(1, run_dir, earlier=[])
    assert not verdict.retry and why in verdict.why


@pytest.mark.parametrize("code, why", [(130, "Ctrl-C"), (143, "SIGTERM"), (129, "SIGHUP"),
                                       (EXIT_RESUMABLE, "requeue"), (EXIT_NONFINITE, "went bad"),
                                       (124, "--timeout")])
def test_stops_somebody_asked_for_are_not_retried(tmp_path, code, why):
    run_dir = RunDir(tmp_path)
    _record(run_dir, "killed")  # e.g. what a peer recorded while the job was stopped
    verdict = decide(code, run_dir, earlier=[])
    assert not verdict.retry and why in verdict.why


def test_the_same_failure_at_the_same_step_twice_is_not_retried(tmp_path):
    run_dir = RunDir(tmp_path)
    _record(run_dir, "device", step=7, message="CUDA error: an illegal memory access")
    earlier = [{"kind": "device", "step": 7, "message": "CUDA error: an illegal memory access"}]
    verdict = decide(1, run_dir, earlier)
    assert not verdict.retry and "same failure came back at step 8" in verdict.why
    elsewhere = [{**earlier[0], "step": 3}]
    assert decide(1, run_dir, elsewhere).retry


def test_a_rank_gone_without_a_record_is_retried_and_no_rank_started_is_not(tmp_path):
    run_dir = RunDir(tmp_path)
    assert not decide(1, run_dir, []).retry  # the launcher failed before any rank
    for rank in (0, 1):
        write_pid(run_dir, rank, "node7", 100 + rank)
    run_dir.rank_summary(0).write_text("{}")  # rank 0 finished; rank 1 left nothing
    heartbeat = Heartbeat(run_dir, 1)
    heartbeat.beat(4)
    heartbeat.flush()
    verdict = decide(1, run_dir, [])
    assert verdict.retry
    assert (verdict.cause.rank, verdict.cause.step) == (1, 4)
    assert "node7" in verdict.cause.message


@pytest.mark.parametrize("exc, kind", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"),
     "collective"),
    (torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system "
                                        "error"), "collective"),
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), "device"),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), "device"),
    (ValueError("bad shape"), "exception"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "exception"),
])
def test_a_ranks_exception_is_recorded_with_its_kind(exc, kind):
    assert record_for(exc, rank=0, step=3, detail="").kind == kind


def test_a_collective_failure_raised_from_inside_is_still_one():
    try:
        try:
            raise torch.distributed.DistNetworkError("Connection closed by peer")
        except RuntimeError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert record_for(outer, rank=0, step=3, detail="").kind == "collective"


def test_a_restart_sets_the_failed_attempts_records_aside(tmp_path):
    run_dir = RunDir(tmp_path)
    _record(run_dir, "killed")
    write_pid(run_dir, 1, "here", 123)
    run_dir.metrics.write_text('{"step": 0}\n')
    run_dir.job_log.write_text("log\n")
    kept = set_aside(run_dir)
    assert kept == run_dir.attempt(1)
    assert not run_dir.failures.exists() and not run_dir.ranks.exists()
    assert failure.first(kept).kind == "killed" and kept.pid_file(1).exists()
    assert run_dir.metrics.exists()  # resumed: the steps before the checkpoint stay


def test_a_restart_from_the_start_leaves_only_the_log_and_the_recipe(tmp_path):
    run_dir = RunDir(tmp_path)
    _record(run_dir, "hang")
    for path in (run_dir.metrics, run_dir.manifest, run_dir.job_log, run_dir.recipe):
        path.write_text("x\n")
    (run_dir.checkpoints / "step00000002").mkdir(parents=True)  # a save that never finished
    set_aside(run_dir, everything=True)
    run_dir.metrics.write_text("x\n")  # a second attempt, also before any checkpoint
    assert set_aside(run_dir, everything=True) == run_dir.attempt(2)
    assert sorted(p.name for p in run_dir.path.iterdir()) == ["attempts", "job.log", "recipe.yaml"]
    assert run_dir.attempt(1).metrics.exists() and run_dir.attempt(1).checkpoints.exists()


class _Attempts:
    """Fake attempts: each call of a start records the given failure and returns its code."""

    def __init__(self, run_dir: RunDir, outcomes: list[tuple[int, str | None, int]]):
        self.run_dir, self.outcomes, self.jobs = run_dir, list(outcomes), []

    def start(self, job: JobSpec):
        def go() -> int:
            self.jobs.append(job)
            code, kind, step = self.outcomes.pop(0)
            if kind:
                _record(self.run_dir, kind, step=step, message=f"{kind} at {step}")
            return code
        return go


def _job(run_dir: RunDir) -> JobSpec:
    return JobSpec(recipe_yaml="", run_dir=str(run_dir), started_at=1000.0)


def test_restarts_continue_the_same_job_until_it_succeeds(tmp_path):
    run_dir = RunDir(tmp_path)
    attempts = _Attempts(run_dir, [(1, "killed", 2), (1, "collective", 5), (0, None, 0)])
    said = []
    job = _job(run_dir)
    code = run_with_restarts(job, attempts.start(job), max_restarts=3,
                             prepare=attempts.start, say=said.append)
    assert code == 0
    first, second, third = attempts.jobs
    assert (second.resume, third.resume) == (False, False)  # no checkpoint: from the start
    assert [r["kind"] for r in third.restarts] == ["killed", "collective"]
    assert {j.started_at for j in attempts.jobs} == {1000.0}  # time_limit from the first start
    assert third.launched_at > 1000.0
    assert "finished after 2 restarts" in said[-1]
    assert run_dir.attempt(2).failures.exists()


def test_a_used_up_budget_ends_with_the_last_failure(tmp_path):
    run_dir = RunDir(tmp_path)
    attempts = _Attempts(run_dir, [(1, "killed", 2), (1, "hang", 4)])
    said = []
    job = _job(run_dir)
    code = run_with_restarts(job, attempts.start(job), max_restarts=1, prepare=attempts.start,
                             say=said.append)
    assert code == 1 and len(attempts.jobs) == 2
    assert "--max-restarts 1 is used up" in said[-1]
    assert failure.first(run_dir).kind == "hang"  # the last failure stays where reports look


def test_a_restart_that_no_longer_fits_is_refused_and_nothing_moves(tmp_path):
    run_dir = RunDir(tmp_path)
    attempts = _Attempts(run_dir, [(1, "device", 2)])
    said = []

    def no_longer_fits(job):
        raise Refused("tiny.yaml does not fit this machine (1 GPU)",
                      [Problem(rule="F1", fields={"world": 2}, message="2 ranks need 2 GPUs")])

    job = _job(run_dir)
    code = run_with_restarts(job, attempts.start(job), max_restarts=2, prepare=no_longer_fits,
                             say=said.append)
    assert code == 1
    assert said[-1].startswith("dsforge: not restarted: tiny.yaml does not fit this machine")
    assert "2 ranks need 2 GPUs" in said[-1]
    assert not run_dir.attempts.exists() and failure.first(run_dir).kind == "device"


def test_a_checkpoint_makes_the_restart_a_resume(tmp_path):
    run_dir = RunDir(tmp_path)
    fake_checkpoint(run_dir.path, step=3)
    attempts = _Attempts(run_dir, [(1, "killed", 4), (0, None, 0)])
    job = _job(run_dir)
    assert run_with_restarts(job, attempts.start(job), max_restarts=1, prepare=attempts.start,
                             say=lambda line: None) == 0
    restarted = attempts.jobs[1]
    assert restarted.resume and restarted.restarts[0]["resumed_after_step"] == 3
    assert run_dir.checkpoints.exists()  # a resume keeps them
    assert json.loads(json.dumps(restarted.restarts))  # the job word carries them


def test_without_restarts_nothing_is_said_or_moved(tmp_path):
    run_dir = RunDir(tmp_path)
    attempts = _Attempts(run_dir, [(1, "killed", 2)])
    said = []
    job = _job(run_dir)
    assert run_with_restarts(job, attempts.start(job), max_restarts=0, prepare=attempts.start,
                             say=said.append) == 1
    assert said == [] and not run_dir.attempts.exists()


def test_sbatch_passes_the_restarts_to_its_dsforge_run(tmp_path):
    from dsforge.launch.sbatch import write_batch_script
    from tests.conftest import REPO

    shown = []
    write_batch_script(str(REPO / "recipes" / "tiny.yaml"), nodes=1, gpus_per_node=0,
                       time_limit="10:00", partition=None, account=None, signal_grace=60,
                       run_dir=tmp_path / "run", out=None, overrides=(), say=shown.append,
                       show=shown.append, max_restarts=2)
    run_line = next(line for line in shown[0].splitlines() if line.startswith("ARGS=("))
    assert "--max-restarts 2" in run_line


def _word(command: list[str]) -> JobSpec:
    return JobSpec.decode(command[command.index("--job") + 1])


def test_a_local_restart_starts_the_same_job_word_on_a_new_port(tmp_path):
    from dsforge.launch.starts import DeepSpeedStarts, RunOptions
    from dsforge.recipe import resolve_file
    from tests.conftest import REPO

    recipe = str(REPO / "recipes" / "tiny.yaml")
    options = RunOptions(recipe=recipe, max_restarts=2)
    starts = DeepSpeedStarts(options, resolve_file(recipe), say=lambda line: None)
    job = _job(RunDir(tmp_path))
    first = starts.first(job)
    again = starts.again(dataclasses.replace(job, resume=True, restarts=[{"attempt": 1}]))
    port = lambda command: command[command.index("--master_port") + 1]  # noqa: E731
    assert port(first.command) != port(again.command)
    assert not first.through_runner and not again.through_runner  # dsforge's own launcher
    assert (_word(first.command).resume, _word(again.command).resume) == (False, True)
    assert _word(again.command).started_at == job.started_at
    fixed = DeepSpeedStarts(dataclasses.replace(options, master_port=29555), resolve_file(recipe),
                             say=lambda line: None)
    assert port(fixed.again(job).command) == "29555"  # --master-port is kept


def test_only_deepspeeds_runner_gets_the_runners_environment(tmp_path):
    """Over a hostfile the start says it goes through DeepSpeed's runner, for which
    launch_and_watch leaves out what the runner would paste into a shell unquoted
    (runner_env); dsforge's own launcher gets the environment as it is (above)."""
    from dsforge.launch.starts import DeepSpeedStarts, RunOptions
    from dsforge.recipe import resolve_file
    from tests.conftest import REPO

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    recipe = str(REPO / "recipes" / "tiny.yaml")
    options = RunOptions(recipe=recipe, hostfile=str(hostfile), dry_run=True)
    start = DeepSpeedStarts(options, resolve_file(recipe, hostfile=hostfile),
                            say=lambda line: None).first(_job(RunDir(tmp_path / "run")))
    assert start.through_runner and "deepspeed.launcher.runner" in start.command


@pytest.mark.parametrize("through_runner", [False, True])
def test_launch_and_watch_gives_the_runners_environment_only_through_the_runner(
        tmp_path, monkeypatch, through_runner):
    """What the start plan says reaches the job's environment: DeepSpeed's runner gets its
    .deepspeed_env lookup pointed at nothing and loses a value it would paste unquoted."""
    from dsforge.launch import start

    seen = {}

    def fake_run_job(command, *, env, **_):
        seen.update(env)
        return 1

    monkeypatch.setattr(start, "run_job", fake_run_job)
    monkeypatch.setenv("PYTHONPATH", "/a b/$(id)")
    lines = []
    start.launch_and_watch(["true"], RunDir(tmp_path), 1, timeout=None, verbose=False,
                           say=lines.append, through_runner=through_runner)
    assert ("DS_ENV_FILE" in seen) is through_runner
    assert ("PYTHONPATH" in seen) is not through_runner
    assert any("PYTHONPATH is forwarded inside the job" in line for line in lines) is through_runner


def test_nothing_to_set_aside_makes_no_attempt(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.metrics.write_text("x\n")  # a resume keeps the steps before its checkpoint
    assert set_aside(run_dir) is None and not run_dir.attempts.exists()


def test_a_ranks_own_error_behind_its_aborted_peers_is_not_retried(tmp_path):
    """NCCL's watchdog aborts the peers of a rank that raised: their supervisors record
    "killed by SIGABRT", listed first, but the job is not worth starting again."""
    run_dir = RunDir(tmp_path)
    _record(run_dir, "killed", rank=1, message="killed by SIGABRT")
    _record(run_dir, "oom", rank=0)
    verdict = decide(1, run_dir, [])
    assert not verdict.retry and verdict.cause.kind == "oom"


def test_a_stop_somebody_asked_for_is_never_retried(tmp_path):
    """A rank that fails while the job saves and stops on SIGTERM: its failure is not a reason
    to start again."""
    from dsforge.launch.local import StopAsked

    run_dir = RunDir(tmp_path)
    _record(run_dir, "collective")
    asked = StopAsked()
    asked.note(signal.SIGTERM)
    asked.note(signal.SIGINT)  # the first one is kept
    verdict = decide(1, run_dir, [], asked)
    assert not verdict.retry and verdict.why == "SIGTERM asked dsforge to stop"


def test_the_same_failure_with_other_ports_and_times_is_the_same(tmp_path):
    run_dir = RunDir(tmp_path)
    _record(run_dir, "collective", step=7, message="Read error [127.0.0.1]:44691 after 1200ms")
    earlier = [{"kind": "collective", "step": 7, "message": "Read error [127.0.0.1]:39001 after 987ms"}]
    assert not decide(1, run_dir, earlier).retry


@pytest.mark.parametrize("checkpoint, code", [(False, 128 + signal.SIGTERM), (True, EXIT_RESUMABLE)])
def test_a_stop_between_two_attempts_ends_the_job(tmp_path, checkpoint, code):
    run_dir = RunDir(tmp_path)
    if checkpoint:
        fake_checkpoint(run_dir.path, step=3)
    attempts = _Attempts(run_dir, [(1, "killed", 4)])
    said = []

    def signalled(job):  # SIGTERM while the restart is being checked (a preflight's seconds)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the restart")

    job = _job(run_dir)
    assert run_with_restarts(job, attempts.start(job), max_restarts=2, prepare=signalled,
                             say=said.append) == code
    assert "SIGTERM received before the restart: not restarted" in said[-1]
    assert len(attempts.jobs) == 1


def test_a_restart_waits_for_the_failed_attempts_processes(tmp_path):
    import subprocess
    import sys

    from dsforge.launch.restart import NotRestarted, _wait_gone
    from dsforge.lock import JOB_DIR_ENV

    run_dir = RunDir(tmp_path)
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, JOB_DIR_ENV: str(run_dir.absolute())})
    try:
        time.sleep(0.3)  # its environment is readable once it runs
        with pytest.raises(NotRestarted, match=f"still run after 1s .PIDs {left.pid}"):
            _wait_gone(run_dir, within_s=1)
    finally:
        left.kill()
        left.wait()
    _wait_gone(run_dir, within_s=1)


def test_timeout_counts_every_attempt():
    from dsforge.launch.entry import _JobClock
    from dsforge.launch.restart import NotRestarted

    clock = _JobClock(0.2)
    assert 0 < clock.left() <= 0.2
    time.sleep(0.25)
    with pytest.raises(NotRestarted, match="--timeout 0.2s is used up"):
        clock.check()
    _JobClock(None).check()


def test_a_job_that_fails_for_good_after_restarts_writes_its_summary(tmp_path):
    """The restarts, each cause and the final failure, with the ranks' summary's keys
    (issue 48, item 5)."""
    run_dir = RunDir(tmp_path)
    attempts = _Attempts(run_dir, [(1, "killed", 2), (1, "hang", 4)])
    job = _job(run_dir)
    assert run_with_restarts(job, attempts.start(job), max_restarts=1, prepare=attempts.start,
                             say=lambda line: None) == 1
    summary = json.loads(run_dir.summary.read_text())
    assert summary["restarts"] == 1
    assert [(c["attempt"], c["kind"], c["step"]) for c in summary["restart_causes"]] == \
        [(1, "killed", 2)]
    final = summary["failure"]
    assert (final["attempt"], final["kind"], final["step"], final["exit_code"]) == (2, "hang", 4, 1)
    assert final["cause"] == "rank 1 stuck at step 5: hang at 4"
    assert "--max-restarts 1 is used up" in final["not_restarted"]
    assert set(summary["restart_causes"][0]) >= set(final) - {"exit_code", "not_restarted"}


@pytest.mark.parametrize("outcomes, max_restarts, summary", [
    ([(1, "killed", 2)], 0, False),  # no restart: nothing but the ranks writes a summary
    ([(1, "killed", 2), (1, "exception", 3)], 2, True),  # not retried after a restart
    ([(1, "killed", 2), (EXIT_RESUMABLE, None, 0)], 2, False),  # the ranks stopped: theirs
])
def test_the_launcher_writes_a_summary_only_for_endings_the_ranks_do_not(tmp_path, outcomes,
                                                                       max_restarts, summary):
    run_dir = RunDir(tmp_path)
    attempts = _Attempts(run_dir, outcomes)
    job = _job(run_dir)
    run_with_restarts(job, attempts.start(job), max_restarts=max_restarts,
                      prepare=attempts.start, say=lambda line: None)
    assert run_dir.summary.exists() == summary


def test_a_stop_between_attempts_after_restarts_keeps_them_in_the_summary(tmp_path):
    run_dir = RunDir(tmp_path)
    fake_checkpoint(run_dir.path, step=3)
    attempts = _Attempts(run_dir, [(1, "killed", 4), (1, "collective", 6)])
    calls = []

    def second_restart_signalled(job):
        calls.append(job)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        return attempts.start(job)

    job = _job(run_dir)
    assert run_with_restarts(job, attempts.start(job), max_restarts=3,
                             prepare=second_restart_signalled,
                             say=lambda line: None) == EXIT_RESUMABLE
    summary = json.loads(run_dir.summary.read_text())
    assert summary["restarts"] == 1 and summary["failure"]["kind"] == "collective"
    assert summary["failure"]["not_restarted"] == "SIGTERM received before the restart"


def test_a_stop_just_before_an_attempts_launcher_stops_that_attempt(tmp_path):
    """The moment after a restart's checks, before its launcher starts (issue 48, item 9): the
    signal is noted, not left to its default action (this process dead, the launcher without
    its owner), and the attempt is stopped as soon as it runs."""
    import sys

    from dsforge.launch import local

    run_dir = RunDir(tmp_path)
    attempts = _Attempts(run_dir, [(1, "killed", 2)])
    started, asked = [], local.StopAsked()  # one for the job's attempts, as launch() has

    def attempt_signalled_as_it_starts(job):
        def go():
            started.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
            return local.run_job([sys.executable, "-c", "import time; time.sleep(60)"],
                                 timeout_s=60, asked=asked)
        return go

    job = _job(run_dir)
    code = run_with_restarts(job, attempts.start(job), max_restarts=1,
                             prepare=attempt_signalled_as_it_starts, say=lambda line: None,
                             asked=asked)
    assert code == 128 + signal.SIGTERM and len(started) == 1
    assert time.monotonic() - started[0] < local.GRACE_S + 5  # not the 60 s it would run
    assert json.loads(run_dir.summary.read_text())["failure"]["not_restarted"] == \
        "SIGTERM asked dsforge to stop"
