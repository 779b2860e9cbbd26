"""The steps of `dsforge run` between a checked job and its exit code.

Own the run directory, launch with dsforge's lines on the terminal (everything else in
RUN_DIR/job.log), decide success from every rank's completion, and after a `--tiny` run compare
its losses with a single rank's. What is refused before any of this is launch/checks.py's;
launch/entry.py puts these steps in order.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from dsforge.job.heartbeat import summarize
from dsforge.job.run_dir import RunDir, claim, existing_run_dir, new_run_dir, set_aside
from dsforge.job.signals import EXIT_NONFINITE, EXIT_RESUMABLE
from dsforge.job.steps import step_text
from dsforge.launch.commands import Placement, job_spec, launch_command, runner_env
from dsforge.launch.diagnose import failure_report
from dsforge.launch.local import EXIT_TIMEOUT, STOP_GRACE_S, StopAsked, free_port, run_job
from dsforge.launch.output import JobView
from dsforge.launch.refusal import Say
from dsforge.launch.smoke import compare_losses
from dsforge.lock import JOB_DIR_ENV, Lock
from dsforge.recipe import Resolved
from dsforge.recipe.tiny import reference_resolved
# Exit codes of a job dsforge stopped at once on request: Ctrl-C, SIGHUP, SIGUSR1, SIGTERM
# (128 + signal; SIGTERM and SIGUSR1 only after a second signal or when the grace ran out).
STOPPED_CODES = (130, 129, 138, 143)


def own_run_dir(given: Path | None, resolved: Resolved, *, resume: bool, joining: bool,
                create: bool, say: Say, peers_may_join: bool = False,
                or_start: bool = False) -> tuple[RunDir, Lock | None]:
    """The run directory of --run-dir `given`: a new, empty one (a fresh name without
    `given`); or, to resume or join, the existing one (with a checkpoint this recipe can
    continue from, to resume: the earlier attempt's records are set aside, job/run_dir.py).
    `or_start` (--resume-or-start) without `resume` (its run directory holds no complete
    checkpoint: resumed_here): start the run over in `given`. Unless joining another node's
    run or only printing commands, the returned lock makes this process its owner: keep it
    until exit. Raises RunDirError or CheckpointError."""
    if or_start and not resume:
        return _start_over(given, create=create, say=say)
    if not (resume or joining):
        run_dir = new_run_dir(given, resolved.recipe.name, create=create,
                              peers_may_join=peers_may_join)
        lock = claim(run_dir, fresh=True, peers_may_join=peers_may_join) if create else None
        return run_dir, lock
    run_dir = existing_run_dir(given, resume=resume, create=create)
    lock = claim(run_dir, fresh=False, peers_may_join=peers_may_join) if resume and create else None
    if resume:
        _resume(run_dir, resolved, set_aside_records=create and not peers_may_join, say=say)
    return run_dir, lock


def _resume(run_dir: RunDir, resolved: Resolved, *, set_aside_records: bool, say: Say) -> None:
    """Check that `resolved` can continue the run in `run_dir` (CheckpointError if not), say
    how, and set the earlier attempt's records aside (`set_aside_records`: not where other
    nodes' ranks may already write there)."""
    from dsforge.ckpt.trust import check_resumable

    record = check_resumable(run_dir, dataclasses.asdict(resolved.recipe),
                             resolved.layout.world_size)
    say(f"dsforge: resuming {run_dir} after step {record['step']}")
    if set_aside_records:
        set_aside(run_dir)
    for change in record["layout_changes"]:
        say(f"  new layout: {change}")
    for change in record["changes"]:
        say(f"  changed: {change}")


def _start_over(given: Path, *, create: bool, say: Say) -> tuple[RunDir, Lock | None]:
    """--resume-or-start where `given` holds no complete checkpoint: own it (made if missing),
    set aside what an earlier attempt wrote there (a job that ended before its first
    checkpoint), and start the run from the beginning."""
    run_dir = existing_run_dir(given, resume=False, create=create)
    lock = claim(run_dir, fresh=False) if create else None
    if not create:  # a dry run moves nothing
        used = run_dir.path.is_dir() and any(run_dir.path.iterdir())
        say(f"dsforge: {run_dir} holds no complete checkpoint: the run would start from the "
            "beginning" + (", what is there set aside in attempts/" if used else ""))
        return run_dir, lock
    kept = set_aside(run_dir, everything=True)
    say(f"dsforge: {run_dir} holds no complete checkpoint: starting its run from the beginning"
        + (f" (what an earlier attempt wrote is in {kept})" if kept else ""))
    return run_dir, lock


def resumed_here(run_dir: RunDir) -> bool:
    """Whether `run_dir` holds a complete checkpoint to continue from (--resume-or-start's
    choice, launch/entry.py `_resuming`)."""
    from dsforge.ckpt.trust import latest_complete

    return run_dir.checkpoints.is_dir() and latest_complete(run_dir.checkpoints) is not None


def launch_and_watch(command: list[str], run_dir: RunDir, ranks: int, *, timeout: float | None,
                     verbose: bool, say: Say, stop_grace: float = STOP_GRACE_S,
                     extra_env: dict[str, str] | None = None, srun: bool = False,
                     asked: StopAsked | None = None, through_runner: bool = False) -> int:
    """Run the job with dsforge's lines on the terminal and everything in RUN_DIR/job.log.
    Success is every one of its `ranks` reporting completion, not only the launcher's exit
    code (a launcher killed by a signal, or a cut remote command, can exit 0). Ranks that
    all stopped early with a checkpoint (a signal, train.time_limit) give EXIT_RESUMABLE.
    `srun`: the command is srun (launch/slurm.py), with `extra_env` for its tasks. `asked`
    notes a stop somebody asked for (launch/local.StopAsked). `through_runner`: the command is
    DeepSpeed's runner, which pastes variables into a shell (starts.py Start)."""
    env, dropped = runner_env(os.environ) if through_runner else (dict(os.environ), [])
    env.update(extra_env or {})
    env[JOB_DIR_ENV] = str(run_dir.absolute())  # tags every local process of the job
    for name in dropped:
        say(f"  note: {name} is forwarded inside the job, not exported by DeepSpeed's runner "
            "(its value is not shell-safe)")
    log = run_dir.job_log
    say(f"dsforge: starting {ranks} rank{'s' if ranks > 1 else ''}; run directory {run_dir}, "
        f"engine logs in {log}")
    view = JobView(verbose=verbose)
    try:
        code = run_job(command, timeout_s=timeout, env=env, log_path=log, on_line=view.feed,
                       run_dir=run_dir, stop_grace_s=stop_grace, srun_ranks=ranks if srun else 0,
                       asked=asked)
    finally:
        view.close()
    accounted = len(view.done_ranks | set(view.stopped_ranks) | set(view.halted_ranks)) >= ranks
    if code == 0 and view.halted_ranks and accounted:
        step, _ = min(view.halted_ranks.values())
        say(f"dsforge: the ranks stopped together at {step_text(step)}: exit code {EXIT_NONFINITE}; the "
            f"report above is kept in {run_dir.failure(0)}")
        return EXIT_NONFINITE
    if code == 0 and view.stopped_ranks and accounted:
        return _stopped(run_dir, view.stopped_ranks, say)
    if code == 0 and len(view.done_ranks) < ranks:
        say(f"dsforge: the launcher exited 0 but only {len(view.done_ranks)} of {ranks} ranks "
            "reported completion; the run did not finish")
        code = 1
    if code in STOPPED_CODES:
        say(f"dsforge: stopped (exit code {code}); what was written is in {run_dir}")
    elif code == EXIT_TIMEOUT:  # not a failure: the limit the user gave
        say(f"dsforge: stopped at --timeout (exit code {code}); what was written is in "
            f"{run_dir}\n{summarize(run_dir)}")
    elif code != 0:
        say(failure_report(run_dir, code))
    return code


def _stopped(run_dir: RunDir, stopped_ranks: dict[int, tuple[int, str, bool]], say: Say) -> int:
    """What `dsforge run` says and returns when the ranks stopped on request: after which step,
    why, and the checkpoint a resume continues from (an earlier one when the last step was bad:
    runtime/guard/health.py; with none at all, nothing can be resumed)."""
    from dsforge.ckpt.trust import CheckpointError, latest_complete

    steps, reason, saved = max(stopped_ranks.values())
    resume = f"continue with --resume --run-dir {run_dir}"
    if saved:
        say(f"dsforge: stopped after step {steps} ({reason}) with a complete checkpoint: "
            f"resumable, exit code {EXIT_RESUMABLE}; {resume}")
        return EXIT_RESUMABLE
    try:
        latest = latest_complete(run_dir.checkpoints)
    except CheckpointError:
        latest = None
    bad = f"dsforge: stopped after step {steps} ({reason}); its last step was bad, so no " \
          "checkpoint was written after it"
    if latest is None:
        say(f"{bad}, and none before it: nothing to resume; start it again in a new --run-dir")
        return 1
    say(f"{bad}: exit code {EXIT_RESUMABLE}; {resume} (from the checkpoint after step "
        f"{latest['step']})")
    return EXIT_RESUMABLE


def check_tiny_layout(tiny: Resolved, run_dir: RunDir, *, env: dict[str, str],
                      timeout: float | None, verbose: bool, say: Say) -> int:
    """Train the same tiny model on one rank and compare losses; 1 if they disagree. A
    layout that is the reference's already (one rank, one sequence a microbatch) has nothing
    to compare."""
    reference = reference_resolved(tiny)
    if reference.layout == tiny.layout:
        say("dsforge: the layout is the single-rank reference's: nothing to compare")
        return 0
    ref_dir = run_dir.reference
    ref_dir.path.mkdir()
    job = job_spec(reference, ref_dir, device="cpu", backend="gloo", env=env)
    command = launch_command(Placement(world_size=1, master_port=free_port()), job)
    say("dsforge: checking the layout against a single-rank run of the same tiny model")
    code = launch_and_watch(command, ref_dir, 1, timeout=timeout, verbose=verbose, say=say)
    if code != 0:
        return code
    check = compare_losses(run_dir, ref_dir, tiny.recipe.train.precision)
    say(f"dsforge: {check.describe()}")
    return 0 if check.ok else 1
