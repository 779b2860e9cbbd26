"""Slurm: `dsforge run --launcher slurm` inside an allocation, and `dsforge sbatch`'s script.

Inside an allocation (salloc, or the batch script `dsforge sbatch` writes) `dsforge run`
starts the ranks with one `srun` (one task a rank), each task running dsforge's own rank
program, `python -m dsforge.runtime.rank --job WORD`, the same program and job word that
DeepSpeed's launcher starts on one machine. Not DeepSpeed's SlurmRunner: it runs
`srun python -u SCRIPT` with no RANK, WORLD_SIZE or LOCAL_RANK and no `--module`, and passes
the environment through `--export=ALL,NAME=value` on a command line. Here each task maps its
own Slurm variables (`rank_env`: RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS,
LOCAL_RANK = SLURM_LOCALID) and gets MASTER_ADDR (the allocation's first host) and
MASTER_PORT from `dsforge run`'s environment, which srun passes on.

Everything else is the local launcher's (launch/local.py): the job's output through
`dsforge run`'s reader, success as every rank reporting completion, exit 75 after a stop
request. One difference: a stop request (SIGTERM or SIGUSR1 to `dsforge run`) reaches the
ranks as SIGUSR1 sent to srun, which passes it to every task; srun answers SIGTERM itself
by killing its tasks (SIGKILL), which would cut their save short.

The parsing and checks are pure; `allocation_from_env`'s caller supplies `scontrol show
hostnames` (`node_hostnames`).
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping

from dsforge.job.slurm_env import expand_counts
from dsforge.problems import Problem
from dsforge.recipe.hostfile import Hostfile

# srun is sent this on a stop request: it passes SIGUSR1 to its tasks, but answers SIGTERM
# by SIGKILLing them.
STOP_SIGNAL_TO_SRUN = "SIGUSR1"
# MASTER_PORT when `dsforge run` is not on the allocation's first node (salloc from a login
# node), so it cannot pick a free port there: one of PORT_SPAN ports from the job id.
PORT_BASE, PORT_SPAN = 20000, 20000



@dataclass(frozen=True, kw_only=True)
class Allocation:
    """What Slurm granted the job, from the variables salloc/sbatch set."""

    job_id: str
    nodes: int  # SLURM_JOB_NUM_NODES
    nodelist: str  # SLURM_JOB_NODELIST, compressed ("node[01-04]")
    tasks: int | None = None  # SLURM_NTASKS, when the job asked for tasks
    tasks_per_node: int | None = None  # SLURM_NTASKS_PER_NODE, when asked for
    cpus_per_node: tuple[int, ...] = ()  # SLURM_JOB_CPUS_PER_NODE, one a node
    cpus_per_task: int | None = None  # SLURM_CPUS_PER_TASK
    gpus_per_node: int | None = None  # SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE

    def describe(self) -> str:
        parts = [f"{self.nodes} node{'s' if self.nodes > 1 else ''}"]
        if self.tasks is not None:
            parts.append(f"{self.tasks} tasks")
        if self.tasks_per_node is not None:
            parts.append(f"{self.tasks_per_node} tasks a node")
        if self.cpus_per_node:
            parts.append(f"{min(self.cpus_per_node)} CPUs a node")
        if self.gpus_per_node:
            parts.append(f"{self.gpus_per_node} GPUs a node")
        return f"job {self.job_id}: " + ", ".join(parts)


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


def outside_allocation_problem(recipe: str) -> Problem:
    return Problem(rule="SL1", fields={"--launcher": "slurm", "SLURM_JOB_ID": "(not set)"},
                   message="not inside a Slurm allocation: --launcher slurm starts the ranks "
                           "with srun in the job that runs it",
                   fix=f"write a batch script with `dsforge sbatch {recipe} --out job.sh` and "
                       "submit it (`sbatch job.sh`), or run inside `salloc`")


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "")
        if value:
            return expand_counts(value)[0]  # "8(x2)" in SLURM_NTASKS_PER_NODE on some versions
    return None


def allocation_from_env(environ: Mapping[str, str]) -> Allocation:
    cpus = environ.get("SLURM_JOB_CPUS_PER_NODE", "")
    return Allocation(
        job_id=environ["SLURM_JOB_ID"],
        nodes=_int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1,
        nodelist=environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST", "")),
        tasks=_int(environ, "SLURM_NTASKS"),
        tasks_per_node=_int(environ, "SLURM_NTASKS_PER_NODE"),
        cpus_per_node=expand_counts(cpus) if cpus else (),
        cpus_per_task=_int(environ, "SLURM_CPUS_PER_TASK"),
        gpus_per_node=_int(environ, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"))


def ranks_per_node(world: int, allocation: Allocation, *, cpu: bool,
                   spare_nodes: int = 0) -> tuple[int, list[Problem]]:
    """Tasks a node for `world` ranks spread evenly over the allocation's nodes but
    `spare_nodes` (which stand by for restarts), and the problems (rule SL2) when the
    allocation cannot hold them. `cpu`: CPU ranks (no GPU in the allocation, or --device cpu);
    else one rank a GPU."""
    where = {"recipe's world": world, "allocation": allocation.describe()}
    nodes = allocation.nodes - spare_nodes
    if nodes < 1:
        return 0, [Problem(rule="SL2", fields={**where, "--spare-nodes": spare_nodes},
                           message=f"--spare-nodes {spare_nodes} leaves none of the "
                                   f"allocation's {allocation.nodes} nodes for the job",
                           fix="ask for the job's nodes plus the spares (`dsforge sbatch "
                               "--spare-nodes S` does), or give fewer --spare-nodes")]
    if world % nodes:
        spares = f" ({spare_nodes} kept spare)" if spare_nodes else ""
        return 0, [Problem(rule="SL2", fields=where,
                           message=f"{world} ranks cannot be spread evenly over "
                                   f"{nodes} nodes{spares}",
                           fix="ask for a number of nodes that divides the world size "
                               "(sbatch/salloc --nodes), or change it (--world-size, "
                               "parallel.*)")]
    per_node = world // nodes
    capacity, what = _capacity(allocation, cpu=cpu)
    problems = []
    if capacity is not None and per_node > capacity:
        problems.append(Problem(
            rule="SL2", fields=where,
            message=f"{per_node} ranks a node, but the allocation has {capacity} {what} a node",
            fix=f"ask for {per_node} {what} a node ("
                + ("--gpus-per-node" if what == "GPUs" else "--ntasks-per-node")
                + f"={per_node}, e.g. `dsforge sbatch RECIPE --nodes {nodes}`), or "
                  "shrink the world (--world-size, parallel.*)"))
    elif allocation.tasks is not None and world < allocation.tasks * nodes // allocation.nodes:
        problems.append(Problem(rule="SL2", fields=where, severity="warning",
                                message=f"the job uses {world} of the allocation's "
                                        f"{allocation.tasks} tasks"))
    return per_node, problems


def _capacity(allocation: Allocation, *, cpu: bool) -> tuple[int | None, str]:
    """Ranks a node can take, and in what unit."""
    if not cpu and allocation.gpus_per_node:
        return allocation.gpus_per_node, "GPUs"
    if allocation.tasks_per_node is not None:
        return allocation.tasks_per_node, "tasks"
    if allocation.tasks is not None:
        return allocation.tasks // allocation.nodes, "tasks"
    if allocation.cpus_per_node:
        return min(allocation.cpus_per_node) // (allocation.cpus_per_task or 1), "CPUs"
    return None, "tasks"


def node_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames NODELIST`: the allocation's hosts, first one first. A list
    without ranges ("node1,node2") is its own expansion."""
    if "[" not in nodelist:
        return [name for name in nodelist.split(",") if name]
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, timeout=10, check=True).stdout
    return out.split()


