"""`dsforge run` from its options to an exit code: `launch(RunOptions)`, for every launcher.

In order: every check before any rank starts (launch/checks.py: the recipe against its world,
--tiny, the options, the Slurm allocation, the ranks' environment, this machine), own the run
directory, encode the job word, make the command lines (a hostfile's hosts checked by preflight
then), then print them (`--dry-run`) or start the ranks and watch them: dsforge's launcher on
this machine, DeepSpeed's over a hostfile or on this node only (`--no-ssh`), or one srun in a
Slurm allocation; after a lost rank, again with `--max-restarts` (launch/restart.py). The steps
of a run are launch/start.py's. What stops the job raises Refused or BadOptions
(launch/refusal.py); cli.py prints them.
"""

from __future__ import annotations

import dataclasses
import os
import time

from dsforge.job.run_dir import RunDir, RunDirError, runs_root
from dsforge.job.word import JobSpec
from dsforge.launch import checks, restart, start
from dsforge.launch.local import StopAsked
from dsforge.launch.refusal import BadOptions, Say, resolve_or_refuse
from dsforge.launch.run_options import RunOptions
from dsforge.launch.starts import DeepSpeedStarts, SrunStarts, Start
from dsforge.lock import Lock
from dsforge.recipe import Resolved
from dsforge.recipe.hostfile import active_hosts, read_hostfile

# Run-directory locks this process holds until it exits (job/run_dir.claim).
_HELD: list[Lock | None] = []


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
    options, resolved = _resuming(checked.options), checked.resolved
    if checked.slurm_plan is not None:
        run_dir = _own_run_dir(options, resolved, say, joining=False, peers_may_join=False)
        job = options.job(resolved, run_dir, env=checked.env, slurm=True)
        starts = SrunStarts(options, checked.slurm_plan, resolved, say)
    else:
        starts = DeepSpeedStarts(options, resolved, say)
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

    def watched(how: Start):
        return lambda: start.launch_and_watch(
            how.command, run_dir, how.ranks or ranks, timeout=clock.left(),
            verbose=options.verbose, say=say, stop_grace=options.stop_grace,
            extra_env=how.srun_env, srun=how.srun_env is not None, asked=asked,
            through_runner=how.through_runner)

    def again(job: JobSpec):
        """A restart's start, once the job fits again: this machine's check, and the hosts'
        preflight inside `starts.again` (a hostfile's); --timeout counts every attempt."""
        clock.check()
        if not options.skip_fit_check:
            checks.check_this_machine(options, resolved, say)
        return watched(starts.again(job))

    code = restart.run_with_restarts(job, watched(how), max_restarts=options.max_restarts,
                                     prepare=again, say=say, asked=asked,
                                     hosts=starts.pool)
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


def _own_run_dir(options: RunOptions, resolved: Resolved, say: Say, *, joining: bool,
                 peers_may_join: bool) -> RunDir:
    """The run directory, owned by this process until it exits (launch/start.own_run_dir)."""
    from dsforge.ckpt.trust import CheckpointError

    try:
        run_dir, lock = start.own_run_dir(options.run_dir, resolved, resume=options.resume,
                                          joining=joining, create=not options.dry_run, say=say,
                                          peers_may_join=peers_may_join,
                                          or_start=options.resume_or_start)
    except RunDirError as exc:
        raise BadOptions(str(exc)) from None
    except CheckpointError as exc:
        raise BadOptions(f"cannot resume: {exc}") from None
    _HELD.append(lock)
    return run_dir


def _resuming(options: RunOptions) -> RunOptions:
    """With --resume-or-start, --resume where the run directory holds a complete checkpoint
    (decided once, here: without one _own_run_dir starts the run over there). Looked at before
    the directory is owned: only a live job could change that, and owning it refuses one."""
    from dsforge.ckpt.trust import CheckpointError

    if not options.resume_or_start:
        return options
    try:
        return dataclasses.replace(options, resume=start.resumed_here(RunDir(options.run_dir)))
    except CheckpointError as exc:  # a damaged `latest`
        raise BadOptions(f"cannot resume: {exc}") from None


def _ranks_started_here(options: RunOptions, resolved: Resolved) -> int:
    """How many ranks this dsforge starts (and must hear completion from): all of them, or
    with --no-ssh only its node's."""
    if options.node_rank is None:
        return resolved.layout.world_size
    hosts = active_hosts(read_hostfile(options.hostfile), options.include, options.exclude)
    return hosts.node_slots[options.node_rank]
