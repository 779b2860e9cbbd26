"""A failing host left out of the restarts (issue 50): which host failed, when it is left out,
the spare that takes its place, and the restart's words and records. The run over loopback
hosts is tests/distributed/test_multinode.py's."""

from __future__ import annotations

import pytest

from dsforge.job import failure
from dsforge.job.failure import Failure
from dsforge.job.hosts import HOSTS_ENV, host_of_rank
from dsforge.job.run_dir import RunDir
from dsforge.job.word import JobSpec
from dsforge.launch.host_pool import (CannotLeaveOut, HostPool, HostsFailed, failing_hosts,
                                      hosts_env)
from dsforge.launch.refusal import Refused
from dsforge.launch.restart import run_with_restarts
from dsforge.problems import Problem, RecipeError
from dsforge.recipe.hostfile import parse_hostfile
from dsforge.runtime.guard.drills import parse_fault

HOSTFILE = ["node-a slots=2", "node-b slots=2", "#spare node-c slots=2", "# spare node-d slots=1"]


def _pool(**options) -> HostPool:
    return HostPool(parse_hostfile(HOSTFILE), **options)


def test_spares_are_comments_deepspeed_skips():
    from deepspeed.launcher.runner import _parse_hostfile

    hostfile = parse_hostfile(HOSTFILE)
    assert hostfile.hosts == (("node-a", 2), ("node-b", 2)) and hostfile.total_slots == 4
    assert hostfile.spares == (("node-c", 2), ("node-d", 1))
    assert dict(_parse_hostfile(hostfile.text().splitlines())) == {"node-a": 2, "node-b": 2}
    with pytest.raises(RecipeError, match="duplicate host"):
        parse_hostfile(["node-a slots=1", "#spare node-a slots=1"])
    with pytest.raises(RecipeError, match=r"\[H2\]"):
        parse_hostfile(["node-a slots=1", "#spare -oProxyCommand=x slots=1"])


def test_the_shipped_example_has_a_spare():
    from dsforge.recipe.hostfile import read_hostfile
    from tests.conftest import REPO

    example = read_hostfile(REPO / "hostfiles" / "with_spare.txt")
    assert example.node_slots == (8, 8) and example.spares == (("node-c", 8),)


def test_ranks_are_numbered_host_by_host():
    pool = _pool()
    assert [pool.host_of(rank) for rank in range(5)] == ["node-a", "node-a", "node-b", "node-b",
                                                         None]
    encoded = hosts_env(pool.hostfile)[HOSTS_ENV]
    assert host_of_rank(encoded, 3) == "node-b" and host_of_rank(encoded, 4) is None


@pytest.mark.parametrize("kind, message, after", [
    ("device", "CUDA error: uncorrectable ECC error", 1),
    ("killed", "ended on node-b without a record (its host or its supervisor is gone)", 1),
    ("hang", "step 5 made no progress", 2), ("collective", "gloo: connection reset", 2)])
def test_a_host_is_left_out_after_its_share_of_failures(kind, message, after):
    pool, cause = _pool(), Failure(rank=3, step=4, kind=kind, message=message)
    blamed = [pool.blame(cause) for _ in range(after)]
    assert blamed == [None] * (after - 1) + ["node-b"]
    assert _pool(exclude_after=3).blame(cause) is None
    preflight = _pool()
    assert preflight.blame_preflight("node-a")  # a failed preflight: at once


def test_a_spare_with_the_same_slots_takes_the_place_of_the_host(tmp_path):
    pool = _pool()
    pool.blame(Failure(rank=2, step=1, kind="device", message="lost"))
    assert pool.leave_out("node-b", pool.why("node-b"), attempt=1) == "node-c"
    assert pool.hostfile.hosts == (("node-a", 2), ("node-c", 2))  # same position, same ranks
    assert pool.left_out == [{"host": "node-b", "why": "1 failure there: a rank lost with its "
                              "host or device", "attempt": 1, "replaced_by": "node-c",
                              "hosts_after": ["node-a", "node-c"]}]
    path = pool.write(tmp_path, attempt=1)
    assert open(path).read() == "node-a slots=2\nnode-c slots=2\n#spare node-d slots=1\n"
    assert pool.leave_out("node-a", "x", attempt=2) is None  # no spare with 2 slots: fewer hosts
    assert pool.hostfile.hosts == (("node-c", 2),)
    with pytest.raises(CannotLeaveOut, match="--include/--exclude chose slots"):
        _pool(slots_chosen=True).leave_out("node-a", "x", attempt=1)


