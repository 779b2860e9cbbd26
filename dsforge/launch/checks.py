"""Everything `dsforge run` refuses before any rank starts (exit 2), in the order it asks.

`checked_run` walks them once for a new job: the recipe against its world (recipe/), shrunk
with --tiny, the options that cannot go together, the Slurm allocation (SL1, SL2), the
environment the ranks get (H4) and the compile backend it names (CM6), and what this machine's
ranks cannot run, build or hold (launch/fit.py's rules: FIT1-FIT3, the kernels, float8 and
compile rules, BLD1-BLD6). A restart asks this machine again (`check_this_machine`); the hosts
of a hostfile are asked by preflight (`preflight_or_refuse`) when their command line is made,
after the remote shell's input (H6). Each refusal raises Refused or BadOptions
(launch/refusal.py), which cli.py prints; warnings are said and never block.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dsforge.job.word import forwarded_env
from dsforge.launch.commands import Placement, remote_shell_problems
from dsforge.launch.fit import (Machine, device_for, device_run_problems, fit_problems,
                                rank_memory_bytes)
from dsforge.launch.probe import build_facts, probe
from dsforge.launch.refusal import BadOptions, Refused, Say, resolve_or_refuse, warn
from dsforge.problems import Problem, RecipeError, errors
from dsforge.recipe import Resolved
from dsforge.recipe.hostfile import active_hosts, read_hostfile
from dsforge.recipe.tiny import tiny_resolved
from dsforge.translate.build_env import BUILD_RULES, build_problems, job_ops
from dsforge.translate.compile import BACKEND_ENV, DEFAULT_BACKEND, compile_backend
from dsforge.units import format_bytes

# Why --max-restarts and --no-ssh do not go together (docs/launch.md, "Restarts").
NO_SSH_RESTARTS = (
    "--max-restarts cannot restart a --no-ssh job: each node's dsforge starts only its own "
    "ranks and cannot stop or start the other nodes', so node 0 alone would wait for peers that "
    "ended; run the job from one place (--hostfile with pdsh, or --launcher slurm), or have "
    "each node's supervisor (systemd, Kubernetes) start `dsforge run ... --resume` again")


@dataclass(frozen=True)
class Checked:
    """A job `checked_run` let through: its options (CPU ranks with --tiny), the recipe
    resolved (and shrunk), the srun plan with --launcher slurm, and the environment every
    rank gets (job/word.py)."""

    options: object  # launch/entry.RunOptions, which imports this module
    resolved: Resolved
    slurm_plan: object | None  # launch/slurm.SlurmPlan
    env: dict[str, str]


def checked_run(options, say: Say) -> Checked:
    """Every check of a new job, `options` being `dsforge run`'s (launch/entry.RunOptions)."""
    resolved = resolve_or_refuse(options.recipe, options.overrides, options.world_size,
                                 options.hostfile, options.include, options.exclude)
    if options.tiny:
        options, resolved = _at_tiny_size(options, resolved, say)
    warn(resolved.warnings, say)
    check_option_pairs(options)
    check_rank_imports(Path.cwd())
    slurm_plan = None
    if options.launcher == "slurm":
        slurm_plan = plan_slurm(options.recipe, resolved, device=options.device,
                                master_addr=options.master_addr,
                                master_port=options.master_port, say=say,
                                spare_nodes=options.spare_nodes)
    env = checked_env()
    refuse("environment", compile_backend_problems(resolved))
    if not options.skip_fit_check:
        check_this_machine(options, resolved, say)
    return Checked(options=options, resolved=resolved, slurm_plan=slurm_plan, env=env)


def check_rank_imports(cwd: Path) -> None:
    """BadOptions when the ranks would import another dsforge than this command's: they start
    as `python -m dsforge.runtime.rank` in `cwd`, which puts it first on sys.path. A clone's
    top folder there (./dsforge without __init__.py) wins over an editable install's finder as
    an empty namespace package (its data/ folder then hides dsforge.data: every rank fails at
    import), and another checkout would run other code than this command checked. Python
    itself is asked, the way the ranks start, only where `cwd` holds a dsforge at all."""
    import dsforge

    ours = Path(dsforge.__file__).resolve().parent
    here = [p for p in (cwd / "dsforge", cwd / "dsforge.py") if p.exists()]
    if not here or here[0].resolve() == ours:
        return
    asked = subprocess.run([sys.executable, "-c", "import dsforge; print(dsforge.__file__)"],
                           cwd=cwd, capture_output=True, text=True, timeout=120)
    theirs = asked.stdout.strip().splitlines()[-1] if asked.stdout.strip() else "None"
    if asked.returncode == 0 and theirs != "None" and Path(theirs).resolve().parent == ours:
        return
    what = (f"{here[0]}, a folder without __init__.py (a clone's top folder?)"
            if theirs == "None" else theirs)
    raise BadOptions(f"the ranks would import dsforge from {what}, not from {ours}, which this "
                     "command runs: they start with `python -m` here, which puts this folder "
                     "first on their module path. Run dsforge from another folder")


