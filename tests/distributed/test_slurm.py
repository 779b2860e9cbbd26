"""`dsforge sbatch` and `dsforge run --launcher slurm` under a real Slurm on this machine.

A private one-node cluster (tests/distributed/slurm.py: munged, slurmctld, slurmd; skipped
when the Debian packages are absent or the daemons do not start) runs the batch scripts
`dsforge sbatch` writes for recipes/tiny.yaml (2 CPU ranks started by srun):
- a straight job trains to the end (exit 0, metrics.jsonl);
- a second job is sent SIGTERM the way `--signal=B:TERM@S` sends it (`scancel --signal=TERM
  --batch`: the batch shell only): its trap passes it to `dsforge run`, the ranks save, the
  job exits 75 and requeues itself, and the requeued job resumes; its losses equal the
  straight job's bitwise (CPU fp32, same layout);
- a third, written with --max-restarts 2, loses a rank to SIGKILL: `dsforge run` runs srun
  again inside the same job; then the host-down drill fails the node again and the job, which
  no other node can hold, is requeued with the node excluded (it then waits: one node).
Without a cluster: `--launcher slurm` outside an allocation, and a world the allocation cannot
hold, are refused before anything starts.
One node only: Debian's slurmd cannot pose as several nodes on one machine.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import REPO
from dsforge.job.run_dir import RunDir
from tests.distributed import slurm
from tests.distributed.test_restarts import kill_rank_at
from tests.distributed.test_run import dsforge

TINY = str(REPO / "recipes" / "tiny.yaml")
# Long enough (about 0.1-0.2 s a step here) for a signal to land mid-run.
JOB = ["--set", "train.steps=40", "--set", "train.checkpoint_every=20"]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm.available()
    if reason:
        pytest.skip(reason)
    try:
        started = slurm.start(tmp_path_factory.mktemp("slurm"))
    except (RuntimeError, OSError, StopIteration) as exc:
        pytest.skip(f"the test Slurm cluster did not start: {str(exc)[:3000]}")
    yield started
    slurm.stop(started)


def _script(cluster, tmp_path, name: str, *extra: str):
    script, run_dir = tmp_path / f"{name}.sh", tmp_path / name
    result = dsforge("sbatch", TINY, "--gpus-per-node", "0", "--time", "10:00",
                     "--signal-grace", "60", "--run-dir", str(run_dir), "--out", str(script),
                     *JOB, *extra, env=cluster.env)
    assert result.returncode == 0, result.stderr[-3000:]
    return script, run_dir


def _output(run_dir, job_id: str) -> str:
    return run_dir.with_name(f"{run_dir.name}.slurm-{job_id}.out").read_text()


@pytest.fixture(scope="module")
def straight_job(cluster, tmp_path_factory):
    """The tiny recipe's batch script, submitted and waited for: (run dir, output, code)."""
    script, run_dir = _script(cluster, tmp_path_factory.mktemp("straight"), "run")
    submitted = cluster.run("sbatch", "--parsable", "--wait", str(script), timeout=170)
    job_id = submitted.stdout.strip().split(";")[0]
    return run_dir, _output(run_dir, job_id), submitted.returncode


@pytest.mark.timeout(200)
def test_sbatch_script_trains_under_slurm(straight_job):
    run_dir, output, code = straight_job
    assert code == 0, output[-3000:]
    assert "1 x 2 ranks with srun" in output and "done: 40 steps" in output
    assert len(_losses(run_dir)) == 40
    assert (run_dir / "checkpoints" / "latest").exists()


@pytest.mark.timeout(240)
def test_signalled_job_saves_requeues_and_resumes_exactly(cluster, straight_job, tmp_path):
    script, run_dir = _script(cluster, tmp_path, "run")
    job_id = cluster.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    _until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 150,
           cluster, job_id)
    # What Slurm does at --signal=B:TERM@S: SIGTERM to the batch shell only.
    assert cluster.run("scancel", "--signal=TERM", "--batch", job_id).returncode == 0

    moved = []

    def finished() -> bool:
        job = cluster.job(job_id)
        if job.get("Reason") == "BeginTime" and not moved:
            # A requeued job waits 2 minutes to start again, for its revoked credential to
            # expire. Starting it a few seconds later is enough here: a restart within the
            # second of the requeue is refused by slurmd ("Job credential revoked").
            cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+5")
            moved.append(True)
        return job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")

    _until(finished, 180, cluster, job_id)
    job, output = cluster.job(job_id), _output(run_dir, job_id)
    assert (job["JobState"], job["Restarts"], job["ExitCode"]) == ("COMPLETED", "1", "0:0"), output
    assert "SIGTERM received; every rank saves a checkpoint" in output
    assert "with a complete checkpoint: resumable, exit code 75" in output
    assert f"requeueing job {job_id}" in output and "resuming" in output
    assert "done: 40 steps" in output
    straight = _losses(straight_job[0])
    assert _losses(run_dir) == straight and len(straight) == 40  # bitwise