# sinfo's node states (%T, lower case) in which a node cannot run a rank: Slurm marks it so
# when its slurmd stops answering, its health check fails or an admin drains it.
UNUSABLE_STATES = ("down", "drain", "fail", "not_responding", "inval", "unknown", "future")


def unusable_nodes(hosts: list[str], timeout_s: float = 10.0) -> dict[str, str]:
    """The nodes of `hosts` Slurm says cannot run a rank, with their state (sinfo); none when
    sinfo does not answer (the restart's srun then finds out)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %T"],
                             capture_output=True, text=True, timeout=timeout_s,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return node_states_unusable(out)


def node_states_unusable(sinfo_out: str) -> dict[str, str]:
    """sinfo `%N %T` lines' nodes whose state is unusable (a trailing * is Slurm's "not
    responding"; a + joins states, "drained+down")."""
    found = {}
    for line in sinfo_out.splitlines():
        node, _, state = line.strip().partition(" ")
        words = state.strip().lower().replace("*", "+not_responding").split("+")
        if node and any(w.startswith(UNUSABLE_STATES) for w in words):
            found[node] = state.strip()
    return found


def master_port_for(allocation: Allocation, first_host: str, free_port, attempt: int = 0) -> int:
    """A free port when this is the first host (a batch script); else one from the job id
    and the attempt, the same for every `dsforge run` of the job (salloc from a login node
    cannot probe the first node's ports)."""
    if first_host in (socket.gethostname(), socket.getfqdn()):
        return free_port()
    digits = re.sub(r"\D", "", allocation.job_id) or "0"
    return PORT_BASE + (int(digits) + attempt) % PORT_SPAN


