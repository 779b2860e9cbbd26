"""Two "nodes" on one machine through DeepSpeed's real multi-node launcher paths.

- `--no-ssh NODE_RANK`: one dsforge per node (DeepSpeed's --no_ssh --node_rank mode).
- pdsh over ssh to loopback host aliases served by a private sshd (tests/distributed/sshd.py):
  the real `deepspeed --hostfile` path, with dsforge's preflight in front.
A tiny recipe trains with data parallelism across the two nodes and its losses must equal the
single-node run's; killing one node's rank ends the whole job with nothing left running. With
--max-restarts a failing host is left out (launch/host_pool.py): a spare takes its place and
the job ends with the uninterrupted run's losses (the pdsh restart's path: a second preflight,
the job started again over pdsh), or without a spare the job goes on on the host left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from dsforge.job.run_dir import RunDir
from tests.conftest import REPO
from tests.distributed import sshd
from tests.distributed.test_restarts import RUN as RESTARTED
from tests.distributed.test_restarts import TIMEOUT_S
from tests.distributed.test_restarts import losses as restarted_losses
from tests.distributed.test_run import _job_processes, dsforge

TINY = str(REPO / "recipes" / "tiny.yaml")
TEXT = REPO / "data" / "tempest.u16.bin"
QUICK = ["--set", "train.steps=4", "--set", f"data.source={TEXT}"]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    result = dsforge("run", TINY, *QUICK, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return _losses(run_dir)


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{alias} slots=1\n" for alias in sshd.ALIASES[:2]))
    return path


def test_no_ssh_node_ranks_match_single_node(single_node, hostfile, tmp_path):
    run_dir, port = tmp_path / "run", str(_free_port())
    common = [sys.executable, "-m", "dsforge", "run", TINY, *QUICK, "--hostfile", str(hostfile),
              "--master-addr", "127.0.0.1", "--master-port", port, "--run-dir", str(run_dir)]
    nodes = [subprocess.Popen([*common, "--no-ssh", str(rank)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert _losses(run_dir) == pytest.approx(single_node, abs=1e-5)
    assert not _job_processes(run_dir)


@pytest.fixture(scope="module")
def loopback_hosts(tmp_path_factory):
    reason = sshd.available()
    if reason:
        pytest.skip(reason)
    proc, hosts = sshd.start(tmp_path_factory.mktemp("sshd"))
    yield hosts
    sshd.stop(proc)


def test_preflight_checks_every_host(loopback_hosts, hostfile, tmp_path):
    ok = dsforge("preflight", TINY, "--hostfile", str(hostfile), env=loopback_hosts.env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "preflight ok: 2 hosts reachable" in ok.stderr
    bad = tmp_path / "bad_hostfile"
    bad.write_text("node-a slots=1\nno-such-host slots=1\n")
    result = dsforge("preflight", TINY, "--hostfile", str(bad), "--ssh-timeout", "5",
                     env=loopback_hosts.env)
    assert result.returncode == 2
    assert "[F1] host='no-such-host': cannot run Python over ssh" in result.stderr
    assert "node-a" not in result.stderr.split("error:", 1)[1]  # the good host is not blamed


def test_preflight_finds_a_busy_master_port(loopback_hosts, hostfile):
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = dsforge("preflight", TINY, "--hostfile", str(hostfile), "--master-port", str(port),
                         env=loopback_hosts.env)
    assert result.returncode == 2
    assert f"[F2] host='node-a', --master-port={port}: the master port is not free" in result.stderr


def test_killing_one_nodes_rank_ends_the_whole_job(loopback_hosts, hostfile, tmp_path):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = dsforge("run", TINY, "--set", "train.steps=50", "--hostfile", str(hostfile),
                     "--master-addr", "127.0.0.1", "--run-dir", str(run_dir), "--step-timeout", "20",
                     env={**loopback_hosts.env, "DSFORGE_INJECT_FAULT": "exit:1:2"})
    elapsed = time.monotonic() - start
    assert result.returncode != 0 and "job failed" in result.stderr
    assert elapsed < 150
    time.sleep(1)
    assert not _job_processes(run_dir)


def test_a_stop_request_reaches_this_hosts_ranks_started_over_pdsh(loopback_hosts, hostfile,
                                                                     tmp_path):
    """SIGTERM to `dsforge run` over a hostfile (the stop drill sends it): pdsh starts even this
    host's ranks through sshd, in sessions of their own, and they are asked all the same: they
    save and the job exits 75 at once, not after --stop-grace with SIGTERM's 143."""
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = dsforge("run", TINY, "--set", "train.steps=50", "--hostfile", str(hostfile),
                     "--master-addr", "127.0.0.1", "--run-dir", str(run_dir), "--stop-grace", "90",
                     env={**loopback_hosts.env, "DSFORGE_INJECT_FAULT": "stop:0:2"})
    assert result.returncode == 75, result.stderr[-3000:]
    assert "with a complete checkpoint: resumable, exit code 75" in result.stderr
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000003"
    assert time.monotonic() - start < 90
    assert not _job_processes(run_dir)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The restart tests' job, uninterrupted, on this machine (a checkpoint every 2 steps)."""
    reference = RunDir(tmp_path_factory.mktemp("reference") / "run")
    done = dsforge("run", TINY, *RESTARTED, "--run-dir", str(reference), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return reference


@pytest.fixture(scope="module")
def restarted_reference(reference_run):
    return restarted_losses(reference_run)


def _node_b_fails(loopback_hosts, tmp_path, hosts: str):
    """`dsforge run` over `hosts` (a hostfile's text) with one restart, node-b failing at step
    5 (the host-down drill: its rank dies, then the host fails every preflight); its run
    directory, once it finished."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hosts)
    run_dir = RunDir(tmp_path / "run")
    result = dsforge("run", TINY, *RESTARTED, "--hostfile", str(hostfile), "--master-addr",
                     "127.0.0.1", "--max-restarts", "1", "--run-dir", str(run_dir.path),
                     env={**loopback_hosts.env, "DSFORGE_INJECT_FAULT": "host-down:node-b:4"},
                     timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir, result.stderr


def test_a_failing_host_is_left_out_and_a_spare_takes_its_place(loopback_hosts, tmp_path,
                                                                restarted_reference):
    """node-b fails (the host-down drill: its rank dies at step 5, then the host fails the
    restart's preflight): the restart leaves node-b out, the spare node-c takes its place and
    rank, and the job ends with the uninterrupted run's losses."""
    run_dir, stderr = _node_b_fails(loopback_hosts, tmp_path,
                                    "node-a slots=1\nnode-b slots=1\n#spare node-c slots=1\n")
    assert "node-c in place of node-b (2 failures there: a killed failure, a failed preflight)" \
        in stderr
    assert stderr.count("preflight ok") == 2
    summary = json.loads(run_dir.summary.read_text())
    (restart,) = summary["restart_causes"]
    assert restart["host"] == "node-b" and restart["left_out"][0]["replaced_by"] == "node-c"
    assert (run_dir.path / "hostfiles" / "attempt1").read_text() == \
        "node-a slots=1\nnode-c slots=1\n"
    assert restarted_losses(run_dir) == pytest.approx(restarted_reference, abs=1e-5)
    assert not _job_processes(run_dir.path)


def _free_port() -> int:
    from dsforge.launch.local import free_port

    return free_port()


def test_without_a_spare_the_job_goes_on_on_fewer_hosts(loopback_hosts, tmp_path, reference_run):
    """Two hosts, no spare: node-b fails, the job goes on on node-a alone, dp 2 -> 1 and
    grad_accum 2 -> 4 (the global batch kept), resumed through the layout-free state; its
    losses equal a resume of the same checkpoint on dp 1 made by hand."""
    run_dir, stderr = _node_b_fails(loopback_hosts, tmp_path, "node-a slots=1\nnode-b slots=1\n")
    assert ("continuing on 1 host(s) (node-a) without a spare: world_size 2 -> 1, dp 2 -> 1, "
            "edp 2 -> 1, grad_accum 2 -> 4 (global batch 8 kept)") in stderr
    assert "; without node-b (2 failures there" in stderr
    assert "dsforge: nothing of the failed attempt is left on node-b" in stderr
    summary = json.loads(run_dir.summary.read_text())
    (restart,) = summary["restart_causes"]
    after = restart["resumed_after_step"]
    assert restart["left_out"][0]["hosts_after"] == ["node-a"] and after is not None
    by_hand = RunDir(tmp_path / "by_hand")
    shutil.copytree(reference_run.path, by_hand.path)
    for later in sorted(by_hand.checkpoints.glob("step*"))[after // 2:]:
        shutil.rmtree(later)
    (by_hand.checkpoints / "latest").write_text(f"step{after:08d}")
    resumed = dsforge("run", TINY, *RESTARTED, "--set", "parallel.dp=1", "--set",
                      "train.grad_accum=4", "--run-dir", str(by_hand.path), "--resume",
                      timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"after step {after}" in resumed.stderr and "new layout" in resumed.stderr
    shrunk, hand = restarted_losses(run_dir), restarted_losses(by_hand)
    assert [shrunk[s] for s in range(after, 40)] == [hand[s] for s in range(after, 40)]
    assert shrunk != restarted_losses(reference_run)  # dp 1 sums its microbatches otherwise
    assert not _job_processes(run_dir.path)


def test_a_left_out_hosts_leftovers_are_ended_over_ssh(loopback_hosts, tmp_path, monkeypatch):
    """A process of the job still alive on a host the restart leaves out is found there by its
    run directory and SIGKILLed by PID over ssh; an unreachable host is named."""
    from dsforge.launch.remote_end import end_job_on
    from dsforge.lock import JOB_DIR_ENV

    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    for name, value in loopback_hosts.env.items():
        monkeypatch.setenv(name, value)
    leftover = subprocess.Popen(["sleep", "300"], start_new_session=True,
                                env={**os.environ, JOB_DIR_ENV: str(run_dir.path.resolve())})
    try:
        line = end_job_on("node-b", run_dir)
        assert line == ("dsforge: ended 1 process(es) of the failed attempt on node-b "
                        f"(PIDs {leftover.pid})")
        assert leftover.wait(timeout=10) == -9
        assert end_job_on("node-b", run_dir) == \
            "dsforge: nothing of the failed attempt is left on node-b"
        gone = end_job_on("no-such-host", run_dir, timeout_s=5)
        assert gone.startswith("dsforge: could not reach no-such-host")
    finally:
        leftover.kill()
