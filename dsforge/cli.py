"""The `dsforge` command: thin click commands that load, call one function and print."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

import click

from dsforge.problems import EXIT_INVALID, errors, print_problems
from dsforge.recipe.hostfile import active_hosts, read_hostfile

# Run-directory locks this process holds until it exits (launch/run_dir.claim).
_HELD: list = []
from dsforge.recipe import RecipeError, Resolved, resolve_file


def _recipe_options(command):
    """RECIPE plus the world (--world-size | --hostfile) and --set overrides."""
    command = click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
                           help="Override a recipe field, typed like YAML. Repeatable.")(command)
    command = click.option("--hostfile", type=click.Path(dir_okay=False),
                           help="DeepSpeed hostfile; the world size is its total slots.")(command)
    command = click.option("--world-size", type=click.IntRange(min=1),
                           help="Number of GPUs (ranks) to plan for.")(command)
    return click.argument("recipe", type=click.Path(dir_okay=False))(command)


def resolve_or_exit(recipe_path: str, overrides: tuple[str, ...], world_size: int | None,
                    hostfile: str | None, include: str = "", exclude: str = "") -> Resolved:
    """Load, validate and resolve; on any error print every problem and exit 2."""
    if world_size is not None and hostfile is not None:
        raise click.UsageError("give either --world-size or --hostfile, not both")
    try:
        return resolve_file(recipe_path, overrides, world_size=world_size, hostfile=hostfile,
                            include=include, exclude=exclude)
    except RecipeError as exc:
        print_problems(recipe_path, exc.problems)
        sys.exit(EXIT_INVALID)


def _print_warnings(problems) -> None:
    for warning in problems:
        click.echo(f"  warning: {warning}", err=True)


def entry(argv: list[str] | None = None) -> None:
    """Console entry point. DeepSpeed's launcher puts `--local_rank=N` before the module's own
    arguments (`python -m dsforge --local_rank=0 run ...`); move it behind the subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    local = [a for a in args if a.startswith("--local_rank")]
    if local and "run" in args:
        args = [a for a in args if not a.startswith("--local_rank")]
        value = local[0].split("=", 1)[1] if "=" in local[0] else args.pop(args.index(local[0]) + 1)
        args.insert(args.index("run") + 1, f"--local_rank={value}")
    main(args=args, prog_name="dsforge")


@click.group()
@click.version_option(package_name="dsforge")
def main() -> None:
    """dsforge: one YAML recipe -> a DeepSpeed ZeRO + Megatron-Core training job."""


@main.command()
@_recipe_options
def validate(recipe, world_size, hostfile, overrides):
    """Check RECIPE against every rule; exit 0 if valid, 2 with all problems otherwise."""
    resolved = resolve_or_exit(recipe, overrides, world_size, hostfile)
    for warning in resolved.warnings:
        click.echo(f"  warning: {warning}", err=True)
    lay = resolved.layout
    click.echo(f"{recipe}: valid for world size {lay.world_size} (dp {lay.dp} x tp {lay.tp} x "
               f"pp {lay.pp}, grad_accum {lay.grad_accum})")


_SEARCH_ONLY = ("gpus", "gpus_per_node", "gpu", "global_batch_tokens", "seq_len", "write", "html",
                "profile", "measure", "measure_out", "memory_headroom")


@main.command()
@_recipe_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--search", is_flag=True,
              help="Search every layout for RECIPE's model (or a preset name given instead).")
@click.option("--gpus", type=click.IntRange(min=1), help="--search: GPUs to lay the model out on.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), help="--search: GPUs per node [8].")
@click.option("--gpu", help="--search: GPU type, e.g. h100, h200, a100 [h100].")
@click.option("--global-batch-tokens", type=click.IntRange(min=1),
              help="--search: tokens per optimizer step [the recipe's, else 1048576].")
@click.option("--seq-len", type=click.IntRange(min=1), help="--search: sequence length [4096].")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True,
              help="--search: how many layouts to show.")
@click.option("--write", type=click.Path(dir_okay=False, path_type=Path),
              help="--search: write the best layout as a recipe here.")
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path),
              help="--search: write the explorer page (one self-contained file) here.")
