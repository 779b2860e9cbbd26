"""Preemption, time limits and retention without a job: train.time_limit and train.keep_last
in the recipe, the time budget, which checkpoints keep_last deletes, the rank's stop request,
and how `dsforge run` passes a stop request on, waits out its grace or stops at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dsforge.ckpt import retention
from dsforge.ckpt.format import COMPLETE, LATEST
from dsforge.ckpt.trust import tag_for
from dsforge.job.console import MARK
from dsforge.job.pids import write_pid
from dsforge.job.run_dir import RunDir
from dsforge.launch import local
from dsforge.launch.output import JobView
from dsforge.problems import RecipeError
from dsforge.recipe.loader import build_recipe, dump_recipe, load_recipe, parse_yaml
from dsforge.runtime.guard.preempt import Stopped, Stopper, StopRequest, TimeBudget
from dsforge.schema import time_limit_seconds
from tests.conftest import REPO, rule_ids
from tests.unit.helpers.recording_trainer import RecordingTrainer

TINY = REPO / "recipes" / "tiny.yaml"


@pytest.mark.parametrize("value, seconds", [
    (5400, 5400), ("90s", 90), ("45m", 2700), ("3h", 10800), ("2d", 172800), ("1:30", 90),
    ("90:00", 5400), ("01:30:00", 5400), ("2-00:00:00", 172800), ("1-12", 129600),
    ("1-2:30", 95400), (None, None)])
def test_time_limit_forms(value, seconds):
    assert time_limit_seconds(value) == seconds


@pytest.mark.parametrize("value", ["90", "1.5h", "1:75", "1:60:00", "2-24", "-5", "1:2:3:4",
                                   "1h30m", "", True])
def test_time_limits_refused(value):
    with pytest.raises(ValueError):
        time_limit_seconds(value)


def test_time_limit_and_keep_last_in_a_recipe():
    recipe = load_recipe(TINY, ["train.time_limit=1:30:00", "train.keep_last=3"])
    assert recipe.train.time_limit_s == 5400  # YAML 1.1 reads 1:30:00 as 5400 itself
    recipe = load_recipe(TINY, ['train.time_limit="2-00:00:00"'])
    assert recipe.train.time_limit_s == 172800
    again = build_recipe(parse_yaml(dump_recipe(recipe)))  # the job word's round trip
    assert again.train.time_limit == "2-00:00:00"
    assert load_recipe(TINY).train.time_limit_s is None and load_recipe(TINY).train.keep_last == 0


@pytest.mark.parametrize("override, rule", [
    ('train.time_limit="90"', "R3"), ("train.time_limit=0", "R3"), ("train.time_limit=-1", "R3"),
    ("train.time_limit=1.5", "Y2"), ("train.keep_last=-1", "R1")])
def test_bad_time_limit_or_keep_last(override, rule):
    with pytest.raises(RecipeError) as caught:
        load_recipe(TINY, [override])
    assert rule_ids(caught.value) == {rule}


def test_time_budget_keeps_room_for_a_step_and_a_save():
    now = [1000.0]
    budget = TimeBudget(100, started_at=1000.0, eval_iters=2, clock=lambda: now[0])
    for seconds in (1.0, 3.0, 2.0):
        budget.note("step", seconds)
    budget.note("save", 4.0)
    assert budget.reserve_s(False) == pytest.approx(1.5 * (3 + 4) + 5)
    assert budget.reserve_s(True) == pytest.approx(1.5 * (3 + 2 * 3 + 4) + 5)  # eval guessed
    budget.note("eval", 1.0)
    assert budget.reserve_s(True) == pytest.approx(1.5 * (3 + 1 + 4) + 5)
    now[0] = 1000 + 100 - 15.6
    assert not budget.out_of_time(False)
    now[0] = 1000 + 100 - 15.5
    assert budget.out_of_time(False)
    fresh = TimeBudget(100, started_at=1000.0, clock=lambda: 1000.0)
    assert fresh.reserve_s(False) == 1.5 * TimeBudget.FIRST_SAVE_GUESS_S + 5  # no save measured


def test_the_local_answer_of_a_stopper():
    request = StopRequest()
    late = TimeBudget(10, started_at=0.0, clock=lambda: 100.0)
    assert Stopper(request, None).local(False) == (0, 0)
    assert Stopper(request, late).local(False) == (0, 1)
    request.signum = signal.SIGUSR1
    assert Stopper(request, None).local(False) == (int(signal.SIGUSR1), 0)


def test_the_first_stop_signal_asks_the_second_kills():
    """In a process of its own: the handler sets the request; a second signal is deadly."""
    code = textwrap.dedent("""
        import os, signal, time
        from dsforge.runtime.guard.preempt import StopRequest
        request = StopRequest()
        request.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        print("asked", request.signum, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30, cwd=REPO)
    assert result.stdout.split() == ["asked", str(int(signal.SIGUSR1))]
    assert result.returncode == -signal.SIGTERM


