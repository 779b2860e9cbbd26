"""`dsforge run` end to end through its launcher (launch/node.py): a job trains, a failing or
hung rank ends the whole job with a non-zero exit code, Ctrl-C stops every rank, nothing is
left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsforge.lock import job_processes
from tests.conftest import REPO, as_foreground_job

TINY = str(REPO / "recipes" / "tiny.yaml")
QUICK = ["--set", "train.steps=6", "--set", "train.timing_warmup=1"]


def dsforge(*args: str, env: dict | None = None, timeout: float = 240):
    return subprocess.run([sys.executable, "-m", "dsforge", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def _job_processes(run_dir) -> list[int]:
    """Live processes of the job (dsforge/lock.py), waiting a moment for exits in flight."""
    deadline = time.monotonic() + 5
    while job_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    return job_processes(run_dir)


def _shm_buffers(run_dir) -> list[Path]:
    """The job's own shared-memory all-reduce buffers in /dev/shm, had DeepSpeed made any:
    named by user, master address and port, then rank (deepspeed/ops/csrc/cpu/comm/shm.cpp),
    which the launcher's command line in job.log gives. Another program's are not the job's."""
    log = (run_dir / "job.log").read_text()
    addr, port = (re.search(rf"--master_{name}=(\S+)", log) for name in ("addr", "port"))
    assert addr and port, "job.log names no master address and port"
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr[1]}_{port[1]}_*"
    return sorted(Path("/dev/shm").glob(name))


def test_run_trains_and_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    result = dsforge("run", TINY, *QUICK, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    assert records[0]["warmup"] and not records[1]["warmup"]
    assert all(r["mfu"] is None and r["memory_source"] == "process peak RSS" for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["measured_steps"] == 5 and "MFU n/a" in result.stderr
    # A quiet terminal: dsforge's lines; the engines' logs and rank command lines in job.log.
    assert "[INFO]" not in result.stderr and "--job" not in result.stderr
    assert f"engine logs in {run_dir / 'job.log'}" in result.stderr
    log = (run_dir / "job.log").read_text()
    assert "[WARNING]" in log and "rank 1 started (pid" in log and "--job" in log
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["versions"]["deepspeed"] and manifest["layout"]["dp"] == 2
    assert "dp: 2" in (run_dir / "recipe.yaml").read_text()
    assert not _job_processes(run_dir)
    assert _shm_buffers(run_dir) == []  # nothing leaked


def test_deepspeed_can_launch_dsforge_run_itself(tmp_path):
    """`deepspeed --module dsforge run RECIPE`: DeepSpeed starts dsforge on every rank."""
    from dsforge.launch.local import free_port

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
         str(free_port()), "--module", "dsforge", "run", TINY, *QUICK, "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 6
    assert not _job_processes(run_dir)


def test_dry_run_prints_commands_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = dsforge("run", TINY, "--run-dir", str(run_dir), "--dry-run")
    assert result.returncode == 0
    runner, _, plain = result.stdout.strip().splitlines()
    assert "dsforge.launch.node --nproc 2" in runner and "--job " in runner
    assert plain.startswith("deepspeed --num_gpus 2") and f"run {TINY} --run-dir {run_dir}" in plain
    assert not run_dir.exists()


def test_run_refuses_a_used_run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    result = dsforge("run", TINY, "--run-dir", str(tmp_path))
    assert result.returncode == 2 and "is not empty" in result.stderr


def test_invalid_recipe_starts_nothing(tmp_path):
    result = dsforge("run", TINY, "--set", "train.global_batch=7", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2 and "[B2]" in result.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_a_failing_rank_ends_the_whole_job(tmp_path, kind):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = dsforge("run", TINY, *QUICK, "--run-dir", str(run_dir),
                     env={"DSFORGE_INJECT_FAULT": f"{kind}:1:2"})
    assert result.returncode != 0
    assert time.monotonic() - start < 120
    if kind == "raise":
        assert "rank 1 failed at step 3" in result.stderr and "injected fault" in result.stderr
        record = json.loads((run_dir / "failures" / "rank00001.json").read_text())
        assert (record["kind"], record["step"]) == ("exception", 2)
        assert "first failure: rank 1 failed at step 3" in result.stderr
    assert "job failed" in result.stderr and str(run_dir / "job.log") in result.stderr
    assert not _job_processes(run_dir)


def test_a_hung_rank_is_named_and_the_job_ends(tmp_path):
    run_dir = tmp_path / "run"
    result = dsforge("run", TINY, *QUICK, "--run-dir", str(run_dir), "--step-timeout", "5",
                     env={"DSFORGE_INJECT_FAULT": "hang:0:3"})
    assert result.returncode != 0
    assert "stuck: step 4 made no progress" in result.stderr
    assert "inject_fault" in result.stderr  # the Python stack of the stuck rank
    from dsforge.job import failure
    from dsforge.job.run_dir import RunDir

    assert failure.first(RunDir(run_dir)).kind == "hang"
    assert "rank 0: step 4, last progress" in result.stderr  # the launcher's summary
    assert not _job_processes(run_dir)


def test_ctrl_c_stops_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dsforge", "run", TINY, "--set", "train.steps=10000",
                             "--run-dir", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_foreground_job)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (run_dir / "metrics.jsonl").exists(), "the job never started training"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in stderr
    time.sleep(1)
    assert not _job_processes(run_dir)