@click.option("--profile", type=click.Path(dir_okay=False, path_type=Path),
              help="--search: cluster profile YAML (bandwidths, efficiency, memory margin).")
@click.option("--memory-headroom", type=float,
              help="--search: share of GPU memory kept free for allocator fragmentation and what the "
                   "memory model does not count, a fraction in [0, 1) [0.1; the profile's memory_margin].")
@click.option("--measure", is_flag=True,
              help="--search: run short trials of the top layouts here and re-rank by measurement.")
@click.option("--measure-out", type=click.Path(file_okay=False, path_type=Path),
              help="--measure: where the trials and results.db go [runs/search-MODEL-TIME].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True,
              help="Translate the engine configs for this device; auto = cuda when a GPU is "
                   "visible here, else cpu (what `dsforge run` would use).")
def plan(recipe, world_size, hostfile, overrides, as_json, search, top, device, **search_options):
    """Show how RECIPE will be laid out, its configs, memory, bubble and FLOPs.

    With --search, RECIPE may be a model preset name (e.g. llama3-70b): every valid layout
    is estimated and the fastest that fit are ranked, with the reasons.
    """
    if search:
        from dsforge.search.command import run_search_command

        if world_size or hostfile or device != "auto":
            raise click.UsageError("with --search, give the cluster as --gpus N [--gpus-per-node G] "
                                   "(the search plans for GPUs; --device does not apply)")

        run_search_command(recipe, overrides=overrides, as_json=as_json, top=top, **search_options)
        return
    given = [f"--{name.replace('_', '-')}" for name in _SEARCH_ONLY if search_options.get(name)]
    if given:
        raise click.UsageError(f"{', '.join(given)} only apply with --search")
    from dsforge.plan import build_plan, render_plan

    resolved = resolve_or_exit(recipe, overrides, world_size, hostfile)
    result = build_plan(resolved, device=device)
    click.echo(json.dumps(result, indent=2) if as_json else render_plan(result), nl=not as_json)
    if as_json:
        click.echo()


@main.command()
@_recipe_options
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where metrics, the resolved recipe and checkpoints go "
                   "[default: runs/NAME-TIMESTAMP].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="auto = cuda when a GPU is visible, else cpu.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto",
              show_default=True, help="auto = nccl on GPUs, gloo on CPU.")
@click.option("--step-timeout", type=float, default=300.0, show_default=True,
              help="Seconds a step may take before its rank is declared stuck and the job ends.")
@click.option("--timeout", type=float, default=None, help="Wall-clock limit for the whole job.")
@click.option("--stop-grace", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds the ranks get to save a checkpoint and exit after SIGTERM or SIGUSR1 "
                   "before the job is stopped at once.")
@click.option("--resume", is_flag=True,
              help="Continue the run in --run-dir from its latest complete checkpoint.")
@click.option("--launcher", type=click.Choice(["pdsh", "openmpi", "mvapich", "slurm"]),
              default="pdsh", show_default=True,
              help="With --hostfile: DeepSpeed's multi-node runner. slurm: start the ranks with "
                   "srun inside a Slurm allocation (salloc, or a script from `dsforge sbatch`).")
@click.option("--include", default="", help="DeepSpeed --include: NODE[:SLOT,...][@NODE...].")
@click.option("--exclude", default="", help="DeepSpeed --exclude, same format.")
@click.option("--no-ssh", "node_rank", type=int, default=None, metavar="NODE_RANK",
              help="Start only this node's ranks, without ssh (run once per node).")
@click.option("--master-addr", default=None, help="Address of the first node (multi-node).")
@click.option("--master-port", type=int, default=None, help="Rendezvous port [default: free].")
@click.option("--dry-run", is_flag=True, help="Print the command lines and exit.")
@click.option("--tiny", is_flag=True,
              help="Keep the recipe's layout, shrink model and batch to the smallest valid size, "
                   "train a few steps on CPU ranks and compare the loss with one rank's.")
@click.option("--skip-fit-check", is_flag=True,
              help="Start even if the job's ranks or memory do not fit this machine, or it lacks "
                   "what the ranks build or run.")
@click.option("--verbose", is_flag=True,
              help="Also show the engines' and the launcher's output (always in RUN_DIR/job.log).")