def _checkpoint(root, step, *, complete=True):
    directory = root / tag_for(step)
    directory.mkdir(parents=True)
    (directory / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (directory / COMPLETE).write_text(json.dumps(
            {"step": step, "tag": tag_for(step), "world_size": 2, "files": {},
             "recipe": {"name": "tiny", "train": {}}}))
    return directory


def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        _checkpoint(root, step)
    _checkpoint(root, 3, complete=False)  # a save that died: not ours to judge
    _checkpoint(root, 12, complete=False)  # being written after latest
    (root / "step00000014").mkdir()  # empty
    (root / "step00000001").symlink_to(root / tag_for(2))  # a link is never followed
    wrong = _checkpoint(root, 5)
    (wrong / COMPLETE).write_text(json.dumps({"step": 7, "tag": tag_for(7), "world_size": 2,
                                              "recipe": {}}))  # a marker of another tag
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        (root / name).write_text("# DeepSpeed's\n")
    (root / LATEST).write_text(tag_for(8))
    assert retention.to_delete(root, 0) == []
    assert retention.to_delete(root, 2) == [tag_for(2), tag_for(4)]
    assert retention.prune(root, 2) == [tag_for(2), tag_for(4)]
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step00000001", "step00000003", "step00000005", "step00000006",
        "step00000008", "step00000010", "step00000012", "step00000014", "zero_to_fp32.py",
        "zero_to_torch.py"]
    assert retention.prune(root, 1) == [tag_for(6)]  # never latest, nor newer than latest
    assert (root / tag_for(8) / COMPLETE).exists() and (root / tag_for(10)).exists()


def test_keep_last_deletes_nothing_without_a_readable_latest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _checkpoint(root, step)
    assert retention.prune(root, 1) == []  # no latest
    (root / LATEST).write_text("../../elsewhere")
    assert retention.prune(root, 1) == []
    (root / LATEST).write_text(tag_for(9))  # names nothing
    assert retention.prune(root, 1) == []
    assert len(retention.complete_checkpoints(root)) == 3
    assert retention.prune(tmp_path / "missing", 1) == []


def test_a_stopped_rank_is_seen_by_the_job_view():
    view = JobView(out=open(os.devnull, "w"))
    view.feed("host-a: " + MARK + json.dumps({"kind": "stopped", "rank": 1, "step": 6,
                                              "reason": "SIGTERM"}))
    assert view.stopped_ranks == {1: (6, "SIGTERM", True)} and not view.done_ranks


_FAKE_RANKS = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    # argv: RUN_DIR dsforge.runtime.rank: a supervisor and the rank it forks, like supervise.py
    run_dir = Path(sys.argv[1])
    child = os.fork()
    if child == 0:
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        # written then renamed: a reader never sees the file empty
        (run_dir / "child.tmp").write_text(str(os.getpid()))
        os.replace(run_dir / "child.tmp", run_dir / "child")
        while not got:
            time.sleep(0.02)
        (run_dir / "asked").write_text(str(got[0]))
        os._exit(0)
    os.waitpid(child, 0)
