"""`dsforge run` from its options to an exit code: `launch(RunOptions)`, for every launcher.

In order: every check before any rank starts (launch/checks.py: the recipe against its world,
--tiny, the options, the Slurm allocation, the ranks' environment, this machine), own the run
directory, encode the job word, make the command lines (a hostfile's hosts checked by
preflight then), then print them (`--dry-run`) or start the ranks and watch them: DeepSpeed's
launcher on this machine, over a hostfile, or on this node only (`--no-ssh`), or one srun in
a Slurm allocation; after a lost rank, again with `--max-restarts` (launch/restart.py). The
steps of a run are launch/start.py's. What stops the job raises Refused or BadOptions
(launch/refusal.py); cli.py prints them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsforge.job.run_dir import RunDir, RunDirError, runs_root
from dsforge.job.word import JobSpec
from dsforge.launch import checks, restart, start
from dsforge.launch.commands import Placement, job_spec, launch_command, plain_deepspeed_command
from dsforge.launch.host_pool import (HostPool, HostsFailed, drilled_down, failing_hosts,
                                      hosts_env, layout_change, on_fewer_hosts)
from dsforge.launch.local import STOP_GRACE_S, StopAsked, free_port
from dsforge.launch.refusal import BadOptions, Refused, Say, resolve_or_refuse
from dsforge.launch.remote_end import end_job_on
from dsforge.launch.slurm import SlurmPlan
from dsforge.lock import Lock
from dsforge.problems import RecipeError
from dsforge.recipe import Resolved
from dsforge.recipe.hostfile import active_hosts, read_hostfile
from dsforge.recipe.loader import dump_recipe

NO_SSH_PORT = 29500  # DeepSpeed's default rendezvous port, as `dsforge preflight` checks
# Run-directory locks this process holds until it exits (job/run_dir.claim).
_HELD: list[Lock | None] = []


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The options of `dsforge run`, gathered once from its command line (cli.py)."""

    recipe: str
    world_size: int | None = None
    hostfile: str | None = None
    overrides: tuple[str, ...] = ()
    run_dir: Path | None = None
    device: str = "auto"
    backend: str = "auto"
    step_timeout: float = 300.0  # seconds a step may take
    timeout: float | None = None  # seconds for the whole job
    stop_grace: float = STOP_GRACE_S  # seconds to save and exit after a stop request
    resume: bool = False
    max_restarts: int = 0  # starts again after a lost rank (launch/restart.py)
    exclude_after: int | None = None  # failures before a host is left out (launch/host_pool.py)
    launcher: str = "pdsh"
    include: str = ""
    exclude: str = ""
    node_rank: int | None = None  # --no-ssh
    master_addr: str | None = None
    master_port: int | None = None
    dry_run: bool = False
    tiny: bool = False
    skip_fit_check: bool = False
    verbose: bool = False
    local_rank: int | None = None  # set by DeepSpeed's launcher: this process is a rank

    @classmethod
    def gather(cls, *, overrides=(), profile_steps: str | None = None, **options) -> RunOptions:
        """From click's parameters; `--profile A:B` is the override tracking.profile="A:B"."""
        if profile_steps is not None:
            overrides = (*overrides, checks.profile_override(profile_steps))
        return cls(overrides=tuple(overrides), **options)

    def job(self, resolved: Resolved, run_dir: RunDir, **fields) -> JobSpec:
        """The job word with these options; `fields`: job_spec's others (launch/commands.py).
        A dry run's is neither owned nor marked: its commands are for a user to run after this
        process is gone (owned ranks would end themselves at once, job/owner.py), with no
        `dsforge run` reading their lines."""
        by_hand = {"owned": False, "marked_output": False} if self.dry_run else {}
        return job_spec(resolved, run_dir, device=self.device, backend=self.backend,
                        step_timeout_s=self.step_timeout, resume=self.resume,
                        **{**by_hand, **fields})


@dataclass(frozen=True)
class _Start:
    """How this process starts the ranks, and what `--dry-run` prints instead."""

    command: list[str]
    shown: str
    srun_env: dict[str, str] | None = None  # srun's MASTER_ADDR and MASTER_PORT
    ranks: int | None = None  # the ranks it starts, when not the job's first world (fewer hosts)


def deepspeed_argv(args: list[str]) -> list[str]:
    """dsforge's arguments as DeepSpeed's launcher gives them to the module it starts, which
    puts `--local_rank=N` first (`python -m dsforge --local_rank=0 run ...`): moved behind `run`."""
    args = list(args)
    local = [a for a in args if a.startswith("--local_rank")]
    if local and "run" in args:
        args = [a for a in args if not a.startswith("--local_rank")]
        value = local[0].split("=", 1)[1] if "=" in local[0] else args.pop(args.index(local[0]) + 1)
        args.insert(args.index("run") + 1, f"--local_rank={value}")
    return args