@pytest.mark.timeout(240)
def test_restarts_inside_the_allocation_then_a_requeue_without_the_failing_node(
        cluster, straight_job, tmp_path):
    """`dsforge sbatch --max-restarts 2`: a rank SIGKILLed at step 3: the script's dsforge run
    runs srun again in the same job (one failure does not leave a node out). At step 30 the
    host-down drill kills the node's ranks: its second failure leaves it out, and with no
    spare node and no other node the allocation cannot hold the job: dsforge run ends
    resumable (75) naming the node, and the script requeues the job held, adds the node to
    its ExcNodeList and releases it. On this one-node cluster the job then waits for a node
    that is not excluded."""
    node = cluster.run("sinfo", "-h", "-o", "%N").stdout.strip()
    script, run_dir = _script(cluster, tmp_path, "run", "--max-restarts", "2")
    env = {**cluster.env, "DSFORGE_INJECT_FAULT": f"host-down:{node}:30"}
    job_id = cluster.run("sbatch", "--parsable", str(script), env=env).stdout.strip().split(";")[0]
    kill_rank_at(RunDir(run_dir), 1, 3, after_restarts=0, deadline=time.monotonic() + 150)
    # The script requeues the job held (pending from then on), then sets ExcNodeList (retried
    # until Slurm takes it) and releases it: wait for the list, not only for pending.
    _until(lambda: cluster.job(job_id).get("Restarts") == "1"
           and cluster.job(job_id).get("JobState") == "PENDING"
           and cluster.job(job_id).get("ExcNodeList") not in (None, "(null)"), 180, cluster, job_id)
    job, output = cluster.job(job_id), _output(run_dir, job_id)
    assert job["ExcNodeList"] == node, output
    assert "rank 1 died" in output and "restarting (1 of 2) from the start" in output
    assert output.count("1 x 2 ranks with srun") == 1
    assert "not restarted in this allocation" in output and "[P" not in output
    assert f"for a requeue without {node}" in output
    assert f"requeueing job {job_id} without {node}" in output
    assert not RunDir(run_dir).requeue_exclude.exists()  # applied by the script
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["host"] for r in summary["restart_causes"]] == [node]
    assert "for a requeue without" in summary["failure"]["not_restarted"]
    assert (run_dir / "hostfiles" / "slurm-attempt1").read_text() == f"{node}\n" * 2
    losses = _losses(run_dir)  # the restarted attempt's steps, cut short at step 30
    assert 20 <= len(losses) < 40 and losses == _losses(straight_job[0])[:len(losses)]
    assert cluster.run("scancel", job_id).returncode == 0


def _until(condition, timeout_s: float, cluster, job_id: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id}: {cluster.job(job_id)}\n{cluster.logs()}")
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_launcher_slurm_outside_an_allocation_is_refused(tmp_path):
    import os

    env = {k: "" for k in os.environ if k.startswith("SLURM_")}
    result = dsforge("run", TINY, "--launcher", "slurm", "--run-dir", str(tmp_path / "run"),
                     env=env)
    assert result.returncode == 2
    assert "[SL1]" in result.stderr and "not inside a Slurm allocation" in result.stderr
    assert "dsforge sbatch" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_a_world_the_allocation_cannot_hold_is_refused(tmp_path):
    allocation = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2",
                  "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_CPUS_PER_NODE": "2",
                  "SLURM_JOB_NODELIST": "node1"}
    result = dsforge("run", TINY, "--launcher", "slurm", "--set", "parallel.dp=4",
                     "--run-dir", str(tmp_path / "run"), env=allocation)
    assert result.returncode == 2
    assert "[SL2] recipe's world=4, allocation='job 7: 1 node, 2 tasks" in result.stderr
    assert "4 ranks a node, but the allocation has 2 tasks a node" in result.stderr
    assert not (tmp_path / "run").exists()
