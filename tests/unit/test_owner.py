"""A job's processes end when its `dsforge` dies (job/owner.py, launch/keeper.py): the keeper
kills its process group the moment its parent dies, a supervisor's watch kills its group when
the owner is gone or nobody reads its output any more, and neither writes anything first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from dsforge.job.owner import current_owner, output_orphaned, owner_alive
from dsforge.launch import local
from tests.conftest import REPO


def _group_gone(pgid: int, within_s: float) -> bool:
    """Whether no process of group `pgid` is left (this process's children are reaped by
    their waits: a zombie still counts)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _end(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_an_output_nobody_reads_is_told_apart_without_writing(tmp_path):
    read, write = os.pipe()
    try:
        assert not output_orphaned(write)
        os.close(read)
        assert output_orphaned(write)  # the kernel says so; nothing was written
    finally:
        os.close(write)
    with open(tmp_path / "log", "w") as log:
        assert not output_orphaned(log.fileno())  # a file is read later, by anyone


def test_an_owner_is_known_by_pid_and_start_time_on_its_host_only():
    me = current_owner()
    assert owner_alive(me) is True
    host, pid, start = me.rsplit(":", 2)
    assert owner_alive(f"{host}:{pid}:{int(start) + 1}") is False  # the pid reused since
    assert owner_alive(f"elsewhere.invalid:{pid}:{start}") is None


# A stand-in for `dsforge run`: it starts COMMAND under a keeper, in a new session as run_job
# does, says the keeper's pid, and waits to be killed.
_DSFORGE = textwrap.dedent("""
    import subprocess, sys, time
    from dsforge.launch.keeper import keeper_command
    proc = subprocess.Popen(keeper_command(sys.argv[2:]), start_new_session=True)
    open(sys.argv[1], "w").write(str(proc.pid))
    time.sleep(120)
""")


def test_the_keeper_ends_the_job_the_moment_dsforge_dies(tmp_path):
    """However dsforge dies: its job's group (here a process that ignores SIGTERM and SIGHUP,
    as a rank blocked in a collective would not answer) is gone at once."""
    said = tmp_path / "keeper.pid"
    stubborn = "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in " \
               "(signal.SIGTERM, signal.SIGHUP)]; time.sleep(120)"
    dsforge = subprocess.Popen([sys.executable, "-c", _DSFORGE, str(said), sys.executable, "-c",
                                stubborn], cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not said.exists() or not said.read_text():
            assert time.monotonic() < deadline, "the stand-in never started its keeper"
            time.sleep(0.05)
        keeper = int(said.read_text())
        time.sleep(1.0)  # the job runs
        assert not _group_gone(keeper, 0)
        dsforge.kill()
        dsforge.wait()
        assert _group_gone(keeper, 5), "the job outlived its dsforge"
    finally:
        _end(dsforge.pid)
        if said.exists() and said.read_text():
            _end(int(said.read_text()))


def test_the_keeper_exits_as_its_command_did():
    """To dsforge the keeper is the runner: its exit code, or the signal that ended it."""
    assert local.run_job([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert local.run_job([sys.executable, "-c", killed]) == -signal.SIGTERM


# A supervisor's watch (job/owner.py): the owner's pid is this test's, which stays alive, so
# only the pipe can tell the watcher that the job's output lost its reader.
_WATCHED = textwrap.dedent("""
    import sys, time
    from dsforge.job.owner import watch_owner
    watch_owner(sys.argv[1], every_s=0.1)
    time.sleep(120)
""")


def test_a_watched_group_ends_when_nobody_reads_its_output_any_more():
    """As on a host pdsh reached: the owner is another host's, and the ssh session that read
    the ranks' output closed; nothing is written to find that out."""
    owner = f"another-host.invalid:{os.getpid()}:1"
    proc = subprocess.Popen([sys.executable, "-c", _WATCHED, owner], cwd=REPO,
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, "the watch ended a group whose output is still read"
        proc.stdout.close()
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        _end(proc.pid)
