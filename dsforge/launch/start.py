"""The steps of `dsforge run` between a resolved recipe and a finished job.

In order: shrink to tiny size (`--tiny`), refuse what does not fit this machine, own the run
directory, launch with dsforge's lines on the terminal (everything else in RUN_DIR/job.log),
decide success from every rank's completion, and after a `--tiny` run compare its losses with
a single rank's. Refusals raise `Refused` (launch/refusal.py) with the problems to print;
launch/entry.py puts these steps in order. `say` prints one of dsforge's own lines.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Callable

from dsforge.job.run_dir import RunDir, claim, existing_run_dir, new_run_dir, set_aside
from dsforge.job.signals import EXIT_NONFINITE, EXIT_RESUMABLE
from dsforge.launch.commands import Placement, job_spec, launch_command, runner_env
from dsforge.launch.diagnose import failure_report
from dsforge.launch.fit import (Machine, device_for, device_run_problems, fit_problems,
                                rank_memory_bytes)
from dsforge.launch.local import STOP_GRACE_S, StopAsked, free_port, run_job
from dsforge.launch.output import JobView
from dsforge.launch.probe import build_facts, probe
from dsforge.launch.refusal import Refused
from dsforge.launch.smoke import compare_losses
from dsforge.lock import JOB_DIR_ENV, Lock
from dsforge.problems import Problem, RecipeError, errors
from dsforge.recipe import Resolved
from dsforge.recipe.tiny import reference_resolved, tiny_resolved
from dsforge.translate.build_env import BUILD_RULES, build_problems, job_ops
from dsforge.units import format_bytes

Say = Callable[[str], None]
# Exit codes of a job dsforge stopped at once on request: Ctrl-C, SIGHUP, SIGUSR1, SIGTERM
# (128 + signal; SIGTERM and SIGUSR1 only after a second signal or when the grace ran out).
STOPPED_CODES = (130, 129, 138, 143)


def command_words(recipe: str, overrides: tuple[str, ...], world_size: int | None) -> list[str]:
    """The user's `dsforge run` command, for the ways forward a refusal suggests."""
    words = ["dsforge", "run", recipe]
    words += ["--world-size", str(world_size)] if world_size else []
    for item in overrides:
        words += ["--set", item]
    return words


def shrink_to_tiny(recipe: str, resolved: Resolved, overrides, say: Say) -> Resolved:
    """The same layout at tiny size (recipe/tiny.py), said in one line."""
    try:
        tiny = tiny_resolved(resolved, overrides)
    except RecipeError as exc:
        raise Refused(f"{recipe} at tiny size", exc.problems) from None
    lay, r = tiny.layout, tiny.recipe
    say(f"dsforge: {recipe} at tiny size: the same layout ({layout_text(lay)}, ZeRO "
        f"{r.zero.stage}, {r.train.precision}, activation checkpointing "
        f"{r.train.activation_checkpointing}) with {r.model.num_layers} layer"
        f"{'s' if r.model.num_layers > 1 else ''} of hidden "
        f"{r.model.hidden_size}, {lay.grad_accum} microbatches of {lay.micro_batch} x "
        f"{r.train.seq_len} tokens, {r.train.steps} steps on CPU ranks")
    return tiny


def layout_text(lay) -> str:
    """e.g. '32 ranks: dp2 x tp4 x pp4 x vpp5 + sequence parallel'."""
    parts = [f"{lay.world_size} ranks: dp{lay.dp}", f"tp{lay.tp}"]
    parts += [f"pp{lay.pp}"] if lay.pp > 1 else []
    parts += [f"vpp{lay.vpp}"] if lay.vpp > 1 else []
    parts += [f"cp{lay.cp}"] if lay.cp > 1 else []
    parts += [f"ep{lay.ep}"] if lay.ep > 1 else []
    return " x ".join(parts) + (" + sequence parallel" if lay.sequence_parallel else "")


def check_fit(command: list[str], resolved: Resolved, device: str, tiny: bool) -> list[Problem]:
    """This machine's warnings for the job; Refused, in a second and before any rank starts,
    when it cannot hold the job or cannot build or run what its ranks need (launch/fit.py)."""
    probed = probe()
    machine = Machine.from_probe("this machine", probed)
    device = device_for(device, machine)
    _refuse_unrunnable(command, resolved, device, probed)
    if job_ops(resolved, device):
        machine = machine.with_build(build_facts())
    problems = fit_problems(resolved, machine, device=device)
    refusals = errors(problems)
    if refusals and all(p.rule in BUILD_RULES for p in refusals):  # it fits; only builds fail
        _refuse_builds(command, machine.name, problems)
    if refusals:
        raise Refused(f"{command[2]} does not fit {machine.describe()}", problems,
                      ways_forward(command, resolved, tiny))
    return problems


def check_this_node(command: list[str], resolved: Resolved, device: str) -> list[Problem]:
    """For ranks started on this node by a scheduler or by `--no-ssh` (whose memory fit is the
    scheduler's or each node's own business): its kernels (K1, X1) and its builds (BLD*)."""
    probed = probe()
    machine = Machine.from_probe("this machine", probed)
    device = device_for(device, machine)
    _refuse_unrunnable(command, resolved, device, probed)
    ops = job_ops(resolved, device)
    problems = build_problems(ops, build_facts(), device=device, host=machine.name) if ops else []
    if errors(problems):
        _refuse_builds(command, machine.name, problems)
    return problems


