"""What a failed job's report says (launch/diagnose.py), and H6: nothing DeepSpeed's runner
pastes into a remote shell may be shell syntax (launch/job.py)."""

from __future__ import annotations

import pytest

from dsforge.launch.diagnose import describe_code, failure_report, launcher_exit_codes, write_pid
from dsforge.launch.job import Placement, remote_shell_problems
from dsforge.runtime import failure


def test_exit_codes_name_their_signal():
    assert describe_code(-9) == "exit code -9: killed by SIGKILL"
    assert describe_code(1) == "exit code 1"
    log = "[ERROR] [launch.py:259:sigkill_handler] ['python', '--job', 'X'] exits with return code = -9\n"
    assert launcher_exit_codes(log) == [-9]


def test_a_silent_rank_is_named_before_the_peer_that_lost_it(tmp_path):
    for rank in (0, 1):
        write_pid(tmp_path, rank, "node-a", 100 + rank)
    failure.write(tmp_path, failure.Failure(rank=0, step=5, kind="exception",
                                            message="RuntimeError: Connection closed by peer"))
    (tmp_path / "job.log").write_text("[...] exits with return code = -9\n")
    report = failure_report(tmp_path, 1, done_ranks=set())
    silent = report.index("rank 1 (pid 101 on node-a)")
    assert "killed by SIGKILL" in report and silent < report.index("first failure: rank 0")


def test_ranks_that_finished_or_recorded_are_not_silent(tmp_path):
    for rank in (0, 1, 2):
        write_pid(tmp_path, rank, "h", rank)
    failure.write(tmp_path, failure.Failure(rank=2, step=1, kind="exception", message="boom"))
    report = failure_report(tmp_path, 1, done_ranks={0, 1})
    assert "without reporting" not in report and "first failure: rank 2 failed at step 1: boom" in report


@pytest.mark.parametrize("addr", ["127.0.0.1;touch${IFS}P;#", "$(reboot)", "a b", "-oProxyCommand=x"])
def test_master_addr_must_be_a_host(addr):
    problems = remote_shell_problems(Placement(world_size=2, master_addr=addr), cwd="/w", python="/p")
    assert [p.rule for p in problems] == ["H6"] and problems[0].fields == {"--master-addr": addr}


@pytest.mark.parametrize("addr", ["10.0.0.1", "node-1.cluster", "fe80::1", None])
def test_plain_master_addrs_pass(addr):
    assert remote_shell_problems(Placement(world_size=2, master_addr=addr), cwd="/w", python="/p") == []


def test_working_directory_and_python_must_be_plain_for_remote_shells():
    hosts = Placement(world_size=2, hostfile="hosts")
    bad = remote_shell_problems(hosts, cwd="/tmp/$(touch P)", python="/usr/bin/python3")
    assert [p.fields for p in bad] == [{"working directory": "/tmp/$(touch P)"}]
    assert remote_shell_problems(hosts, cwd="/tmp/ok", python="/opt/my env/python")[0].fields == \
        {"Python executable": "/opt/my env/python"}
    # without a hostfile nothing reaches a shell: the local launcher passes argument lists
    assert remote_shell_problems(Placement(world_size=2), cwd="/tmp/$(x)", python="/p") == []