def refuse(source: str, problems: list[Problem], advice: str = "") -> None:
    """Refused when any of `problems` is an error."""
    if errors(problems):
        raise Refused(source, problems, advice)


def command_words(recipe: str, overrides: tuple[str, ...], world_size: int | None) -> list[str]:
    """The user's `dsforge run` command, for the ways forward a refusal suggests."""
    words = ["dsforge", "run", recipe]
    words += ["--world-size", str(world_size)] if world_size else []
    for item in overrides:
        words += ["--set", item]
    return words


def profile_override(profile_steps: str) -> str:
    """`--profile A:B` as the override tracking.profile="A:B"; BadOptions for anything else."""
    if not re.fullmatch(r"\d+:\d+", profile_steps):
        raise BadOptions(  # e.g. a planner's profile file, which is another command's
            f"--profile {profile_steps!r} is not a step range: give the first and last step "
            "to trace as A:B (0-based), e.g. --profile 3:5. A planner's profile file goes to "
            "dsforge plan --search --profile")
    return f"tracking.profile={json.dumps(profile_steps)}"  # quoted: YAML reads 3:5 as 185


# --tiny -------------------------------------------------------------------------------------

def _at_tiny_size(options, resolved: Resolved, say: Say):
    """--tiny: the same layout at tiny size on CPU ranks (gloo)."""
    if options.device == "cuda" or options.backend == "nccl":
        raise BadOptions("--tiny runs on CPU ranks (gloo); leave out --device and --backend")
    tiny = shrink_to_tiny(options.recipe, resolved, options.overrides, say)
    return dataclasses.replace(options, device="cpu", backend="gloo"), tiny


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
    parts = [f"{lay.world_size} rank{'s' if lay.world_size > 1 else ''}: dp{lay.dp}", f"tp{lay.tp}"]
    parts += [f"pp{lay.pp}"] if lay.pp > 1 else []
    parts += [f"vpp{lay.vpp}"] if lay.vpp > 1 else []
    parts += [f"cp{lay.cp}"] if lay.cp > 1 else []
    parts += [f"ep{lay.ep}"] if lay.ep > 1 else []
    return " x ".join(parts) + (" + sequence parallel" if lay.sequence_parallel else "")


# Options ------------------------------------------------------------------------------------

def check_option_pairs(options) -> None:
    """--no-ssh's and --launcher slurm's companions, and --max-restarts where it cannot work."""
    if options.node_rank is not None:
        _check_no_ssh_options(options)
    if options.resume_or_start and (options.resume or options.node_rank is not None
                                    or options.run_dir is None):
        raise BadOptions("--resume-or-start decides for itself whether --run-dir holds a run to "
                         "resume: it needs --run-dir, and takes neither --resume nor --no-ssh "
                         "(each node would decide alone: give --resume there)")
    if options.max_restarts and options.node_rank is not None:
        raise BadOptions(NO_SSH_RESTARTS)
    slurm = options.launcher == "slurm"
    if options.exclude_after is not None and not ((options.hostfile or slurm)
                                                  and options.max_restarts):
        raise BadOptions("--exclude-after leaves a failing host out of the restarts: it needs "
                         "--max-restarts N, and --hostfile or --launcher slurm")
    if options.spare_nodes and not (slurm and options.max_restarts):
        raise BadOptions("--spare-nodes keeps Slurm nodes standing by for the restarts: it "
                         "needs --launcher slurm and --max-restarts N (over a hostfile, spares "
                         "are `#spare HOST slots=N` lines)")
    if options.launcher == "slurm":
        _check_slurm_options(options)


def _check_no_ssh_options(options) -> None:
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


def _check_slurm_options(options) -> None:
    """Under Slurm the nodes are the allocation's: no hostfile, filters or --no-ssh."""
    given = [name for name, value in (("--hostfile", options.hostfile),
                                      ("--include", options.include),
                                      ("--exclude", options.exclude),
                                      ("--no-ssh", options.node_rank))
             if value not in (None, "")]
    if given:
        raise BadOptions(f"--launcher slurm takes its nodes from the Slurm allocation; "
                         f"leave out {', '.join(given)}")


