"""A job's whole life under signals: SIGHUP stops it like Ctrl-C, a SIGKILLed `dsforge run`
still takes its job down (at start-up, mid-run, with a rank stopped), and the leftover check
really sees a job's processes. (SIGTERM and
SIGUSR1 make the ranks save and stop first: tests/distributed/test_preemption.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsforge.job.run_dir import RunDir
from dsforge.launch.commands import Placement, job_spec, launch_command
from dsforge.launch.local import free_port
from dsforge.lock import job_processes
from dsforge.recipe import resolve_file
from tests.conftest import REPO

TINY = str(REPO / "recipes" / "tiny.yaml")
FOREVER = ["--set", "train.steps=100000"]


def _start(run_dir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dsforge", "run", TINY, *FOREVER,
                             "--run-dir", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(condition, proc, timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job never got there"
        time.sleep(0.05)


def _wait_for_training(run_dir, proc, timeout_s: float = 150) -> None:
    _wait_for(lambda: (run_dir / "metrics.jsonl").exists(), proc, timeout_s)


def _gone_within(run_dir, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while job_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.25)
    return job_processes(run_dir)


def _kill_leftovers(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig, code", [(signal.SIGHUP, 129)])
def test_sighup_stops_the_job_like_ctrl_c(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    try:
        _wait_for_training(run_dir, proc)
        assert job_processes(run_dir), "the leftover check sees the running job"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr[-2000:]
    assert f"{signal.Signals(sig).name} received; stopping every rank" in stderr
    assert not _gone_within(run_dir, 5)


@pytest.mark.parametrize("moment", ["start-up", "mid-run", "a rank stopped"])
def test_a_sigkilled_dsforge_still_takes_its_job_down(tmp_path, moment):
    """Every process of the job is gone within 15 s, by design: the keeper kills the job's
    group the moment dsforge dies (launch/keeper.py), before any rank started too, and the
    ranks' supervisors watch for it even while their rank is stopped (job/owner.py)."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    try:
        if moment == "start-up":  # the launcher started, no rank yet
            _wait_for(lambda: job_processes(run_dir), proc)
        else:
            _wait_for_training(run_dir, proc)
            assert len(job_processes(run_dir)) >= 3  # the launcher and the ranks (and supervisors)
        if moment == "a rank stopped":
            os.kill(_rank_pid(run_dir, 1), signal.SIGSTOP)
        proc.kill()  # SIGKILL: dsforge can do nothing itself
        proc.wait()
        left = _gone_within(run_dir, 15)
    finally:
        proc.kill()
    _kill_leftovers(left)
    assert not left, f"orphaned processes: {left}"
    assert not RunDir(run_dir).failures.exists()  # nothing was left to fail on a broken pipe


def test_the_leftover_check_sees_a_real_orphan(tmp_path):
    """Without an owner to watch, a job whose starter is gone keeps running: the check must
    find it (the check made by every launch test would otherwise prove nothing)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    resolved = resolve_file(TINY, [FOREVER[1]])
    # nobody to watch, as when a plain `deepspeed` starts the ranks
    job = job_spec(resolved, RunDir(run_dir), owned=False, device="cpu")
    command = launch_command(Placement(world_size=2, master_port=free_port()), job)
    env = {k: v for k, v in os.environ.items() if k != "DSFORGE_JOB_DIR"}  # found by job word
    runner = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(job_processes(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        found = job_processes(run_dir)
        assert len(found) >= 2, "the two ranks carry the run directory only in their job word"
    finally:
        os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
    assert not _gone_within(run_dir, 10)


def _rank_pid(run_dir, rank: int) -> int:
    from dsforge.job.pids import started_ranks

    return int(started_ranks(RunDir(run_dir))[rank].split()[1])


@pytest.mark.parametrize("sig, recipe, victim", [
    (signal.SIGKILL, "tiny.yaml", 1),
    (signal.SIGSTOP, "tiny.yaml", 1),
    # pp2 x vpp2 x dp2: every peer waits for it on the same step, none is "behind" (issue 25)
    (signal.SIGSTOP, "tiny_pp.yaml", 2),
], ids=["SIGKILL-dp2", "SIGSTOP-dp2", "SIGSTOP-pp2-vpp2-dp2"])
def test_a_rank_killed_or_stopped_from_outside_is_named(tmp_path, sig, recipe, victim):
    """Its peers fail on the broken connection or hang; the report names the rank that
    caused it as the first failure, with the signal that ended or stopped it (its supervisor
    saw it)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dsforge", "run", str(REPO / "recipes" / recipe),
                             *FOREVER, "--run-dir", str(run_dir), "--step-timeout", "5"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for_training(run_dir, proc)
        beat = RunDir(run_dir).heartbeat(victim)  # written at most 0.25 s after a step starts
        while not beat.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        os.kill(_rank_pid(run_dir, victim), sig)
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
        left = _gone_within(run_dir, 10)
        _kill_leftovers(left)
    assert proc.returncode not in (0, None) and not left, left
    if sig == signal.SIGKILL:
        assert f"first failure: rank {victim} died at step" in stderr, stderr[-3000:]
        assert "killed by SIGKILL (out of memory?" in stderr
    else:  # the stopped rank says nothing; its supervisor saw the stop
        assert f"first failure: rank {victim} was stopped at step" in stderr, stderr[-3000:]
        assert "SIGSTOP from outside, never continued (its peers waited for it)" in stderr
        assert "without reporting an error" not in stderr