""")


def _fake_job(run_dir: RunDir, seconds=0.0, job_word: str | None = None):
    """A stand-in launcher: a supervisor and its rank; the rank writes its pid file.
    `job_word`: the rank's `--job` word, as a real rank's command line has it."""
    word = ["--job", job_word] if job_word else []
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_RANKS, str(run_dir), "dsforge.runtime.rank",
                             *word], start_new_session=True, cwd=REPO)
    deadline = time.monotonic() + 20
    while not (run_dir.path / "child").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child = int((run_dir.path / "child").read_text())
    import socket
    write_pid(run_dir, 0, socket.gethostname(), child)
    write_pid(run_dir, 1, socket.gethostname(), proc.pid)  # a supervisor: never signalled
    write_pid(run_dir, 2, socket.gethostname(), os.getpid())  # not in the job's group
    write_pid(run_dir, 3, "another-host", child)
    return proc, child


def test_signal_ranks_reaches_only_the_jobs_supervised_ranks(tmp_path):
    run_dir = RunDir(tmp_path)
    proc, child = _fake_job(run_dir)
    try:
        assert local.signal_ranks(run_dir, proc.pid, signal.SIGUSR1) == {child}
        assert proc.wait(timeout=20) == 0
        assert (run_dir.path / "asked").read_text() == str(int(signal.SIGUSR1))
    finally:  # its own session: the group holds the supervisor and its rank, even on failure
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_signal_ranks_reaches_this_jobs_ranks_in_another_session(tmp_path):
    """Over a hostfile pdsh starts even this host's ranks through ssh, whose sshd gives them a
    session (and process group) of their own: a rank whose job word names this process as its
    owner is this job's all the same. One another dsforge started into the same run directory
    (--no-ssh nodes on one machine) is not: it gets its own dsforge's request, and a second
    one would kill it unsaved."""
    import base64
    import json

    from dsforge.job.owner import current_owner

    run_dir = RunDir(tmp_path)

    def word(owner: str) -> str:
        spec = {"run_dir": str(tmp_path), "owner": owner}
        return base64.urlsafe_b64encode(json.dumps(spec).encode()).decode()

    for owner, expected in (("node-b:4242:1234", False), (current_owner(), True)):
        proc, child = _fake_job(run_dir, job_word=word(owner))
        try:
            assert local.signal_ranks(run_dir, os.getpgid(0), signal.SIGUSR1) == (
                {child} if expected else set())
            if expected:
                assert proc.wait(timeout=20) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            (run_dir.path / "child").unlink()


def _send_later(*signals, after=0.3):
    def send():
        for sig in signals:
            time.sleep(after)
            os.kill(os.getpid(), sig)
    threading.Thread(target=send, daemon=True).start()


def test_run_job_passes_a_stop_request_to_the_ranks_and_waits(tmp_path, capsys):
    """SIGTERM to dsforge: the ranks get it by pid, the launcher is not signalled, and the
    job's own exit code comes back."""
    script = tmp_path / "launcher.py"
    script.write_text(_FAKE_RANKS)
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    command = [sys.executable, str(script), str(run_dir), "dsforge.runtime.rank"]
    helper = threading.Thread(target=_register_rank_then_stop, args=(run_dir,), daemon=True)
    helper.start()
    code = local.run_job(command, timeout_s=60, run_dir=run_dir, stop_grace_s=30)
    assert code == 0
    assert (run_dir.path / "asked").read_text() == str(int(signal.SIGTERM))
    assert "every rank saves a checkpoint" in capsys.readouterr().err


def _register_rank_then_stop(run_dir: RunDir):
    """Write the rank's pid file as a real rank would, then SIGTERM this process (dsforge):
    the signal is sent only once the rank can be found, however slow the machine."""
    import socket
    deadline = time.monotonic() + 30
    while not (run_dir.path / "child").exists():
        if time.monotonic() > deadline:
            return  # run_job's own timeout then fails the test
        time.sleep(0.02)
    write_pid(run_dir, 0, socket.gethostname(), int((run_dir.path / "child").read_text()))
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("second", [True, False])
def test_a_second_signal_or_the_end_of_the_grace_stops_the_job_at_once(tmp_path, capsys, second):
    """A launcher whose ranks never stop: a second SIGTERM, or the grace running out, ends
    the process group (exit 143) and nothing of it is left."""
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    signals = (signal.SIGTERM, signal.SIGTERM) if second else (signal.SIGTERM,)
    _send_later(*signals)
    started = time.monotonic()
    code = local.run_job(command, timeout_s=60, run_dir=RunDir(tmp_path),
                         stop_grace_s=60 if second else 1)
    assert code == 143 and time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert ("SIGTERM received; stopping every rank" in err) if second else \
        ("did not stop within the grace of 1s" in err)


# srun as Ctrl-C finds it: one SIGINT only reports its tasks; a second within one second
# ends them, and srun with them (srun(1), "SIGNALS AND ESCAPE SEQUENCES").
_FAKE_SRUN = textwrap.dedent("""
    import signal, sys, time
    last = [0.0]
    def interrupt(signum, frame):
        now = time.monotonic()
        if now - last[0] < 1.0:
            open(sys.argv[1], "w").write("ended")
            sys.exit(130)
        last[0] = now
        print("srun: interrupt (one more within 1 sec to abort)", flush=True)
    signal.signal(signal.SIGINT, interrupt)
    open(sys.argv[1] + ".started", "w").write("")
    time.sleep(60)
""")