def srun_command(*, nodes: int, ranks: int, cpus_per_task: int | None,
                 rank_program: list[str]) -> list[str]:
    """One srun for the whole job: `ranks` tasks on `nodes` nodes, each running
    `rank_program`, placed task by task as SLURM_HOSTFILE lists them (--distribution=arbitrary:
    dsforge chooses which node runs which rank, so it knows the host of a failing rank and
    can put a spare node in a failed one's place). --kill-on-bad-exit ends every task when
    one fails, as DeepSpeed's launcher does on a node. --cpus-per-task is given explicitly:
    srun 22.05+ does not take it from sbatch."""
    command = ["srun", f"--nodes={nodes}", f"--ntasks={ranks}", "--distribution=arbitrary",
               "--kill-on-bad-exit=1", "--export=ALL"]
    if cpus_per_task:
        command.append(f"--cpus-per-task={cpus_per_task}")
    return command + rank_program


def task_hosts(hostfile: Hostfile) -> str:
    """SLURM_HOSTFILE's text for the hosts in use: a line a task, in rank order."""
    return "".join(f"{host}\n" * slots for host, slots in hostfile.hosts)


# ---------------------------------------------------------------------------------------------
# dsforge sbatch


@dataclass(frozen=True, kw_only=True)
class BatchJob:
    """Everything `dsforge sbatch` writes into a batch script."""

    recipe: str  # absolute path
    run_dir: str  # absolute path; the same for every requeue of the job
    job_name: str
    nodes: int  # the nodes the job runs on
    tasks_per_node: int
    gpus_per_node: int  # 0: CPU ranks
    spare_nodes: int = 0  # more nodes, standing by for the restarts (--spare-nodes)
    restarts: bool = False  # dsforge run restarts inside the allocation (--max-restarts)
    time: str | None = None  # Slurm's --time
    partition: str | None = None
    account: str | None = None
    signal_grace_s: int = 300
    output: str = ""  # Slurm's --output
    workdir: str = ""
    run_args: tuple[str, ...] = ()  # more `dsforge run` arguments (--set, --world-size)
    dsforge: tuple[str, ...] = ("dsforge",)  # how to run dsforge on the nodes

    @property
    def stop_grace_s(self) -> int:
        """`dsforge run --stop-grace`: the ranks' time to save, ending before Slurm's kill."""
        return max(1, self.signal_grace_s - 15)


