"""`dsforge run` from its options to an exit code: `launch(RunOptions)`, for every launcher.

In order: resolve the recipe against the world, shrink it (`--tiny`), plan the srun
(`--launcher slurm`), check that what starts here fits here, own the run directory, encode the
job word, check the hosts (a pdsh, openmpi or mvapich run over a hostfile), then print the
command lines (`--dry-run`) or start the ranks and watch them: DeepSpeed's launcher on this
machine, over a hostfile, or on this node only (`--no-ssh`), or one srun in a Slurm allocation.
The steps themselves are launch/start.py's. What stops the job raises Refused or BadOptions
(launch/refusal.py); cli.py prints them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsforge.job.run_dir import RunDir, RunDirError, runs_root
from dsforge.job.word import JobSpec, forwarded_env
from dsforge.launch import restart, start
from dsforge.launch.commands import (Placement, job_spec, launch_command, plain_deepspeed_command,
                                     remote_shell_problems)
from dsforge.launch.local import STOP_GRACE_S, StopAsked, free_port
from dsforge.launch.refusal import BadOptions, Refused, resolve_or_refuse
from dsforge.launch.slurm import SlurmPlan
from dsforge.lock import Lock
from dsforge.problems import Problem, RecipeError, errors
from dsforge.recipe import Resolved
from dsforge.recipe.hostfile import active_hosts, read_hostfile

Say = start.Say
# Why --max-restarts and --no-ssh do not go together (docs/launch.md, "Restarts").
NO_SSH_RESTARTS = (
    "--max-restarts cannot restart a --no-ssh job: each node's dsforge starts only its own "
    "ranks and cannot stop or start the other nodes', so node 0 alone would wait for peers that "
    "ended; run the job from one place (--hostfile with pdsh, or --launcher slurm), or have "
    "each node's supervisor (systemd, Kubernetes) start `dsforge run ... --resume` again")
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
        if profile_steps is not None and not re.fullmatch(r"\d+:\d+", profile_steps):
            raise BadOptions(  # e.g. a planner's profile file, which is another command's
                f"--profile {profile_steps!r} is not a step range: give the first and last step "
                "to trace as A:B (0-based), e.g. --profile 3:5. A planner's profile file goes to "
                "dsforge plan --search --profile")
        if profile_steps is not None:
            # Quoted: YAML would read an unquoted 3:5 as the base-60 integer 185.
            overrides = (*overrides, f"tracking.profile={json.dumps(profile_steps)}")
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
    options, resolved, slurm_plan = _checked(options, say)
    if slurm_plan is not None:
        run_dir = _own_run_dir(options, resolved, say, joining=False, peers_may_join=False)
        job = options.job(resolved, run_dir, env=checked_env(), slurm=True)
        starts = _SrunStarts(options, slurm_plan)
    else:
        starts = _DeepSpeedStarts(options, resolved, say)
        # With --no-ssh every node starts its own dsforge; nodes after the first join the run
        # directory the first one made (it may already hold their peers' files).
        run_dir = _own_run_dir(options, resolved, say,
                               joining=options.node_rank is not None and options.node_rank > 0,
                               peers_may_join=options.node_rank is not None)
        job = options.job(resolved, run_dir, env=checked_env())
    how = starts.first(job)
    if options.dry_run:
        show(how.shown)
        return 0
    ranks, asked = _ranks_started_here(options, resolved), StopAsked()
    clock = _JobClock(options.timeout)

    def watched(how: _Start):
        return lambda: start.launch_and_watch(
            how.command, run_dir, ranks, timeout=clock.left(), verbose=options.verbose,
            say=say, stop_grace=options.stop_grace, extra_env=how.srun_env,
            srun=how.srun_env is not None, asked=asked)

    def again(job: JobSpec):
        """A restart's start, once the job fits again: this machine's check, and the hosts'
        preflight inside `starts.again` (a hostfile's); --timeout counts every attempt."""
        clock.check()
        if not options.skip_fit_check:
            _check_this_machine(start.command_words(options.recipe, options.overrides,
                                                    options.world_size),
                                resolved, options, say)
        return watched(starts.again(job))

    code = restart.run_with_restarts(job, watched(how), max_restarts=options.max_restarts,
                                     prepare=again, say=say, asked=asked)
    if code == 0 and options.tiny:
        code = start.check_tiny_layout(resolved, run_dir, env=checked_env(),
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


def _checked(options: RunOptions, say: Say) -> tuple[RunOptions, Resolved, SlurmPlan | None]:
    """The resolved job (at tiny size with `--tiny`, which also moves it to CPU ranks), the
    srun plan with `--launcher slurm`, and this machine's checks passed."""
    resolved = resolve_or_refuse(options.recipe, options.overrides, options.world_size,
                                 options.hostfile, options.include, options.exclude)
    if options.tiny:
        if options.device == "cuda" or options.backend == "nccl":
            raise BadOptions("--tiny runs on CPU ranks (gloo); leave out --device and --backend")
        resolved = start.shrink_to_tiny(options.recipe, resolved, options.overrides, say)
        options = dataclasses.replace(options, device="cpu", backend="gloo")
    warn(resolved.warnings, say)
    command = start.command_words(options.recipe, options.overrides, options.world_size)
    slurm_plan = None
    if options.node_rank is not None:
        _check_no_ssh_options(options)
    if options.max_restarts and options.node_rank is not None:
        raise BadOptions(NO_SSH_RESTARTS)
    if options.launcher == "slurm":
        _check_slurm_options(options)
        slurm_plan = start.plan_slurm(options.recipe, resolved, device=options.device,
                                      master_addr=options.master_addr,
                                      master_port=options.master_port, say=say)
    if not options.skip_fit_check:
        _check_this_machine(command, resolved, options, say)
    return options, resolved, slurm_plan


def _check_no_ssh_options(options: RunOptions) -> None:
    """--no-ssh: one dsforge per node, each started the same way, so every node must name the
    same hostfile, rendezvous address and port, and its own place in the hostfile."""
    if options.hostfile is None:
        raise BadOptions("--no-ssh needs --hostfile: the same hostfile on every node (it says "
                         "how many ranks each node starts)")
    if not options.master_addr:
        raise BadOptions("--no-ssh needs --master-addr: node 0's address, the same on every node "
                         "(without it DeepSpeed asks node 0 for it over ssh)")
    hosts = active_hosts(read_hostfile(options.hostfile), options.include, options.exclude)
    if options.node_rank >= len(hosts.node_slots):
        raise BadOptions(f"--no-ssh {options.node_rank}: {options.hostfile} names "
                         f"{len(hosts.node_slots)} host(s), so the node ranks are 0 to "
                         f"{len(hosts.node_slots) - 1}")


def _check_slurm_options(options: RunOptions) -> None:
    """Under Slurm the nodes are the allocation's: no hostfile, filters or --no-ssh."""
    given = [name for name, value in (("--hostfile", options.hostfile),
                                      ("--include", options.include),
                                      ("--exclude", options.exclude),
                                      ("--no-ssh", options.node_rank))
             if value not in (None, "")]
    if given:
        raise BadOptions(f"--launcher slurm takes its nodes from the Slurm allocation; "
                         f"leave out {', '.join(given)}")


def _check_this_machine(command: list[str], resolved: Resolved, options: RunOptions,
                        say: Say) -> None:
    """Ranks that start here are checked here: a local job whole (memory fit too), this node's
    ranks under Slurm or --no-ssh (kernels and builds); a hostfile's hosts are the preflight's."""
    if options.launcher == "slurm" or options.node_rank is not None:
        warn(start.check_this_node(command, resolved, options.device), say)
    elif options.hostfile is None:
        warn(start.check_fit(command, resolved, options.device, options.tiny), say)


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
    restart starts the same hosts again, on a new port unless --master-port gave one, after
    the hosts' preflight (pdsh, openmpi, mvapich) passes again."""

    def __init__(self, options: RunOptions, resolved: Resolved, say: Say):
        self.options, self.resolved, self.say = options, resolved, say
        self.placement = Placement(
            world_size=resolved.layout.world_size, hostfile=options.hostfile,
            launcher=options.launcher, include=options.include, exclude=options.exclude,
            master_addr=options.master_addr,
            master_port=options.master_port or _default_port(options), node_rank=options.node_rank)
        problems = remote_shell_problems(self.placement, cwd=os.getcwd(), python=sys.executable)
        if problems:
            raise Refused("launch", problems)

    def first(self, job: JobSpec) -> _Start:
        options, placement = self.options, self.placement
        command = launch_command(placement, job)
        if (options.hostfile and options.node_rank is None and not options.dry_run
                and options.launcher in ("pdsh", "openmpi", "mvapich")):
            preflight_or_refuse(options.hostfile, options.include, options.exclude,
                                placement.master_port, say=self.say,
                                fit=None if options.skip_fit_check else (self.resolved,
                                                                         options.device))
        shown = shlex.join(command) + "\n" + _plain_form(options, placement, job.directory)
        return _Start(command, shown)

    def again(self, job: JobSpec) -> _Start:
        if self.options.master_port is None:
            self.placement = dataclasses.replace(self.placement,
                                                 master_port=_default_port(self.options))
        return self.first(job)


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


def checked_env() -> dict[str, str]:
    """The environment forwarded to every rank (job/word.py); Refused for a name a shell
    would misread (rule H4)."""
    try:
        return forwarded_env(os.environ)
    except RecipeError as exc:
        raise Refused("environment", exc.problems) from None


def warn(problems: list[Problem], say: Say) -> None:
    """Each warning on its own indented line."""
    for warning in problems:
        say(f"  warning: {warning}")


def preflight_or_refuse(hostfile: str, include: str, exclude: str, port: int, *, say: Say,
                        timeout_s: float = 10.0, fit: tuple[Resolved, str] | None = None) -> None:
    """Every host reachable with the same versions and the master port free; with `fit`
    (the resolved job and --device), each host's slots and memory checked against the job."""
    from dsforge.launch.preflight import preflight

    hosts = active_hosts(read_hostfile(hostfile), include, exclude)
    problems = preflight(hosts, master_port=port, timeout_s=timeout_s, fit=fit)
    if errors(problems):
        raise Refused(f"preflight of {hostfile}", problems)
    warn(problems, say)
    say(f"dsforge: preflight ok: {len(hosts.hosts)} hosts reachable, same versions, "
        f"port {port} free on {hosts.hostnames[0]}" + (", the job fits every host" if fit else ""))


def check_hosts(recipe: str, *, overrides: tuple[str, ...], world_size: int | None,
                hostfile: str | None, include: str, exclude: str, master_port: int,
                ssh_timeout: float, say: Say) -> None:
    """`dsforge preflight`: the recipe, then the hosts of its hostfile and the job on each."""
    if hostfile is None:
        raise BadOptions("preflight needs --hostfile")
    resolved = resolve_or_refuse(recipe, overrides, world_size, hostfile, include, exclude)
    warn(resolved.warnings, say)
    preflight_or_refuse(hostfile, include, exclude, master_port, say=say, timeout_s=ssh_timeout,
                        fit=(resolved, "auto"))