def test_ctrl_c_ends_srun_tasks_at_once(tmp_path, ctrl_c_raises):
    """Under --launcher slurm, Ctrl-C gives srun the two interrupts that end its tasks (one
    left the ranks training until the SIGKILL 10 s later, and srun's tasks on other nodes
    to Slurm)."""
    script, marker = tmp_path / "srun.py", tmp_path / "srun.out"
    script.write_text(_FAKE_SRUN)

    def interrupt_once_started():
        deadline = time.monotonic() + 30
        while not (tmp_path / "srun.out.started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt_once_started, daemon=True).start()
    started = time.monotonic()
    code = local.run_job([sys.executable, str(script), str(marker)], timeout_s=60,
                         run_dir=RunDir(tmp_path), srun_ranks=2)
    assert code == 130 and marker.read_text() == "ended"
    assert time.monotonic() - started < local.GRACE_S  # ended by srun, not by the SIGKILL after


class _StopAfter:
    """A Stopper whose ranks agree to stop after `steps_done` steps (no world needed)."""

    def __init__(self, steps_done: int):
        self.steps_done, self.asked, self.noted = steps_done, [], []

    def note(self, kind, seconds):
        self.noted.append(kind)

    def agree(self, steps_done, next_evaluates):
        self.asked.append((steps_done, next_evaluates))
        return Stopped(steps_done, "SIGTERM") if steps_done == self.steps_done else None


@pytest.mark.parametrize("stop_after, saves", [(3, [3]), (4, [3, 4]), (6, [3, 6])])
def test_train_loop_stops_where_the_ranks_agree_with_one_save(stop_after, saves):
    from dsforge.runtime.loop.trainer import train_loop

    trainer = RecordingTrainer(steps=7, every=3, start_step=0, eval_every=2)
    stopper = _StopAfter(stop_after)
    assert train_loop(trainer, stopper=stopper) == Stopped(stop_after, "SIGTERM")
    assert [call[1] for call in trainer.calls if call[0].endswith("save")] == saves  # once at most
    assert trainer.calls[-1] == ("finish", "without its line") and ("finish",) not in trainer.calls
    assert [s for s, _ in stopper.asked] == list(range(1, stop_after + 1))
    assert stopper.asked[0] == (1, True)  # step 1 (0-based) evaluates: the budget keeps room


def test_train_loop_does_not_agree_after_the_last_step():
    from dsforge.runtime.loop.trainer import train_loop

    trainer = RecordingTrainer(steps=3, every=0, start_step=0)
    stopper = _StopAfter(3)
    assert train_loop(trainer, stopper=stopper) is None
    assert [s for s, _ in stopper.asked] == [1, 2] and trainer.calls[-1] == ("finish",)
    assert stopper.noted == ["step"] * 3


def test_a_signal_while_the_launcher_starts_is_held_then_acted_on(tmp_path, capsys):
    """From before the launcher starts, dsforge's signals are caught (issue 48, item 9): one
    that comes before the launcher's process is known is noted, not raised in the middle of
    starting it, and the job is stopped as soon as it runs (here the grace of 1 s runs out:
    143 quickly, not the 60 s the command would take)."""
    asked = local.StopAsked()
    with local.StopSignals(asked) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler has run: noted, nothing raised
        assert asked.signum == signal.SIGTERM
        with pytest.raises(local.Stopped):
            signals.arm()
    started = time.monotonic()
    code = local.run_job([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=60,
                         run_dir=RunDir(tmp_path), stop_grace_s=1, asked=asked)
    assert code == 143 and time.monotonic() - started < local.GRACE_S + 5
    assert "every rank saves a checkpoint" in capsys.readouterr().err


def test_a_stop_signal_started_ignored_stays_ignored():
    """`nohup dsforge run ...` ignores SIGHUP so that a dropped session leaves the job running;
    a shell's background job ignores SIGINT. dsforge keeps them ignored (as Python keeps an
    ignored SIGINT) and still catches the stop signals it was not started without."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        asked = local.StopAsked()
        with local.StopSignals(asked):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)
            assert asked.signum is None
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.fixture
def ctrl_c_handled():
    """Ctrl-C as an interactive dsforge gets it: a suite started as a shell's background job
    inherits SIGINT ignored, which dsforge keeps ignored (test_a_stop_signal_started_ignored_
    stays_ignored), and the test's SIGINTs would then be lost."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("ctrl_c_handled")
def test_a_signal_while_the_job_is_stopped_ends_it_at_once(tmp_path, capsys):
    """Ctrl-C, then Ctrl-C again while the group gets its 10 s to exit: the second one does not
    wait for them (nor kills dsforge, which still says how the job ended)."""
    ignores = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    _send_later(signal.SIGINT, signal.SIGINT, after=1.0)
    started = time.monotonic()
    code = local.run_job([sys.executable, "-c", ignores], timeout_s=60)
    assert code == 130 and time.monotonic() - started < local.GRACE_S
    assert "interrupted; stopping every rank" in capsys.readouterr().err


def test_the_remote_end_script_runs_without_dsforge(tmp_path):
    """launch/remote_end.py sends lock.py's functions as text to a host's ssh session, where
    dsforge need not import: the script must hold every function they call (a helper left
    out failed only on the pdsh restart path, as a NameError on the remote host)."""
    from dsforge.launch import remote_end

    script = tmp_path / "end.py"
    script.write_text(remote_end._END)
    done = subprocess.run([sys.executable, "-I", str(script), str(tmp_path / "run"), "1"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stderr[-2000:]