@click.option("--profile", "profile_steps", metavar="A:B", default=None,
              help="Write a torch profiler trace of steps A to B (0-based) of rank 0 to "
                   "RUN_DIR/profile; the same as --set tracking.profile=\"A:B\".")
@click.option("--local_rank", type=int, default=None, hidden=True)
def run(recipe, world_size, hostfile, overrides, run_dir, device, backend, step_timeout, timeout,
        resume, launcher, include, exclude, node_rank, master_addr, master_port, dry_run, tiny,
        skip_fit_check, verbose, profile_steps, local_rank, stop_grace):
    """Train RECIPE: validate, check that it fits this machine, then start the ranks with
    DeepSpeed's launcher, here or on the hosts of --hostfile. Also runs as the script
    `deepspeed ... -m dsforge run` starts."""
    if profile_steps is not None:
        # Quoted: YAML would read an unquoted 3:5 as the base-60 integer 185.
        overrides = (*overrides, f"tracking.profile={json.dumps(profile_steps)}")
    from dsforge.job.owner import current_owner
    from dsforge.job.word import JobSpec
    from dsforge.launch import start
    from dsforge.launch.commands import (Placement, launch_command, plain_deepspeed_command,
                                         remote_shell_problems)
    from dsforge.launch.local import free_port
    from dsforge.recipe.loader import dump_recipe

    if local_rank is not None:  # started by DeepSpeed's launcher: be a rank
        _run_as_launched_rank(recipe, overrides, run_dir, device, backend, step_timeout, resume)
    resolved = resolve_or_exit(recipe, overrides, world_size, hostfile, include, exclude)
    try:
        if tiny:
            if device == "cuda" or backend == "nccl":
                raise click.UsageError("--tiny runs on CPU ranks (gloo); leave out --device "
                                       "and --backend")
            resolved = start.shrink_to_tiny(recipe, resolved, overrides, _say)
            device, backend = "cpu", "gloo"
        _print_warnings(resolved.warnings)
        command_words = start.command_words(recipe, overrides, world_size)
        if launcher == "slurm":
            _check_slurm_options(hostfile, include, exclude, node_rank)
            slurm_plan = start.plan_slurm(recipe, resolved, device=device, master_addr=master_addr,
                                          master_port=master_port, say=_say)
        if not skip_fit_check:
            _check_this_machine(command_words, resolved, device, tiny, hostfile=hostfile,
                                node_rank=node_rank, launcher=launcher)
    except start.Refused as refused:
        _exit_refused(refused)
    if launcher == "slurm":
        _run_in_slurm(slurm_plan, recipe, resolved, overrides, run_dir=run_dir, device=device,
                      backend=backend, step_timeout=step_timeout, resume=resume, dry_run=dry_run,
                      timeout=timeout, verbose=verbose, stop_grace=stop_grace, tiny=tiny)
    placement = Placement(world_size=resolved.layout.world_size, hostfile=hostfile,
                          launcher=launcher, include=include, exclude=exclude,
                          master_addr=master_addr, master_port=master_port or free_port(),
                          node_rank=node_rank)
    _exit_if_problems("launch", remote_shell_problems(placement, cwd=os.getcwd(),
                                                      python=sys.executable))
    # With --no-ssh every node starts its own dsforge; nodes after the first join the run
    # directory the first one made (it may already hold their peers' files).
    joining = node_rank is not None and node_rank > 0
    run_dir = _own_run_dir_or_exit(run_dir, resolved, resume=resume, joining=joining,
                                   create=not dry_run, peers_may_join=node_rank is not None)
    job = JobSpec(recipe_yaml=dump_recipe(resolved.recipe), run_dir=str(run_dir.resolve()),
                  device=device, backend=backend, step_timeout_s=step_timeout, resume=resume,
                  env=_forwarded_env(), owner=current_owner())
    command = launch_command(placement, job)
    if hostfile and node_rank is None and launcher in ("pdsh", "openmpi", "mvapich") and not dry_run:
        _preflight_or_exit(recipe, hostfile, include, exclude, placement.master_port,
                           fit=None if skip_fit_check else (resolved, device))
    if dry_run:
        click.echo(shlex.join(command))
        click.echo("# the same job as a plain deepspeed command:\n"
                   + plain_deepspeed_command(placement, Path(recipe), run_dir, overrides))
        return
    ranks = _ranks_started_here(resolved, hostfile, include, exclude, node_rank)
    code = start.launch_and_watch(command, run_dir, ranks, timeout=timeout, verbose=verbose,
                                  say=_say, stop_grace=stop_grace)
    if code == 0 and tiny:
        code = start.check_tiny_layout(resolved, run_dir, env=_forwarded_env(), timeout=timeout,
                                       verbose=verbose, say=_say)
    sys.exit(code)