def sbatch_script(job: BatchJob, *, command_line: str) -> str:
    """The batch script, commented for a reader who will edit it."""
    q = shlex.quote
    sbatch = [f"--job-name={job.job_name}", f"--nodes={job.nodes + job.spare_nodes}",
              f"--ntasks-per-node={job.tasks_per_node}"]
    notes = ["", f"{job.nodes} for the job, {job.spare_nodes} standing by" if job.spare_nodes
             else "", "one task a rank"]
    if job.gpus_per_node:
        sbatch.append(f"--gpus-per-node={job.gpus_per_node}")
        notes.append("one GPU a rank")
    if job.time:
        sbatch.append(f"--time={job.time}")
        notes.append("")
    for name, value in (("partition", job.partition), ("account", job.account)):
        if value:
            sbatch.append(f"--{name}={value}")
            notes.append("")
    if job.restarts:
        sbatch.append("--no-kill")
        notes.append("a failed node does not end the job: dsforge run restarts without it")
    sbatch += [f"--output={job.output}", "--open-mode=append",
               f"--chdir={job.workdir}", f"--signal=B:TERM@{job.signal_grace_s}", "--requeue"]
    notes += ["a requeued job appends to the same file", "", "",
              f"SIGTERM to this script only, {job.signal_grace_s}s before the time limit",
              "this job may be requeued (on preemption, and below)"]
    width = max(len(s) for s in sbatch) + 1
    header = "\n".join(f"#SBATCH {s:<{width}}" + (f"# {n}" if n else "")
                       for s, n in zip(sbatch, notes)).replace(" \n", "\n").rstrip()
    header = "\n".join(line.rstrip() for line in header.splitlines())
    args = " ".join(q(a) for a in job.run_args)
    return f"""#!/bin/bash
# Written by: {command_line}
# Submit with: sbatch THIS_FILE. It trains {job.recipe}
# on {job.nodes} node{'s' if job.nodes > 1 else ''} x {job.tasks_per_node} rank{'s' if job.tasks_per_node > 1 else ''} \
({'GPUs' if job.gpus_per_node else 'CPU ranks'}), the run directory {job.run_dir}.
{header}
set -u

RECIPE={q(job.recipe)}
RUN_DIR={q(job.run_dir)}
DSFORGE=({' '.join(q(w) for w in job.dsforge)})

# dsforge run starts the ranks with srun inside this job (--launcher slurm), one task a rank.
# --stop-grace: after a stop request the ranks get this long to save before dsforge stops
# them at once; it ends before Slurm kills the job. --max-restarts N (when given): after a
# lost rank, dsforge run runs srun again in this allocation from the last checkpoint.
# --resume-or-start: a requeued job (or a job submitted again) continues from the run's
# newest complete checkpoint; one that ended before its first starts again from the beginning.
ARGS=(--launcher slurm --run-dir "$RUN_DIR" --stop-grace {job.stop_grace_s} --resume-or-start{' ' + args if args else ''})

# dsforge run runs in the background so that this shell can take Slurm's signal: with
# --signal=B:... Slurm signals this shell only. The trap passes SIGTERM or SIGUSR1 on to
# dsforge run, which has every rank save a checkpoint after its step and exits 75.
PID=
trap '[ -n "$PID" ] && kill -TERM "$PID" 2>/dev/null' TERM
trap '[ -n "$PID" ] && kill -USR1 "$PID" 2>/dev/null' USR1
"${{DSFORGE[@]}}" run "$RECIPE" "${{ARGS[@]}}" &
PID=$!
# A trapped signal ends `wait` early (code 128+N): wait again while dsforge run still runs.
# The last `wait` gives its exit code even when it ended just after such a signal (bash
# keeps the codes of its background jobs; 127 would mean it has none).
CODE=0
while kill -0 "$PID" 2>/dev/null; do
    wait "$PID"; CODE=$?
done
wait "$PID" 2>/dev/null; LAST=$?
[ "$LAST" != 127 ] && CODE=$LAST

# 75: the ranks stopped with a complete checkpoint (a signal, or train.time_limit). Requeue
# this job: it starts again later and resumes (--resume-or-start, above). Any other code is final: 65 (the
# training went bad: non-finite values or a loss spike) needs a change the report names.
# $RUN_DIR/requeue_exclude: dsforge run left failing nodes out and the nodes left could not
# hold the job. Slurm changes a job's excluded nodes only while it is pending: requeue it held,
# add them to ExcNodeList (retried: the job turns pending once its steps have ended, and
# Slurm's SIGTERM to this shell interrupts a command; the trap above keeps the shell), then
# release it.
if [ "$CODE" = 75 ] && [ -s "$RUN_DIR/requeue_exclude" ]; then
    EXCLUDE=$(cat "$RUN_DIR/requeue_exclude"); rm -f "$RUN_DIR/requeue_exclude"
    BEFORE=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
    if [ -n "$BEFORE" ] && [ "$BEFORE" != "(null)" ]; then EXCLUDE="$BEFORE,$EXCLUDE"; fi
    echo "dsforge sbatch: resumable stop (exit 75); requeueing job $SLURM_JOB_ID without $EXCLUDE" >&2
    scontrol requeuehold "$SLURM_JOB_ID"
    for TRY in $(seq 40); do
        scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$EXCLUDE" 2>/dev/null && break
        sleep 0.5
    done
    scontrol release "$SLURM_JOB_ID"
elif [ "$CODE" = 75 ]; then
    echo "dsforge sbatch: resumable stop (exit 75); requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$CODE"
"""