def plan_slurm(recipe: str, resolved: Resolved, *, device: str, master_addr: str | None,
               master_port: int | None, say: Say, spare_nodes: int = 0):
    """The srun plan for this allocation (launch/slurm.py); Refused outside an allocation or
    when the allocation cannot hold the recipe's world."""
    from dsforge.launch import slurm
    from dsforge.launch.local import free_port

    if not slurm.in_allocation(os.environ):
        raise Refused(f"dsforge run {recipe} --launcher slurm",
                      [slurm.outside_allocation_problem(recipe)])
    plan, problems = slurm.plan_job(resolved.layout.world_size, os.environ,
                                    cpu_only=device == "cpu", master_addr=master_addr,
                                    master_port=master_port, free_port=free_port,
                                    spare_nodes=spare_nodes)
    if plan is None:
        raise Refused(f"{recipe} in Slurm allocation {os.environ['SLURM_JOB_ID']}", problems)
    warn(problems, say)
    spares = plan.hostfile.spares
    say(f"dsforge: Slurm {plan.allocation.describe()}: {plan.nodes} x {plan.per_node} ranks "
        f"with srun, master {plan.address(plan.hostfile)}:{plan.master_port}"
        + (f", spare node{'s' if len(spares) > 1 else ''} {', '.join(h for h, _ in spares)}"
           if spares else ""))
    return plan


# What the ranks get -------------------------------------------------------------------------

def checked_env() -> dict[str, str]:
    """The environment forwarded to every rank (job/word.py); Refused for a name a shell
    would misread (rule H4)."""
    try:
        return forwarded_env(os.environ)
    except RecipeError as exc:
        raise Refused("environment", exc.problems) from None


def compile_backend_problems(resolved: Resolved) -> list[Problem]:
    """CM6: with model.compile on, DSFORGE_COMPILE_BACKEND (which every rank gets in its job
    word) must name a backend torch.compile knows; the ranks would fail building the model.
    Asked of torch only when it names another than inductor: importing dynamo takes seconds."""
    model = resolved.recipe.model
    backend = compile_backend()
    if model.compile == "none" or backend == DEFAULT_BACKEND:
        return []
    from torch._dynamo import list_backends

    if backend in list_backends(exclude_tags=()):  # the debugging ones too (aot_eager, eager)
        return []
    return [Problem(rule="CM6", fields={BACKEND_ENV: backend, "model.compile": model.compile},
                    message="not a backend torch.compile knows (torch._dynamo.list_backends())",
                    fix=f"unset {BACKEND_ENV} (inductor), or set it to one of "
                        f"{', '.join(list_backends())}, or aot_eager or eager (debugging)")]


# This machine -------------------------------------------------------------------------------

def check_this_machine(options, resolved: Resolved, say: Say) -> None:
    """Ranks that start here are checked here: a local job whole (memory fit too), this node's
    ranks under Slurm or --no-ssh (kernels and builds); a hostfile's hosts are the preflight's.
    Its warnings are said."""
    command = command_words(options.recipe, options.overrides, options.world_size)
    if options.launcher == "slurm" or options.node_rank is not None:
        warn(check_this_node(command, resolved, options.device), say)
    elif options.hostfile is None:
        warn(check_fit(command, resolved, options.device, options.tiny), say)


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
    if refusals:  # the advice costs a memory estimate: made for a refusal only
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


# The hosts of a hostfile --------------------------------------------------------------------

def check_remote_shell(placement: Placement) -> None:
    """H6: what DeepSpeed's runners paste unquoted into every node's shell."""
    refuse("launch", remote_shell_problems(placement, cwd=os.getcwd(), python=sys.executable))


def preflight_or_refuse(hostfile: str, include: str, exclude: str, port: int, *, say: Say,
                        timeout_s: float = 10.0, fit: tuple[Resolved, str] | None = None,
                        down: list[str] = ()) -> None:
    """Every host reachable with the same versions and the master port free; with `fit`
    (the resolved job and --device), each host's slots and memory checked against the job.
    `down`: hosts the host-down drill failed (job/hosts.py), reported as unreachable."""
    from dsforge.launch.preflight import preflight

    hosts = active_hosts(read_hostfile(hostfile), include, exclude)
    problems = [Problem(rule="F1", fields={"host": host},
                        message="unreachable (DSFORGE_INJECT_FAULT host-down drill)",
                        fix="a drill: nothing to fix") for host in down if host in hosts.hostnames]
    problems += preflight(hosts, master_port=port, timeout_s=timeout_s, fit=fit)
    refuse(f"preflight of {hostfile}", problems)
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
