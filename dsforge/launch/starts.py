"""How `dsforge run` starts the ranks of each attempt (launch/entry.py runs them, with
restarts): one srun inside a Slurm allocation (`SrunStarts`), or dsforge's launcher on this
machine (launch/node.py) and DeepSpeed's over a hostfile or on one node with --no-ssh
(`DeepSpeedStarts`); each makes the
command line, and over a hostfile or in an allocation checks the hosts first and leaves out
those the restarts left out (launch/host_pool.py). `--dry-run` prints what they would start.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from dsforge.job.hosts import marked_down
from dsforge.job.run_dir import RunDir
from dsforge.job.word import JobSpec
from dsforge.launch import checks
from dsforge.launch.commands import Placement, launch_command, plain_deepspeed_command
from dsforge.launch.host_pool import (HostPool, HostsFailed, failing_hosts, hosts_env,
                                      layout_change, on_fewer_hosts)
from dsforge.launch.local import free_port
from dsforge.launch.refusal import Refused, Say
from dsforge.launch.remote_end import end_job_on
from dsforge.launch.run_options import RunOptions
from dsforge.launch.slurm import SlurmPlan, master_port_for, task_hosts, unusable_nodes
from dsforge.problems import Problem, RecipeError
from dsforge.recipe import Resolved
from dsforge.recipe.hostfile import Hostfile, active_hosts, read_hostfile
from dsforge.recipe.loader import dump_recipe

NO_SSH_PORT = 29500  # DeepSpeed's default rendezvous port, as `dsforge preflight` checks


@dataclass(frozen=True)
class Start:
    """How this process starts the ranks, and what `--dry-run` prints instead."""

    command: list[str]
    shown: str
    srun_env: dict[str, str] | None = None  # srun's MASTER_ADDR and MASTER_PORT
    ranks: int | None = None  # the ranks it starts, when not the job's first world (fewer hosts)
    # DeepSpeed's runner over a hostfile: it pastes variables into each node's shell, so the
    # environment it gets is runner_env's (launch/commands.py)
    through_runner: bool = False


class SrunStarts:
    """`--launcher slurm`: one srun for every rank of the job (launch/slurm.py), each rank on
    the node SLURM_HOSTFILE gives it; a restart runs srun again inside the same allocation, on
    a new port unless --master-port gave one, without the nodes left out (launch/host_pool.py:
    a spare node of `--spare-nodes` in a failed one's place, else fewer nodes), after Slurm's
    view of the nodes in use (sinfo: down, drained, not responding) passes. A job the nodes
    left cannot hold ends for a requeue without them (launch/restart.py)."""

    def __init__(self, options: RunOptions, plan: SlurmPlan, resolved: Resolved, say: Say):
        self.options, self.plan, self.resolved, self.say = options, plan, resolved, say
        self.pool = HostPool(plan.hostfile, exclude_after=options.exclude_after,
                             in_allocation=True)

    def first(self, job: JobSpec) -> Start:
        hostfile = self.pool.hostfile
        job = dataclasses.replace(job, env={**job.env, **hosts_env(hostfile)})
        command = self.plan.command(hostfile, [sys.executable, "-u", "-m", "dsforge.runtime.rank",
                                               "--job", job.encode()])
        tasks = job.directory.hostfiles / f"slurm-attempt{len(job.restarts)}"
        env = self.plan.env(hostfile, str(tasks))
        if not self.options.dry_run:
            tasks.parent.mkdir(parents=True, exist_ok=True)
            tasks.write_text(task_hosts(hostfile))
        shown = ("# SLURM_HOSTFILE (written when the job starts), a line a rank: "
                 + ", ".join(f"{host} x{slots}" for host, slots in hostfile.hosts) + "\n"
                 + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command) + "\n")
        return Start(command, shown, srun_env=env, ranks=hostfile.total_slots)

    def again(self, job: JobSpec) -> Start:
        self._check_nodes(job)
        if self.options.master_port is None:
            port = master_port_for(self.plan.allocation, self.plan.address(self.pool.hostfile),
                                   free_port, attempt=len(job.restarts))
            self.plan = dataclasses.replace(self.plan, master_port=port)
        if self.pool.hostfile.total_slots != self.resolved.layout.world_size:
            try:
                self.resolved = fewer_hosts(self.resolved, self.pool.hostfile, self.say)
            except Refused as refused:
                raise self.pool.short(self.pool.left_out[-1]["host"], refused.line()) from None
        if self.pool.left_out:  # every attempt after a shrink runs the smaller job's recipe
            job = dataclasses.replace(job, recipe_yaml=dump_recipe(self.resolved.recipe))
        return self.first(job)

    def _check_nodes(self, job: JobSpec) -> None:
        """HostsFailed for nodes in use that the host-down drill marked, or that Slurm says
        cannot run a rank."""
        hosts = list(self.pool.hostfile.hostnames)
        drilled = {h: "unreachable (DSFORGE_INJECT_FAULT host-down drill)"
                   for h in marked_down(job.directory) if h in hosts}
        states = {h: f"Slurm says {state}" for h, state in unusable_nodes(hosts).items()}
        failing = {**states, **drilled}
        if failing:
            problems = [Problem(rule="F1", fields={"host": h}, message=why,
                                fix="Slurm's admins, or a requeue without the node")
                        for h, why in failing.items()]
            raise HostsFailed([h for h in hosts if h in failing],
                              Refused("Slurm's nodes before the restart", problems))


def fewer_hosts(resolved: Resolved, hostfile: Hostfile, say: Say) -> Resolved:
    """The job resolved again for the hosts left (launch/host_pool.on_fewer_hosts), said;
    Refused with the layout rules' reasons where it cannot shrink."""
    try:
        smaller = on_fewer_hosts(resolved, hostfile)
    except RecipeError as exc:
        raise Refused(f"the job on the hosts left ({', '.join(hostfile.hostnames)})",
                      exc.problems) from None
    say(f"dsforge: continuing on {len(hostfile.hosts)} host(s) ({', '.join(hostfile.hostnames)}) "
        f"without a spare: {layout_change(resolved, smaller)}; the resume goes through the "
        "layout-free state")
    return smaller


class DeepSpeedStarts:
    """This machine (dsforge's launcher), or DeepSpeed's: a hostfile's hosts, or with --no-ssh
    this node. A
    restart starts the hosts again, on a new port unless --master-port gave one, after the
    hosts' preflight (pdsh, openmpi, mvapich) passes again; over a hostfile, without the hosts
    the restarts left out (`pool`, launch/host_pool.py), whose spares DeepSpeed gets a
    hostfile of their own for (RUN_DIR/hostfiles)."""

    def __init__(self, options: RunOptions, resolved: Resolved, say: Say):
        self.options, self.resolved, self.say = options, resolved, say
        self.placement = Placement(
            world_size=resolved.layout.world_size, hostfile=options.hostfile,
            launcher=options.launcher, include=options.include, exclude=options.exclude,
            master_addr=options.master_addr,
            master_port=options.master_port or default_port(options), node_rank=options.node_rank)
        checks.check_remote_shell(self.placement)
        self.pool = HostPool(active_hosts(read_hostfile(options.hostfile), options.include,
                                          options.exclude),
                             exclude_after=options.exclude_after,
                             slots_chosen=":" in options.include + options.exclude) \
            if self._checked_hosts() else None
        self._ended: set[str] = set()  # left-out hosts where the job's processes were ended

    def _checked_hosts(self) -> bool:
        """Whether the hosts are this process's to check (and to leave out): a hostfile's,
        started over a remote shell from here."""
        options = self.options
        return bool(options.hostfile and options.node_rank is None
                    and options.launcher in ("pdsh", "openmpi", "mvapich"))

    def first(self, job: JobSpec) -> Start:
        options, placement = self.options, self.placement
        if self.pool is not None:
            job = dataclasses.replace(job, env={**job.env, **hosts_env(self.pool.hostfile)})
        if self._checked_hosts() and not options.dry_run:
            self._preflight(job)
        command = launch_command(placement, job)
        shown = shlex.join(command) + "\n" + plain_form(options, placement, job.directory)
        return Start(command, shown, ranks=self.resolved.layout.world_size
                     if options.node_rank is None else None,
                     through_runner=placement.hostfile is not None)

    def _preflight(self, job: JobSpec) -> None:
        """The hosts in use checked; HostsFailed names those that fail it."""
        placement, options = self.placement, self.options
        fit = None if options.skip_fit_check else (self.resolved, options.device)
        try:
            checks.preflight_or_refuse(
                placement.hostfile, placement.include, placement.exclude, placement.master_port,
                say=self.say, fit=fit, down=marked_down(job.directory))  # host-down drill
        except Refused as refused:
            failing = failing_hosts(refused.problems, self.pool.hostfile)
            if failing and job.restarts:
                raise HostsFailed(failing, refused) from None
            raise

    def again(self, job: JobSpec) -> Start:
        if self.options.master_port is None:
            self.placement = dataclasses.replace(self.placement,
                                                 master_port=default_port(self.options))
        if self.pool is not None and self.pool.left_out:
            for host in [e["host"] for e in self.pool.left_out if e["host"] not in self._ended]:
                self._ended.add(host)  # once, before the host's place is taken
                self.say(end_job_on(host, job.directory))
            self.placement = dataclasses.replace(
                self.placement, include="", exclude="",
                hostfile=self.pool.write(job.directory.hostfiles, len(job.restarts)))
            if self.pool.hostfile.total_slots != self.resolved.layout.world_size:
                self._on_fewer_hosts()
            job = dataclasses.replace(job, recipe_yaml=dump_recipe(self.resolved.recipe))
        return self.first(job)

    def _on_fewer_hosts(self) -> None:
        self.resolved = fewer_hosts(self.resolved, self.pool.hostfile, self.say)
        self.placement = dataclasses.replace(self.placement,
                                             world_size=self.resolved.layout.world_size)


def plain_form(options: RunOptions, placement: Placement, run_dir: RunDir) -> str:
    """The dry run's second line: the job as a plain `deepspeed` command, with the options
    its ranks read; --tiny has none (dsforge makes the tiny recipe)."""
    if options.tiny:
        return ("# --tiny has no plain deepspeed form: dsforge makes the tiny recipe (the line "
                "above runs it, without the comparison with one rank)\n")
    words = [*(["--device", options.device] if options.device != "auto" else []),
             *(["--backend", options.backend] if options.backend != "auto" else []),
             "--step-timeout", f"{options.step_timeout:g}",
             *(["--resume"] if options.resume else [])]
    return ("# the same job as a plain deepspeed command:\n"
            + plain_deepspeed_command(placement, Path(options.recipe), run_dir, options.overrides,
                                      tuple(words)) + "\n")


def default_port(options: RunOptions) -> int:
    """A free port here; with --no-ssh DeepSpeed's default, 29500, which every node picks alike
    (a free port each would differ, and the nodes would wait for each other until timed out)."""
    return NO_SSH_PORT if options.node_rank is not None else free_port()