def _check_this_machine(command: list[str], resolved: Resolved, device: str, tiny: bool, *,
                        hostfile, node_rank, launcher) -> None:
    """Ranks that start here are checked here: a local job whole (memory fit too), this node's
    ranks under Slurm or --no-ssh (kernels and builds); a hostfile's hosts are the preflight's."""
    from dsforge.launch import start

    if launcher == "slurm" or node_rank is not None:
        _print_warnings(start.check_this_node(command, resolved, device))
    elif hostfile is None:
        _print_warnings(start.check_fit(command, resolved, device, tiny))


def _check_slurm_options(hostfile, include, exclude, node_rank) -> None:
    given = [name for name, value in (("--hostfile", hostfile), ("--include", include),
                                      ("--exclude", exclude), ("--no-ssh", node_rank))
             if value not in (None, "")]
    if given:
        raise click.UsageError(f"--launcher slurm takes its nodes from the Slurm allocation; "
                               f"leave out {', '.join(given)}")


def _run_in_slurm(plan, recipe, resolved, overrides, *, run_dir, device, backend, step_timeout,
                  resume, dry_run, timeout, verbose, stop_grace, tiny) -> None:
    """`dsforge run --launcher slurm`: one srun for every rank of the job (launch/slurm.py)."""
    from dsforge.job.owner import current_owner
    from dsforge.job.word import JobSpec
    from dsforge.launch import start
    from dsforge.recipe.loader import dump_recipe

    run_dir = _own_run_dir_or_exit(run_dir, resolved, resume=resume, joining=False,
                                   create=not dry_run, peers_may_join=False)
    job = JobSpec(recipe_yaml=dump_recipe(resolved.recipe), run_dir=str(run_dir.resolve()),
                  device=device, backend=backend, step_timeout_s=step_timeout, resume=resume,
                  env=_forwarded_env(), owner=current_owner(), slurm=True)
    command = plan.command([sys.executable, "-u", "-m", "dsforge.runtime.rank",
                            "--job", job.encode()])
    if dry_run:
        click.echo(" ".join(f"{k}={v}" for k, v in plan.env().items()) + " " + shlex.join(command))
        sys.exit(0)
    code = start.launch_and_watch(command, run_dir, resolved.layout.world_size, timeout=timeout,
                                  verbose=verbose, say=_say, stop_grace=stop_grace,
                                  extra_env=plan.env(), srun=True)
    if code == 0 and tiny:
        code = start.check_tiny_layout(resolved, run_dir, env=_forwarded_env(), timeout=timeout,
                                       verbose=verbose, say=_say)
    sys.exit(code)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--nodes", type=click.IntRange(min=1), default=None,
              help="Nodes to ask for [the recipe's cluster.nodes, else 1].")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=None,
              help="GPUs a node, one rank each; 0 for CPU ranks [the recipe's "
                   "cluster.gpus_per_node, else its world / nodes].")
@click.option("--time", "time_limit", default=None, metavar="T",
              help="Slurm's --time (minutes, HH:MM:SS, D-HH:MM:SS); also sets train.time_limit "
                   "to T less --signal-grace unless the recipe has one.")
@click.option("--partition", default=None, help="Slurm partition.")
@click.option("--account", default=None, help="Slurm account.")
@click.option("--signal-grace", type=click.IntRange(min=1), default=300, show_default=True,
              help="Seconds before the time limit at which Slurm sends SIGTERM to the script, "
                   "which has the ranks save and stop.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The job's run directory, the same for every requeue [runs/NAME-TIMESTAMP].")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the script here (it must not exist) instead of printing it.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
              help="Override a recipe field (passed to dsforge run in the script). Repeatable.")