def dsforge_words() -> tuple[str, ...]:
    """How the batch script runs dsforge: this Python, `-m dsforge`, from the directory the
    script was written in (--chdir), so the nodes run the dsforge that wrote it."""
    return (sys.executable, "-m", "dsforge")


@dataclass(frozen=True, kw_only=True)
class SlurmPlan:
    """How `dsforge run --launcher slurm` starts a job in this allocation."""

    allocation: Allocation
    hostfile: Hostfile  # the nodes in use in rank order, with their ranks; the spare nodes
    master_addr: str | None  # --master-addr; else each attempt's first node in use
    master_port: int

    @property
    def nodes(self) -> int:
        return len(self.hostfile.hosts)

    @property
    def per_node(self) -> int:
        return self.hostfile.hosts[0][1]

    def address(self, hostfile: Hostfile) -> str:
        return self.master_addr or hostfile.hosts[0][0]

    def command(self, hostfile: Hostfile, rank_program: list[str]) -> list[str]:
        """srun for the ranks of `hostfile`'s nodes (this plan's, or what a restart left)."""
        return srun_command(nodes=len(hostfile.hosts), ranks=hostfile.total_slots,
                            cpus_per_task=self.allocation.cpus_per_task,
                            rank_program=rank_program)

    def env(self, hostfile: Hostfile, task_hosts_file: str) -> dict[str, str]:
        """Added to srun's environment, which srun passes to every task; `task_hosts_file`
        holds `task_hosts(hostfile)`."""
        return {"MASTER_ADDR": self.address(hostfile), "MASTER_PORT": str(self.master_port),
                "SLURM_HOSTFILE": task_hosts_file}