def test_the_preflights_errors_name_the_failing_hosts():
    problems = [Problem(rule="F1", fields={"host": "node-b"}, message="cannot run Python"),
                Problem(rule="F2", fields={"host": "node-a"}, message="slow", severity="warning"),
                Problem(rule="F1", fields={"host": "elsewhere"}, message="not ours")]
    assert failing_hosts(problems, parse_hostfile(HOSTFILE)) == ["node-b"]


def test_the_host_drill_names_a_host():
    assert parse_fault("host-down:node-b:3") == ("host-down", "node-b", 3)
    assert parse_fault("exit:1:3") == ("exit", 1, 3)


def _attempt(run_dir: RunDir, outcomes: list, note):
    """A fake attempt: `note()` when it runs, then a failure record of the next of `outcomes`
    (rank, kind) and exit code 1, or 0 when none is left."""
    def go():
        note()
        if not outcomes:
            return 0
        rank, kind = outcomes.pop(0)
        failure.write(run_dir, Failure(rank=rank, step=3, kind=kind, message=f"{kind} here"))
        return 1
    return go


def _restarted(tmp_path, outcomes, prepare_fails=()):
    """run_with_restarts over a pool, fake attempts failing on `outcomes` (rank, kind), and a
    prepare whose preflight fails the hosts of `prepare_fails` (once each)."""
    run_dir, said, jobs = RunDir(tmp_path), [], []
    pool, outcomes, failing = _pool(), list(outcomes), list(prepare_fails)

    def start(job):
        return _attempt(run_dir, outcomes, lambda: jobs.append((job, pool.hostfile.hosts)))

    def prepare(job):
        down = [h for h in failing if h in pool.hostfile.hostnames]
        if down:
            failing.remove(down[0])
            refused = Refused("preflight", [Problem(rule="F1", fields={"host": down[0]},
                                                     message="cannot run Python over ssh")])
            raise HostsFailed([down[0]], refused)
        return start(job)

    job = JobSpec(recipe_yaml="", run_dir=str(run_dir), started_at=1000.0)
    code = run_with_restarts(job, start(job), max_restarts=3, prepare=prepare, say=said.append,
                             hosts=pool)
    return code, said, jobs, pool


def test_a_host_that_fails_twice_is_replaced_before_the_same_failure_ends_the_job(tmp_path):
    code, said, jobs, pool = _restarted(tmp_path, [(2, "hang"), (3, "hang")])
    assert code == 0 and [hosts for _, hosts in jobs][-1] == (("node-a", 2), ("node-c", 2))
    assert "node-c in place of node-b (2 failures there: a hang failure, a hang failure)" in said[1]
    last = jobs[-1][0].restarts[-1]
    assert last["host"] == "node-b" and last["left_out"][0]["replaced_by"] == "node-c"


def test_a_host_that_fails_the_preflight_is_replaced_and_the_spare_checked(tmp_path):
    code, said, jobs, pool = _restarted(tmp_path, [(0, "killed")], prepare_fails=["node-a"])
    assert code == 0 and jobs[-1][1] == (("node-c", 2), ("node-b", 2))
    assert "node-c in place of node-a (2 failures there: a killed failure, a failed preflight)" \
        in said[0]
    assert jobs[-1][0].restarts[-1]["host"] == "node-a"