def sbatch(recipe, nodes, gpus_per_node, time_limit, partition, account, signal_grace, run_dir,
           out, overrides):
    """Write a Slurm batch script for RECIPE: #SBATCH lines, a trap that passes Slurm's
    warning signal to `dsforge run --launcher slurm`, and a requeue when the ranks stopped
    with a checkpoint (exit 75); the requeued job resumes. Exit status: 0 written, 2 refused."""
    from dsforge.job.run_dir import runs_root
    from dsforge.launch import slurm

    resolved = resolve_or_exit(recipe, overrides, None, None)
    cluster = resolved.recipe.cluster
    nodes = nodes or (cluster.nodes if cluster else 1)
    if gpus_per_node is None:
        gpus_per_node = cluster.gpus_per_node if cluster else resolved.layout.world_size // nodes
    world = nodes * gpus_per_node if gpus_per_node else resolved.layout.world_size
    run_args = [a for item in overrides for a in ("--set", item)]
    if world != resolved.layout.world_size:
        resolved = resolve_or_exit(recipe, overrides, world, None)
        run_args += ["--world-size", str(world)]
    _exit_if_problems("dsforge sbatch", slurm.batch_problems(
        world=world, nodes=nodes, gpus_per_node=gpus_per_node, time=time_limit,
        signal_grace_s=signal_grace))
    limit = slurm.derived_time_limit(time_limit, signal_grace, resolved.recipe.train.time_limit)
    run_args += ["--set", f"train.time_limit={limit}"] if limit else []
    name = resolved.recipe.name
    run_dir = (run_dir or runs_root() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    run_dir.parent.mkdir(parents=True, exist_ok=True)  # Slurm opens the output file there
    job = slurm.BatchJob(
        recipe=str(Path(recipe).absolute()), run_dir=str(run_dir), job_name=f"dsforge-{name}",
        nodes=nodes, tasks_per_node=world // nodes, gpus_per_node=gpus_per_node,
        time=time_limit, partition=partition, account=account, signal_grace_s=signal_grace,
        output=f"{run_dir}.slurm-%j.out", workdir=os.getcwd(), run_args=tuple(run_args),
        dsforge=slurm.dsforge_words())
    script = slurm.sbatch_script(job, command_line=shlex.join(["dsforge", "sbatch", *sys.argv[2:]]))
    if out is None:
        click.echo(script, nl=False)
        return
    try:
        with open(out, "x") as f:
            f.write(script)
    except FileExistsError:
        raise click.UsageError(f"{out} exists; remove it or give another --out") from None
    out.chmod(0o755)
    _say(f"dsforge: wrote {out} ({nodes} node{'s' if nodes > 1 else ''} x {world // nodes} "
         f"ranks, run directory {run_dir}); submit it with: sbatch {out}")


def _say(line: str) -> None:
    click.echo(line, err=True)


def _exit_refused(refused) -> None:
    print_problems(refused.source, refused.problems)
    if refused.advice:
        click.echo(refused.advice, err=True)
    sys.exit(EXIT_INVALID)


def _exit_if_problems(source: str, problems) -> None:
    if problems:
        print_problems(source, tuple(problems))
        sys.exit(EXIT_INVALID)


def _ranks_started_here(resolved: Resolved, hostfile, include, exclude, node_rank) -> int:
    """How many ranks this dsforge starts (and must hear completion from): all of them, or
    with --no-ssh only its node's."""
    if node_rank is None:
        return resolved.layout.world_size
    return active_hosts(read_hostfile(hostfile), include, exclude).node_slots[node_rank]


def _preflight_or_exit(recipe: str, hostfile: str, include: str, exclude: str, port: int,
                       timeout_s: float = 10.0, fit: tuple[Resolved, str] | None = None) -> None:
    """Every host reachable with the same versions and the master port free; with `fit`
    (the resolved job and --device), each host's slots and memory checked against the job."""
    from dsforge.launch.preflight import preflight

    hosts = active_hosts(read_hostfile(hostfile), include, exclude)
    problems = preflight(hosts, master_port=port, timeout_s=timeout_s, fit=fit)
    if errors(problems):
        print_problems(f"preflight of {hostfile}", tuple(problems))
        sys.exit(EXIT_INVALID)
    _print_warnings(problems)
    click.echo(f"dsforge: preflight ok: {len(hosts.hosts)} hosts reachable, same versions, "
               f"port {port} free on {hosts.hostnames[0]}"
               + (", the job fits every host" if fit else ""), err=True)


@main.command()
@_recipe_options
@click.option("--master-port", type=int, default=29500, show_default=True)
@click.option("--include", default="", help="DeepSpeed --include filter.")
@click.option("--exclude", default="", help="DeepSpeed --exclude filter.")
@click.option("--ssh-timeout", type=float, default=10.0, show_default=True)
def preflight(recipe, world_size, hostfile, overrides, master_port, include, exclude, ssh_timeout):
    """Check RECIPE and the hosts of --hostfile before a multi-node run: hostfile, world size,
    SSH to every host (in parallel), the master port, the same package versions everywhere,
    and that the job fits each host and can build there what its ranks build."""
    if hostfile is None:
        raise click.UsageError("preflight needs --hostfile")
    resolved = resolve_or_exit(recipe, overrides, world_size, hostfile, include, exclude)
    for warning in resolved.warnings:
        click.echo(f"  warning: {warning}", err=True)
    _preflight_or_exit(recipe, hostfile, include, exclude, master_port, ssh_timeout,
                       fit=(resolved, "auto"))


def _forwarded_env() -> dict[str, str]:
    from dsforge.job.word import forwarded_env

    try:
        return forwarded_env(os.environ)
    except RecipeError as exc:
        print_problems("environment", exc.problems)
        sys.exit(EXIT_INVALID)


def _run_as_launched_rank(recipe, overrides, run_dir, device, backend, step_timeout, resume):
    """`deepspeed [--hostfile H] -m dsforge run RECIPE`: every rank resolves the recipe
    against WORLD_SIZE itself and trains; the run directory must be the same on every rank."""
    from dsforge.job.run_dir import runs_root
    from dsforge.job.word import JobSpec
    from dsforge.recipe.loader import dump_recipe
    from dsforge.runtime.rank import run_rank

    world = int(os.environ["WORLD_SIZE"])
    resolved = resolve_or_exit(recipe, overrides, world, None)
    if run_dir is None:
        run_dir = runs_root() / (f"{resolved.recipe.name}-{os.environ.get('MASTER_ADDR', 'local')}"
                                 f"-{os.environ.get('MASTER_PORT', '0')}")
    run_rank(JobSpec(recipe_yaml=dump_recipe(resolved.recipe), run_dir=str(run_dir.resolve()),
                     device=device, backend=backend, step_timeout_s=step_timeout, resume=resume,
                     marked_output=False))


def _own_run_dir_or_exit(run_dir: Path | None, resolved: Resolved, *, resume: bool,
                         joining: bool, create: bool, peers_may_join: bool) -> Path:
    from dsforge.ckpt.trust import CheckpointError
    from dsforge.job.run_dir import RunDirError
    from dsforge.launch.start import own_run_dir

    try:
        run_dir, lock = own_run_dir(run_dir, resolved, resume=resume, joining=joining,
                                    create=create, say=_say, peers_may_join=peers_may_join)
    except RunDirError as exc:
        raise click.UsageError(str(exc)) from None
    except CheckpointError as exc:
        raise click.UsageError(f"cannot resume: {exc}") from None
    _HELD.append(lock)  # owned until this process exits
    return run_dir


@main.group()
def data() -> None:
    """Prepare and inspect corpora for training (docs/data.md)."""


@data.command("prepare")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--tokenizer", required=True, metavar="T",
              help="A local tokenizer.json, a local Hugging Face model folder, or 'bytes' "
                   "(UTF-8 bytes, EOD 256). Nothing is downloaded.")