def plan_job(world: int, environ: Mapping[str, str], *, cpu_only: bool,
             master_addr: str | None, master_port: int | None, free_port,
             hostnames=node_hostnames, spare_nodes: int = 0) -> tuple[SlurmPlan | None, list[Problem]]:
    """The plan for `world` ranks in the allocation `environ` describes, its last
    `spare_nodes` nodes standing by, and the problems (SL2: a world the allocation cannot
    hold, nodes scontrol cannot name); None on errors. `cpu_only`: --device cpu. Otherwise
    ranks use GPUs when the allocation has them."""
    allocation = allocation_from_env(environ)
    cpu = cpu_only or not allocation.gpus_per_node
    per_node, problems = ranks_per_node(world, allocation, cpu=cpu, spare_nodes=spare_nodes)
    if any(p.severity == "error" for p in problems):
        return None, problems
    try:
        names = hostnames(allocation.nodelist)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        detail = (str(detail).strip().splitlines() or [""])[-1]
        return None, problems + [Problem(
            rule="SL2", fields={"SLURM_JOB_NODELIST": allocation.nodelist},
            message=f"`scontrol show hostnames` could not name the allocation's nodes: {detail}",
            fix="check that scontrol works here (SLURM_CONF, slurmctld reachable)")]
    if len(names) != allocation.nodes:
        return None, problems + [Problem(
            rule="SL2", fields={"SLURM_JOB_NODELIST": allocation.nodelist,
                                "SLURM_JOB_NUM_NODES": allocation.nodes},
            message=f"the node list names {len(names)} nodes, not {allocation.nodes}",
            fix="run dsforge inside the allocation's own environment (salloc or sbatch)")]
    used = len(names) - spare_nodes
    hostfile = Hostfile(hosts=tuple((name, per_node) for name in names[:used]),
                        spares=tuple((name, per_node) for name in names[used:]),
                        source=f"Slurm job {allocation.job_id}")
    port = master_port or master_port_for(allocation, master_addr or names[0], free_port)
    return SlurmPlan(allocation=allocation, hostfile=hostfile, master_addr=master_addr,
                     master_port=port), problems


def slurm_time_seconds(text: str) -> int:
    """Seconds of Slurm's --time: minutes as a bare number, else MM:SS, HH:MM:SS, D-HH,
    D-HH:MM or D-HH:MM:SS (ValueError otherwise)."""
    from dsforge.schema import time_limit_seconds

    text = text.strip()
    if text.isascii() and text.isdigit():
        return int(text) * 60
    if ":" not in text and "-" not in text:
        raise ValueError(f"{text!r} is not a Slurm time (minutes, MM:SS, HH:MM:SS, D-HH:MM:SS)")
    return time_limit_seconds(text)


def derived_time_limit(time: str | None, signal_grace_s: int, recipe_limit) -> int | None:
    """train.time_limit for a job of Slurm --time `time`: the limit less the signal's lead, so
    the ranks also stop by themselves (they allow for their step and save times) before
    Slurm's signal; None when the recipe sets its own, without --time, or when too short."""
    if time is None or recipe_limit is not None:
        return None
    seconds = slurm_time_seconds(time) - signal_grace_s
    return seconds if seconds >= 60 else None


def batch_problems(*, world: int, nodes: int, gpus_per_node: int, time: str | None,
                   signal_grace_s: int, spare_nodes: int = 0,
                   max_restarts: int = 0) -> list[Problem]:
    """SB1: what `dsforge sbatch` cannot write a working script for."""
    problems = []
    if spare_nodes and not max_restarts:
        problems.append(Problem(rule="SB1", fields={"--spare-nodes": spare_nodes},
                                message="spare nodes stand by for restarts, and the job has none",
                                fix="give --max-restarts N, or leave out --spare-nodes"))
    if world % nodes:
        problems.append(Problem(rule="SB1", fields={"world": world, "--nodes": nodes},
                                message=f"{world} ranks cannot be spread evenly over {nodes} nodes",
                                fix="give a --nodes that divides the world size"))
    if time is not None:
        try:
            seconds = slurm_time_seconds(time)
        except ValueError as exc:
            problems.append(Problem(rule="SB1", fields={"--time": time}, message=str(exc),
                                    fix="e.g. --time 30 (minutes), 1:30:00 or 2-00:00:00"))
        else:
            if seconds <= signal_grace_s:
                problems.append(Problem(
                    rule="SB1", fields={"--time": time, "--signal-grace": signal_grace_s},
                    message="the stop signal would come before the job starts",
                    fix="give a longer --time or a shorter --signal-grace"))
    return problems
