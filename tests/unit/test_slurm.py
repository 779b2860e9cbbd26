"""The pure parts of dsforge/launch/slurm.py: Slurm's variables, the world check, srun's
command line, each rank's environment and the batch script."""

from __future__ import annotations

import subprocess

import pytest

from dsforge.job.slurm_env import expand_counts, rank_env
from dsforge.launch import slurm

BATCH = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "16",
         "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_CPUS_PER_NODE": "64(x2)",
         "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NODELIST": "gpu[01-02]"}


def test_expand_counts():
    assert expand_counts("2(x3),1") == (2, 2, 2, 1)
    assert expand_counts("8") == (8,)
    with pytest.raises(ValueError):
        expand_counts("8x2")


def test_allocation_from_a_batch_jobs_variables():
    allocation = slurm.allocation_from_env(BATCH)
    assert (allocation.nodes, allocation.tasks, allocation.tasks_per_node,
            allocation.cpus_per_node, allocation.gpus_per_node) == (2, 16, 8, (64, 64), 8)
    assert allocation.describe() == "job 42: 2 nodes, 16 tasks, 8 tasks a node, 64 CPUs a node, 8 GPUs a node"


def test_world_against_the_allocation():
    allocation = slurm.allocation_from_env(BATCH)
    assert slurm.ranks_per_node(16, allocation, cpu=False) == (8, [])
    per_node, problems = slurm.ranks_per_node(8, allocation, cpu=False)
    assert per_node == 4 and [p.severity for p in problems] == ["warning"]  # 8 of 16 tasks
    _, problems = slurm.ranks_per_node(32, allocation, cpu=False)
    assert "16 ranks a node, but the allocation has 8 GPUs a node" in str(problems[0])
    _, problems = slurm.ranks_per_node(15, allocation, cpu=False)
    assert "cannot be spread evenly over 2 nodes" in str(problems[0])
    # salloc -N1 with no task count: the CPUs a node decide, per --cpus-per-task
    salloc = slurm.allocation_from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "1",
                                        "SLURM_JOB_CPUS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "2"})
    assert slurm.ranks_per_node(2, salloc, cpu=True) == (2, [])
    assert "3 ranks a node, but the allocation has 2 CPUs a node" in str(
        slurm.ranks_per_node(3, salloc, cpu=True)[1][0])


def test_plan_and_srun_command():
    plan, problems = slurm.plan_job(16, BATCH, cpu_only=False, master_addr=None, master_port=None,
                                    free_port=lambda: 1, hostnames=lambda _: ["gpu01", "gpu02"])
    assert problems == [] and plan.hostfile.text() == "gpu01 slots=8\ngpu02 slots=8\n"
    assert plan.env(plan.hostfile, "/r/tasks") == {
        "MASTER_ADDR": "gpu01", "MASTER_PORT": str(slurm.PORT_BASE + 42),
        "SLURM_HOSTFILE": "/r/tasks"}
    assert plan.command(plan.hostfile, ["python", "-m", "dsforge.runtime.rank"]) == [
        "srun", "--nodes=2", "--ntasks=16", "--distribution=arbitrary", "--kill-on-bad-exit=1",
        "--export=ALL", "python", "-m", "dsforge.runtime.rank"]
    assert slurm.task_hosts(plan.hostfile) == "gpu01\n" * 8 + "gpu02\n" * 8  # a line a rank


def test_spare_nodes_stand_by_at_the_end_of_the_allocation():
    three = {**BATCH, "SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS": "24",
             "SLURM_JOB_NODELIST": "gpu[01-03]"}
    plan, problems = slurm.plan_job(16, three, cpu_only=False, master_addr=None, master_port=None,
                                    free_port=lambda: 1, spare_nodes=1,
                                    hostnames=lambda _: ["gpu01", "gpu02", "gpu03"])
    assert problems == [] and (plan.nodes, plan.per_node) == (2, 8)
    assert plan.hostfile.spares == (("gpu03", 8),)
    _, problems = slurm.plan_job(16, three, cpu_only=False, master_addr=None, master_port=None,
                                 free_port=lambda: 1, spare_nodes=3, hostnames=lambda _: [])
    assert "--spare-nodes 3 leaves none of the allocation's 3 nodes" in str(problems[0])
    _, problems = slurm.plan_job(16, three, cpu_only=False, master_addr=None, master_port=None,
                                 free_port=lambda: 1, spare_nodes=0, hostnames=lambda _: [])
    assert "16 ranks cannot be spread evenly over 3 nodes" in str(problems[0])


def test_node_states_slurm_cannot_run_a_rank_on():
    out = ("gpu01 allocated\ngpu02 down*\ngpu03 mixed\ngpu04 drained\ngpu05 allocated*\n"
           "gpu06 draining\ngpu07 completing\n")
    assert slurm.node_states_unusable(out) == {"gpu02": "down*", "gpu04": "drained",
                                               "gpu05": "allocated*", "gpu06": "draining"}
    assert slurm.node_hostnames("node1,node2") == ["node1", "node2"]  # no ranges: no scontrol


def test_rank_env_from_a_tasks_variables():
    task = {"SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "99",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    assert rank_env(task) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                                    "LOCAL_SIZE": "8"}


def test_time_and_derived_time_limit():
    assert slurm.slurm_time_seconds("90") == 5400  # Slurm: minutes
    assert slurm.slurm_time_seconds("1-00:00:00") == 86400
    with pytest.raises(ValueError):
        slurm.slurm_time_seconds("2h")  # not Slurm's
    assert slurm.derived_time_limit("1:00:00", 300, None) == 3300
    assert slurm.derived_time_limit("1:00:00", 300, "30m") is None  # the recipe's own
    assert slurm.derived_time_limit(None, 300, None) is None


def _script(**fields) -> str:
    job = slurm.BatchJob(**{**dict(
        recipe="/r/x.yaml", run_dir="/runs/x", job_name="dsforge-x", nodes=2, tasks_per_node=8,
        gpus_per_node=8, time="4:00:00", partition="gpu", signal_grace_s=300,
        output="/runs/x.slurm-%j.out", workdir="/w", run_args=("--set", "train.steps=9")),
        **fields})
    return slurm.sbatch_script(job, command_line="dsforge sbatch x.yaml")


def test_sbatch_script_lines():
    script = _script()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=4:00:00", "#SBATCH --partition=gpu", "#SBATCH --signal=B:TERM@300",
                 "#SBATCH --requeue", "--stop-grace 285 --resume-or-start --set train.steps=9)",
                 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in script
    assert "--account" not in script and "--gpus-per-node" not in _script(gpus_per_node=0)
    assert "--no-kill" not in script


def test_sbatch_script_with_spare_nodes_and_restarts():
    script = _script(spare_nodes=1, restarts=True)
    assert "#SBATCH --nodes=3  " in script and "# 2 for the job, 1 standing by" in script
    assert "#SBATCH --no-kill" in script  # a failed node does not revoke the allocation
    # nodes dsforge run left out: requeued held, excluded, released
    for line in ('scontrol requeuehold "$SLURM_JOB_ID"',
                 'scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$EXCLUDE"',
                 'scontrol release "$SLURM_JOB_ID"', 'EXCLUDE="$BEFORE,$EXCLUDE"'):
        assert line in script
    problems = slurm.batch_problems(world=16, nodes=2, gpus_per_node=8, time=None,
                                    signal_grace_s=300, spare_nodes=1, max_restarts=0)
    assert "spare nodes stand by for restarts, and the job has none" in str(problems[0])


def test_sbatch_script_is_valid_bash(tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(_script())
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