@click.option("--output", required=True, metavar="PREFIX",
              help="Writes PREFIX.bin, PREFIX.idx and PREFIX.tokenizer.json.")
@click.option("--text-key", default="text", show_default=True,
              help="The field of each JSON-lines record that holds the document.")
@click.option("--workers", type=click.IntRange(min=0), default=1, show_default=True,
              help="Tokenizing processes (0: this process). The output does not depend on it.")
@click.option("--eod-token", default=None,
              help="End-of-document token [default: the tokenizer's eos_token].")
@click.option("--overwrite", is_flag=True, help="Replace an existing PREFIX.bin/.idx.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr [default: when stderr is a terminal].")
def data_prepare(inputs, **options):
    """Tokenize INPUT... (JSON-lines or plain text files, folders or globs of them) into a
    Megatron indexed dataset PREFIX.bin/.idx, the format Megatron-LM's and GPT-NeoX's tools
    read and write. Exit status: 0 written, 2 bad input (nothing written), 130/143 stopped."""
    from dsforge.data.prepare import prepare_main

    sys.exit(prepare_main(inputs, **options))


@data.command("inspect")
@click.argument("prefix", metavar="PREFIX")
@click.option("--scan", is_flag=True,
              help="Read every token (memory-mapped, in chunks) and print the largest id.")