def test_without_a_spare_the_job_goes_on_fewer_hosts_until_none_is_left(tmp_path):
    code, said, jobs, pool = _restarted(tmp_path, [(2, "device"), (3, "device"), (0, "device")])
    assert code == 1 and [hosts for _, hosts in jobs] == [
        (("node-a", 2), ("node-b", 2)), (("node-a", 2), ("node-c", 2)), (("node-a", 2),)]
    assert "; without node-c (1 failure there" in said[1]
    assert jobs[-1][0].restarts[-1]["left_out"][0]["hosts_after"] == ["node-a"]
    assert "not restarted: node-a is left out" in said[-1] and "no host is left" in said[-1]


def test_fewer_hosts_shrink_dp_and_keep_the_global_batch():
    from dsforge.launch.host_pool import layout_change, on_fewer_hosts
    from dsforge.recipe import resolve_file
    from tests.conftest import REPO

    two = resolve_file(REPO / "recipes" / "tiny.yaml")
    one = on_fewer_hosts(two, parse_hostfile(["node-a slots=1"]))
    assert (one.layout.dp, one.layout.grad_accum, one.layout.global_batch) == (1, 4, 8)
    assert layout_change(two, one) == ("world_size 2 -> 1, dp 2 -> 1, edp 2 -> 1, grad_accum "
                                       "2 -> 4 (global batch 8 kept)")
    tp2 = resolve_file(REPO / "recipes" / "tiny.yaml", ["parallel.dp=1", "parallel.tp=2"])
    with pytest.raises(RecipeError, match=r"\[P2\].*groups of tp x pp x cp = 2"):
        on_fewer_hosts(tp2, parse_hostfile(["node-a slots=1"]))
    odd = resolve_file(REPO / "recipes" / "tiny.yaml", ["train.global_batch=6", "parallel.dp=3"],
                       world_size=3)
    with pytest.raises(RecipeError, match=r"\[B2\]"):
        on_fewer_hosts(odd, parse_hostfile(["node-a slots=2"]))


def test_plan_says_what_losing_a_host_does(tmp_path):
    from dsforge.launch.host_pool import host_loss
    from dsforge.plan import build_plan, render_plan
    from dsforge.recipe import resolve_file
    from tests.conftest import REPO

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    recipe = REPO / "recipes" / "tiny.yaml"
    dp2 = resolve_file(recipe, hostfile=hostfile)
    assert host_loss(dp2) == {"continues": True, "world_size": 1, "change": (
        "world_size 2 -> 1, dp 2 -> 1, edp 2 -> 1, grad_accum 2 -> 4 (global batch 8 kept)")}
    tp2 = resolve_file(recipe, ["parallel.dp=1", "parallel.tp=2"], hostfile=hostfile)
    assert not host_loss(tp2)["continues"] and "[P2] hostfile the hosts left" in host_loss(tp2)["why"]
    assert host_loss(resolve_file(recipe)) is None  # one host
    assert "a host lost without a spare (dsforge run --max-restarts): cannot go on: [P2]" in \
        render_plan(build_plan(tp2, device="cpu"))


def test_a_layout_that_cannot_shrink_refuses_the_restart_with_its_reason(tmp_path):
    """tp 2 over two one-slot hosts: without node-b no tp group is left (rule P2)."""
    from dsforge.launch.starts import DeepSpeedStarts, RunOptions
    from dsforge.recipe import resolve_file
    from tests.conftest import REPO

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    recipe = str(REPO / "recipes" / "tiny.yaml")
    sets = ("parallel.dp=1", "parallel.tp=2")
    options = RunOptions(recipe=recipe, hostfile=str(hostfile), overrides=sets, max_restarts=1)
    starts = DeepSpeedStarts(options, resolve_file(recipe, sets, hostfile=hostfile), print)
    assert starts.pool.leave_out("node-b", "a drill", attempt=1) is None
    with pytest.raises(Refused, match=r"the job on the hosts left \(node-a\)") as refused:
        starts._on_fewer_hosts()
    assert [p.rule for p in refused.value.problems] == ["P2"]