def _until_line(proc, text: str, timeout_s: float = 240) -> list[str]:
    """stderr's lines up to the first that holds `text` (read as they come)."""
    lines, deadline = [], time.monotonic() + timeout_s
    for line in proc.stderr:
        lines.append(line)
        if text in line:
            return lines
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
    raise AssertionError(f"{text!r} never came:\n" + "".join(lines)[-3000:])


def test_sigterm_as_the_launcher_starts_saves_and_stops(tmp_path):
    """The moment `dsforge run` starts its launcher (issue 48, item 9): the signal is caught,
    not left to its default action (exit 143, no message, ranks without an owner); the ranks
    save when they run and the job ends resumable."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    try:
        _wait_for(lambda: job_processes(run_dir), proc)  # the launcher has just started
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
        left = _gone_within(run_dir, 10)
        _kill_leftovers(left)
    assert proc.returncode == 75, stderr[-3000:]
    assert "with a complete checkpoint: resumable, exit code 75" in stderr
    assert (run_dir / "checkpoints" / "latest").exists() and not left, left


def test_sigterm_after_the_restarting_line_ends_the_job_resumable(tmp_path):
    """Right after `dsforge: restarting ...` (issue 48, item 9): caught between the attempts or
    as the next one starts, the job ends as a stop does (75 with a checkpoint), nothing of it
    left, and summary.json keeps the restart."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dsforge", "run", TINY, "--set",
                             "train.steps=40", "--set", "train.checkpoint_every=2",
                             "--run-dir", str(run_dir), "--max-restarts", "2",
                             "--step-timeout", "5"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # a hang is retried; its watchdog names the step
                            env={**os.environ, "DSFORGE_INJECT_FAULT": "hang:1:3"})
    try:
        said = _until_line(proc, "dsforge: restarting (1 of 2)")
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=240)
    finally:
        proc.kill()
        left = _gone_within(run_dir, 10)
        _kill_leftovers(left)
    stderr = "".join(said) + rest
    assert proc.returncode == 75, stderr[-3000:]
    assert "resumable, exit code 75" in stderr and not left, left
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["restarts"] == 1 and summary["restart_causes"][0]["step"] == 3


@pytest.fixture(scope="module")
def loopback_hosts(tmp_path_factory):
    from tests.distributed import sshd

    reason = sshd.available()
    if reason:
        pytest.skip(reason)
    proc, hosts = sshd.start(tmp_path_factory.mktemp("sshd"))
    yield hosts
    sshd.stop(proc)


# A rank's supervisor on a host other than its owner's, as far as its watch can tell: the owner
# names another host, so only the pipe its output goes to (ssh's) can say the job is orphaned.
_ELSEWHERE = """
import os, sys, time
from dsforge.job.owner import watch_owner
open(sys.argv[1], "w").write(str(os.getpid()))
watch_owner("another-host.invalid:1:1")
time.sleep(120)
"""


def test_a_process_on_another_host_ends_when_its_ssh_session_does(loopback_hosts, tmp_path):
    """What ends a job's ranks on the hosts pdsh reached once dsforge's host ended its part
    (the keeper kills pdsh and ssh): their output's reader, sshd, is gone (job/owner.py)."""
    said = tmp_path / "remote.pid"
    ssh = subprocess.Popen(["ssh", "-F", str(loopback_hosts.ssh_config), "node-a",
                            f"cd {REPO} && {sys.executable} -c '{_ELSEWHERE}' {said}"],
                           stdout=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for(lambda: said.exists() and said.read_text(), ssh, timeout_s=60)
        remote = int(said.read_text())
        os.killpg(ssh.pid, signal.SIGKILL)  # as the keeper ends pdsh's ssh
        ssh.wait()
        deadline = time.monotonic() + 5
        while Path(f"/proc/{remote}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{remote}").exists(), "the remote process outlived its session"
    finally:
        _end_group(ssh.pid)


def test_a_sigkilled_dsforge_takes_its_pdsh_job_down(loopback_hosts, tmp_path):
    """Over a hostfile (pdsh to two hosts): every process of the job, on both, within 15 s."""
    run_dir, hostfile = tmp_path / "run", tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    proc = subprocess.Popen([sys.executable, "-m", "dsforge", "run", TINY, *FOREVER, "--hostfile",
                             str(hostfile), "--master-addr", "127.0.0.1", "--run-dir",
                             str(run_dir)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **loopback_hosts.env})
    try:
        _wait_for_training(run_dir, proc)
        assert len(job_processes(run_dir)) >= 5  # the keeper, runner, pdsh, two launchers, ranks
        proc.kill()
        proc.wait()
        left = _gone_within(run_dir, 15)
    finally:
        proc.kill()
    _kill_leftovers(left)
    assert not left, f"orphaned processes: {left}"


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