def _refuse_unrunnable(command: list[str], resolved: Resolved, device: str, probed: dict) -> None:
    """What this machine's ranks cannot run (launch/fit.py `device_run_problems`)."""
    unrunnable = device_run_problems(resolved, device, probed)
    if unrunnable:
        raise Refused(f"{command[2]} asks for what its {device.upper()} ranks here cannot run",
                      unrunnable, "ways forward: use the fixes above, or run on GPUs")


def _refuse_builds(command: list[str], host: str, problems: list[Problem]) -> None:
    raise Refused(f"{command[2]} cannot build its DeepSpeed ops on {host}", problems,
                  "ways forward: set up the build as each fix says, or start anyway: add "
                  "--skip-fit-check")


def ways_forward(command: list[str], resolved: Resolved, tiny: bool) -> str:
    lay = resolved.layout
    lines = ["ways forward:",
             f"  - run it on {lay.world_size} GPUs with {format_bytes(rank_memory_bytes(resolved, 'cuda'))} "
             "or more each over a hostfile (hostfiles/ has examples): "
             f"{shlex.join(command + ['--hostfile', 'HOSTFILE'])}",
             "  - shrink it: fewer ranks (--world-size, parallel.*), a smaller model (model.*), "
             "or less memory a rank (zero.stage, train.activation_checkpointing, "
             "train.micro_batch); `dsforge plan --search` finds layouts that fit"]
    if not tiny:
        lines.append("  - smoke-test this exact layout at tiny size on CPU: "
                     f"{shlex.join(command + ['--tiny'])}")
    lines.append("  - or start anyway: add --skip-fit-check")
    return "\n".join(lines)


def own_run_dir(given: Path | None, resolved: Resolved, *, resume: bool, joining: bool,
                create: bool, say: Say, peers_may_join: bool = False) -> tuple[RunDir, Lock | None]:
    """The run directory of --run-dir `given`: a new, empty one (a fresh name without
    `given`); or, to resume or join, the existing one (with a checkpoint this recipe can
    continue from, to resume: the earlier attempt's records are set aside, job/run_dir.py).
    Unless joining another node's run or only printing commands, the returned lock makes this
    process its owner: keep it until exit. Raises RunDirError or CheckpointError."""
    from dsforge.ckpt.trust import check_resumable

    if not (resume or joining):
        run_dir = new_run_dir(given, resolved.recipe.name, create=create,
                              peers_may_join=peers_may_join)
        lock = claim(run_dir, fresh=True, peers_may_join=peers_may_join) if create else None
        return run_dir, lock
    run_dir = existing_run_dir(given, resume=resume, create=create)
    lock = claim(run_dir, fresh=False, peers_may_join=peers_may_join) if resume and create else None
    if resume:
        record = check_resumable(run_dir, dataclasses.asdict(resolved.recipe),
                                 resolved.layout.world_size)
        say(f"dsforge: resuming {run_dir} after step {record['step']}")
        if create and not peers_may_join:  # other nodes' ranks may already write there
            set_aside(run_dir)
        for change in record["layout_changes"]:
            say(f"  new layout: {change}")
        for change in record["changes"]:
            say(f"  changed: {change}")
    return run_dir, lock


def launch_and_watch(command: list[str], run_dir: RunDir, ranks: int, *, timeout: float | None,
                     verbose: bool, say: Say, stop_grace: float = STOP_GRACE_S,
                     extra_env: dict[str, str] | None = None, srun: bool = False,
                     asked: StopAsked | None = None) -> int:
    """Run the job with dsforge's lines on the terminal and everything in RUN_DIR/job.log.
    Success is every one of its `ranks` reporting completion, not only the launcher's exit
    code (a launcher killed by a signal, or a cut remote command, can exit 0). Ranks that
    all stopped early with a checkpoint (a signal, train.time_limit) give EXIT_RESUMABLE.
    `srun`: the command is srun (launch/slurm.py), with `extra_env` for its tasks. `asked`
    notes a stop somebody asked for (launch/local.StopAsked)."""
    env, dropped = runner_env(os.environ)
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
        say(f"dsforge: the ranks stopped together at step {step}: exit code {EXIT_NONFINITE}; the "
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


def plan_slurm(recipe: str, resolved: Resolved, *, device: str, master_addr: str | None,
               master_port: int | None, say: Say):
    """The srun plan for this allocation (launch/slurm.py); Refused outside an allocation or
    when the allocation cannot hold the recipe's world."""
    from dsforge.launch import slurm

    if not slurm.in_allocation(os.environ):
        raise Refused(f"dsforge run {recipe} --launcher slurm",
                      [slurm.outside_allocation_problem(recipe)])
    plan, problems = slurm.plan_job(resolved.layout.world_size, os.environ,
                                    cpu_only=device == "cpu", master_addr=master_addr,
                                    master_port=master_port, free_port=free_port)
    if plan is None:
        raise Refused(f"{recipe} in Slurm allocation {os.environ['SLURM_JOB_ID']}", problems)
    for warning in problems:
        say(f"  warning: {warning}")
    say(f"dsforge: Slurm {plan.allocation.describe()}: {plan.nodes} x {plan.per_node} ranks "
        f"with srun, master {plan.master_addr}:{plan.master_port}")
    return plan


def check_tiny_layout(tiny: Resolved, run_dir: RunDir, *, env: dict[str, str],
                      timeout: float | None, verbose: bool, say: Say) -> int:
    """Train the same tiny model on one rank and compare losses; 1 if they disagree."""
    reference = reference_resolved(tiny)
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