def launched_rank_job(options: RunOptions) -> JobSpec:
    """The job of a rank that a plain `deepspeed [--hostfile H] -m dsforge run RECIPE` started:
    the recipe resolved against WORLD_SIZE on every rank, which must all get the same run
    directory; the ranks print to the terminal themselves and watch no owner."""
    resolved = resolve_or_refuse(options.recipe, options.overrides, int(os.environ["WORLD_SIZE"]),
                                 None)
    run_dir = RunDir(options.run_dir or runs_root() / (
        f"{resolved.recipe.name}-{os.environ.get('MASTER_ADDR', 'local')}"
        f"-{os.environ.get('MASTER_PORT', '0')}"))
    return options.job(resolved, run_dir, owned=False, marked_output=False)


def launch(options: RunOptions, *, say: Say, show: Say) -> int:
    """Run the job and return `dsforge run`'s exit code; `show` prints `--dry-run`'s lines.
    With --max-restarts, a job that loses a rank starts again (launch/restart.py)."""
    checked = checks.checked_run(options, say)
    options, resolved = checked.options, checked.resolved
    if checked.slurm_plan is not None:
        run_dir = _own_run_dir(options, resolved, say, joining=False, peers_may_join=False)
        job = options.job(resolved, run_dir, env=checked.env, slurm=True)
        starts = _SrunStarts(options, checked.slurm_plan)
    else:
        starts = _DeepSpeedStarts(options, resolved, say)
        # With --no-ssh every node starts its own dsforge; nodes after the first join the run
        # directory the first one made (it may already hold their peers' files).
        run_dir = _own_run_dir(options, resolved, say,
                               joining=options.node_rank is not None and options.node_rank > 0,
                               peers_may_join=options.node_rank is not None)
        job = options.job(resolved, run_dir, env=checked.env)
    how = starts.first(job)
    if options.dry_run:
        show(how.shown)
        return 0
    ranks, asked = _ranks_started_here(options, resolved), StopAsked()
    clock = _JobClock(options.timeout)

    def watched(how: _Start):
        return lambda: start.launch_and_watch(
            how.command, run_dir, how.ranks or ranks, timeout=clock.left(),
            verbose=options.verbose, say=say, stop_grace=options.stop_grace,
            extra_env=how.srun_env, srun=how.srun_env is not None, asked=asked)

    def again(job: JobSpec):
        """A restart's start, once the job fits again: this machine's check, and the hosts'
        preflight inside `starts.again` (a hostfile's); --timeout counts every attempt."""
        clock.check()
        if not options.skip_fit_check:
            checks.check_this_machine(options, resolved, say)
        return watched(starts.again(job))

    code = restart.run_with_restarts(job, watched(how), max_restarts=options.max_restarts,
                                     prepare=again, say=say, asked=asked,
                                     hosts=getattr(starts, "pool", None))
    if code == 0 and options.tiny:
        code = start.check_tiny_layout(resolved, run_dir, env=checked.env,
                                       timeout=options.timeout, verbose=options.verbose, say=say)
    return code