def data_inspect(prefix, scan):
    """Show a Megatron indexed dataset PREFIX.bin/.idx: documents, sequences, tokens, dtype and
    the tokenizer recorded beside it. Reads the index only, unless --scan. Exit status: 0, or 2
    for a prefix that cannot be opened."""
    from dsforge.data.indexed import inspect_main

    sys.exit(inspect_main(prefix, scan=scan))


@main.command()
@click.argument("study", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Results directory [default: benchmarks/STUDY-NAME].")
@click.option("--retry-failed", is_flag=True, help="Run oom/timeout/crashed cells again.")
@click.option("--tiny", is_flag=True,
              help="Every cell's layout at tiny size on CPU ranks (a dry run of the study); "
                   "recorded as study NAME-tiny.")
def bench(study, out, retry_failed, tiny):
    """Run every cell of STUDY (a sweep over recipe fields) and record the results in
    OUT/results.db; finished cells are skipped when the study is run again. Exit status: 0
    every cell has a result, 2 invalid study or unusable OUT, 75 cells busy or the database
    locked (run again later), 130/143 stopped by Ctrl-C/SIGTERM (docs/bench.md)."""
    from dsforge.bench.run import bench_study
    from dsforge.bench.study import check_study, load_study

    try:
        parsed, recipe_path = load_study(study)
    except RecipeError as exc:
        print_problems(study, exc.problems)
        sys.exit(EXIT_INVALID)
    problems = check_study(parsed, recipe_path)
    if problems:  # before any cell runs
        print_problems(study, problems)
        sys.exit(EXIT_INVALID)
    if tiny:  # never mixed with the study's real results
        parsed = dataclasses.replace(parsed, name=f"{parsed.name}-tiny")
    out = out or Path("benchmarks") / parsed.name
    code = bench_study(parsed, recipe_path, out, retry_failed=retry_failed, tiny=tiny,
                       log=lambda line: click.echo(line, err=True))
    if code != EXIT_INVALID:
        click.echo(f"results: {out / 'results.db'}; report: dsforge report {out / 'results.db'}")
    sys.exit(code)


@main.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Where report.md and the plots go [default: next to RESULTS].")
@click.option("--peak-tflops", type=float, default=None,
              help="Peak dense TFLOP/s per GPU for MFU, instead of the device table's.")
def report(results, out, peak_tflops):
    """Write a markdown report with PNG plots from a bench results database."""
    from dsforge.bench.report import write_report
    from dsforge.bench.store import BenchError

    try:
        path = write_report(results, out or results.parent, peak_tflops=peak_tflops)
    except BenchError as exc:  # not a results database, or OUT not writable
        click.echo(f"dsforge report: {exc}", err=True)
        sys.exit(exc.exit_code)
    click.echo(f"report: {path}")


@main.command()
@click.argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT",
                type=click.Path(file_okay=False, path_type=Path))
@click.option("--to", "out", required=True, type=click.Path(path_type=Path),
              help="The Hugging Face folder to write; must not exist or be empty.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Weight dtype [default: the training precision's].")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors shard, e.g. 5GB, 500MB, 2GiB.")
def export(checkpoint, out, dtype, max_shard_size):
    """Write a checkpoint as a Hugging Face model folder: Llama for dense models, Mixtral for
    models whose every layer is MoE (docs/export.md). RUN_DIR means its latest complete
    checkpoint. Exit status: 0 written, 2 refused (nothing written)."""
    from dsforge.hf.export import export_main

    sys.exit(export_main(checkpoint, out, dtype=dtype, max_shard_size=max_shard_size))