def test_exclude_after_and_spare_nodes_need_restarts_and_hosts():
    from dsforge.launch.checks import check_option_pairs
    from dsforge.launch.entry import RunOptions
    from dsforge.launch.refusal import BadOptions

    for options in (RunOptions(recipe="r", exclude_after=1, max_restarts=1),
                    RunOptions(recipe="r", exclude_after=1, hostfile="h"),
                    RunOptions(recipe="r", exclude_after=1, launcher="slurm")):
        with pytest.raises(BadOptions, match="--exclude-after leaves a failing host"):
            check_option_pairs(options)
    for options in (RunOptions(recipe="r", spare_nodes=1, max_restarts=1),
                    RunOptions(recipe="r", spare_nodes=1, launcher="slurm")):
        with pytest.raises(BadOptions, match="--spare-nodes keeps Slurm nodes standing by"):
            check_option_pairs(options)
    check_option_pairs(RunOptions(recipe="r", exclude_after=1, spare_nodes=1, max_restarts=1,
                                  launcher="slurm"))


# Slurm: the same pool over the allocation's nodes (launch/starts.SrunStarts) -----------------

def _slurm_restarted(tmp_path, monkeypatch, *, nodes: int, spare: int, outcomes, sets=(),
                     states=None):
    """run_with_restarts over SrunStarts in a fake allocation of nodes n1..nN (one rank a
    node; the last `spare` standing by) for the tiny recipe with `sets`; attempts fail on
    `outcomes` (rank, kind); `states`: sinfo's unusable nodes before each restart, in turn.
    (code, lines said, each attempt's Start)."""
    from dsforge.launch import restart, slurm, starts as starts_module
    from dsforge.launch.run_options import RunOptions
    from dsforge.recipe import resolve_file
    from tests.conftest import REPO

    states = list(states or [])
    monkeypatch.setattr(starts_module, "unusable_nodes",
                        lambda hosts: states.pop(0) if states else {})
    monkeypatch.setattr(restart, "_has_checkpoint", lambda run_dir: True)
    recipe = str(REPO / "recipes" / "tiny.yaml")
    resolved = resolve_file(recipe, list(sets))
    names = [f"n{i}" for i in range(1, nodes + 1)]
    allocation = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": str(nodes),
                  "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": f"n[1-{nodes}]"}
    plan, problems = slurm.plan_job(resolved.layout.world_size, allocation, cpu_only=True,
                                    master_addr=None, master_port=29500, free_port=lambda: 1,
                                    hostnames=lambda _: names, spare_nodes=spare)
    assert plan is not None, problems
    options = RunOptions(recipe=recipe, overrides=tuple(sets), launcher="slurm", max_restarts=3,
                         spare_nodes=spare)
    said, started, outcomes = [], [], list(outcomes)
    starts = starts_module.SrunStarts(options, plan, resolved, said.append)
    run_dir = RunDir(tmp_path)

    def attempt(how):
        return _attempt(run_dir, outcomes, lambda: started.append(how))

    job = JobSpec(recipe_yaml="", run_dir=str(run_dir), started_at=1000.0)
    code = run_with_restarts(job, attempt(starts.first(job)), max_restarts=3,
                             prepare=lambda job: attempt(starts.again(job)), say=said.append,
                             hosts=starts.pool)
    return code, said, started


def _tasks(start) -> list[str]:
    return open(start.srun_env["SLURM_HOSTFILE"]).read().split()


def _word_of(start) -> JobSpec:
    return JobSpec.decode(start.command[start.command.index("--job") + 1])


def test_a_slurm_restart_puts_a_spare_node_in_the_failed_ones_place(tmp_path, monkeypatch):
    code, said, started = _slurm_restarted(tmp_path, monkeypatch, nodes=3, spare=1,
                                           outcomes=[(1, "device")])
    assert code == 0 and [_tasks(s) for s in started] == [["n1", "n2"], ["n1", "n3"]]
    assert started[1].command[:4] == ["srun", "--nodes=2", "--ntasks=2",
                                      "--distribution=arbitrary"]
    assert _word_of(started[1]).env[HOSTS_ENV] == "n1=1,n3=1"  # the ranks' hosts, for drills
    assert "n3 in place of n2 (1 failure there: a rank lost with its host or device)" in said[0]
    # a new port for the restart: from the job id (7) and the attempt, n1 not being this host
    assert started[1].srun_env["MASTER_PORT"] == str(20000 + 7 + 1)