class _JobClock:
    """--timeout for the whole job, restarts included."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s, self.began = timeout_s, time.monotonic()

    def left(self) -> float | None:
        return None if self.timeout_s is None else self.timeout_s - (time.monotonic() - self.began)

    def check(self) -> None:
        left = self.left()
        if left is not None and left <= 0:
            raise restart.NotRestarted(f"--timeout {self.timeout_s:g}s is used up")


class _SrunStarts:
    """`--launcher slurm`: one srun for every rank of the job (launch/slurm.py); a restart
    runs srun again inside the same allocation, on a new port unless --master-port gave one."""

    def __init__(self, options: RunOptions, plan: SlurmPlan):
        self.options, self.plan = options, plan

    def first(self, job: JobSpec) -> _Start:
        command = self.plan.command([sys.executable, "-u", "-m", "dsforge.runtime.rank",
                                     "--job", job.encode()])
        env = self.plan.env()
        shown = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command) + "\n"
        return _Start(command, shown, srun_env=env)

    def again(self, job: JobSpec) -> _Start:
        if self.options.master_port is None:
            from dsforge.launch.slurm import master_port_for

            port = master_port_for(self.plan.allocation, self.plan.master_addr, free_port)
            self.plan = dataclasses.replace(self.plan, master_port=port)
        return self.first(job)


class _DeepSpeedStarts:
    """DeepSpeed's launcher: this machine, a hostfile's hosts, or with --no-ssh this node. A
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
            master_port=options.master_port or _default_port(options), node_rank=options.node_rank)
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

    def first(self, job: JobSpec) -> _Start:
        options, placement = self.options, self.placement
        if self.pool is not None:
            job = dataclasses.replace(job, env={**job.env, **hosts_env(self.pool.hostfile)})
        if self._checked_hosts() and not options.dry_run:
            self._preflight(job)
        command = launch_command(placement, job)
        shown = shlex.join(command) + "\n" + _plain_form(options, placement, job.directory)
        return _Start(command, shown, ranks=self.resolved.layout.world_size
                      if options.node_rank is None else None)

    def _preflight(self, job: JobSpec) -> None:
        """The hosts in use checked; HostsFailed names those that fail it."""
        placement, options = self.placement, self.options
        try:
            checks.preflight_or_refuse(
                placement.hostfile, placement.include, placement.exclude, placement.master_port,
                say=self.say, fit=None if options.skip_fit_check else (self.resolved, options.device),
                down=drilled_down(job.directory))
        except Refused as refused:
            failing = failing_hosts(refused.problems, self.pool.hostfile)
            if failing and job.restarts:
                raise HostsFailed(failing, refused) from None
            raise

    def again(self, job: JobSpec) -> _Start:
        if self.options.master_port is None:
            self.placement = dataclasses.replace(self.placement,
                                                 master_port=_default_port(self.options))
        if self.pool is not None and self.pool.left_out:
            for host in [e["host"] for e in self.pool.left_out if e["host"] not in self._ended]:
                self._ended.add(host)  # once, before the host's place is taken
                self.say(end_job_on(host, job.directory))
            self.placement = dataclasses.replace(
                self.placement, include="", exclude="",
                hostfile=self.pool.write(job.directory.path / "hostfiles", len(job.restarts)))
            if self.pool.hostfile.total_slots != self.resolved.layout.world_size:
                self._on_fewer_hosts()
            job = dataclasses.replace(job, recipe_yaml=dump_recipe(self.resolved.recipe))
        return self.first(job)

    def _on_fewer_hosts(self) -> None:
        """The job resolved again for the hosts left (launch/host_pool.on_fewer_hosts)."""
        try:
            resolved = on_fewer_hosts(self.resolved, self.pool.hostfile)
        except RecipeError as exc:
            raise Refused(f"the job on the hosts left ({', '.join(self.pool.hostfile.hostnames)})",
                          exc.problems) from None
        self.say(f"dsforge: continuing on {len(self.pool.hostfile.hosts)} host(s) "
                 f"({', '.join(self.pool.hostfile.hostnames)}) without a spare: "
                 f"{layout_change(self.resolved, resolved)}; the resume goes through the "
                 "layout-free state")
        self.resolved = resolved
        self.placement = dataclasses.replace(self.placement,
                                             world_size=resolved.layout.world_size)


def _plain_form(options: RunOptions, placement: Placement, run_dir: RunDir) -> str:
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


def _default_port(options: RunOptions) -> int:
    """A free port here; with --no-ssh DeepSpeed's default, 29500, which every node picks alike
    (a free port each would differ, and the nodes would wait for each other until timed out)."""
    return NO_SSH_PORT if options.node_rank is not None else free_port()


def _own_run_dir(options: RunOptions, resolved: Resolved, say: Say, *, joining: bool,
                 peers_may_join: bool) -> RunDir:
    """The run directory, owned by this process until it exits (launch/start.own_run_dir)."""
    from dsforge.ckpt.trust import CheckpointError

    try:
        run_dir, lock = start.own_run_dir(options.run_dir, resolved, resume=options.resume,
                                          joining=joining, create=not options.dry_run, say=say,
                                          peers_may_join=peers_may_join)
    except RunDirError as exc:
        raise BadOptions(str(exc)) from None
    except CheckpointError as exc:
        raise BadOptions(f"cannot resume: {exc}") from None
    _HELD.append(lock)
    return run_dir


def _ranks_started_here(options: RunOptions, resolved: Resolved) -> int:
    """How many ranks this dsforge starts (and must hear completion from): all of them, or
    with --no-ssh only its node's."""
    if options.node_rank is None:
        return resolved.layout.world_size
    hosts = active_hosts(read_hostfile(options.hostfile), options.include, options.exclude)
    return hosts.node_slots[options.node_rank]