def test_a_node_slurm_calls_down_is_left_out_before_the_restart(tmp_path, monkeypatch):
    """A hang counts once against n1 (K=2 for a hang); then sinfo says n1 is down: the
    restart's check leaves it out, the spare n3 takes rank 0."""
    code, said, started = _slurm_restarted(tmp_path, monkeypatch, nodes=3, spare=1,
                                           outcomes=[(0, "hang")], states=[{"n1": "down*"}])
    assert code == 0 and _tasks(started[1]) == ["n3", "n2"]
    assert started[1].srun_env["MASTER_ADDR"] == "n3"  # each attempt's first node
    assert "n3 in place of n1 (2 failures there: a hang failure, a failed preflight)" in said[0]


def test_without_a_spare_node_the_job_goes_on_fewer_nodes(tmp_path, monkeypatch):
    """n2 fails: the job goes on on n1 at dp 1; a hang there restarts it on n1 again, still
    the smaller job."""
    code, said, started = _slurm_restarted(tmp_path, monkeypatch, nodes=2, spare=0,
                                           outcomes=[(1, "device"), (0, "hang")])
    assert code == 0 and [_tasks(s) for s in started] == [["n1", "n2"], ["n1"], ["n1"]]
    assert started[1].command[1:3] == ["--nodes=1", "--ntasks=1"] and started[1].ranks == 1
    assert "continuing on 1 host(s) (n1) without a spare: world_size 2 -> 1" in said[0]
    assert all("grad_accum: 4" in _word_of(s).recipe_yaml for s in started[1:])


def test_a_job_the_nodes_left_cannot_hold_ends_for_a_requeue_without_them(tmp_path,
                                                                          monkeypatch):
    """tp 2 over two one-rank nodes: without n2 no tp group is left (P2). The job ends
    resumable (75), RUN_DIR/requeue_exclude naming n2 for the batch script's requeue."""
    from dsforge.launch.host_pool import AllocationShort

    code, said, started = _slurm_restarted(tmp_path, monkeypatch, nodes=2, spare=0,
                                           outcomes=[(1, "device")],
                                           sets=("parallel.dp=1", "parallel.tp=2"))
    assert code == 75 and len(started) == 1
    assert RunDir(tmp_path).requeue_exclude.read_text() == "n2\n"
    assert "not restarted in this allocation: the job on the hosts left (n1): [P2]" in said[-1]
    assert "exit code 75, for a requeue without n2" in said[-1]
    # one node and no spare: no node is left at all; the nodes left out before are excluded too
    pool = HostPool(parse_hostfile(["n1 slots=1", "n2 slots=1"]), in_allocation=True)
    pool.leave_out("n2", "a drill", attempt=1)
    assert isinstance(pool.short("n1", "why"), AllocationShort)
    assert pool.short("n1", "why").hosts == ["n2", "n1"]


def test_a_failure_record_names_its_ranks_host(tmp_path, monkeypatch):
    """The record carries the rank's host from the job's hosts (HOSTS_ENV, as the launcher
    placed the ranks), and the report says it; the pool blames that host."""
    monkeypatch.setenv(HOSTS_ENV, "node-a=2,node-b=2")
    run_dir = RunDir(tmp_path)
    failure.write(run_dir, Failure(rank=2, step=4, kind="device", message="CUDA error"))
    (record,) = failure.read_all(run_dir)
    assert record.host == "node-b"
    assert record.headline() == "rank 2 had a device error at step 5 on node-b: CUDA error"
    assert _pool().blame(record) == "node-b"
    monkeypatch.delenv(HOSTS_ENV)
    failure.write(run_dir, Failure(rank=0, step=4, kind="hang", message="stuck"))
    assert [f.host for f in failure.read_all(run_dir) if f.rank == 0] == [None]  # one machine
