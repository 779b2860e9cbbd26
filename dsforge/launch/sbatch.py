"""`dsforge sbatch`: a Slurm batch script for a recipe (launch/slurm.py writes its text),
printed or written to a new file. Refusals raise Refused or BadOptions (launch/refusal.py)."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import click

from dsforge.job.run_dir import runs_root
from dsforge.launch import slurm
from dsforge.launch.refusal import BadOptions, Refused, Say, resolve_or_refuse
from dsforge.launch.run_options import MAX_RESTARTS, SPARE_NODES


def write_batch_script(recipe: str, *, nodes: int | None, gpus_per_node: int | None,
                       time_limit: str | None, partition: str | None, account: str | None,
                       signal_grace: int, run_dir: Path | None, out: Path | None,
                       overrides: tuple[str, ...], say: Say, show: Say,
                       max_restarts: int = 0, spare_nodes: int = 0) -> None:
    """The script for RECIPE on `nodes` x `gpus_per_node` (the recipe's cluster, else its world
    on one node), shown, or written to `out` (which must not exist) and made executable.
    `max_restarts`: the script's `dsforge run --max-restarts`, which runs srun again inside the
    allocation after a lost rank (launch/restart.py); `spare_nodes` more nodes stand by for
    those restarts (`dsforge run --spare-nodes`)."""
    resolved = resolve_or_refuse(recipe, overrides, None, None)
    cluster = resolved.recipe.cluster
    nodes = nodes or (cluster.nodes if cluster else 1)
    if gpus_per_node is None:
        gpus_per_node = cluster.gpus_per_node if cluster else resolved.layout.world_size // nodes
    world = nodes * gpus_per_node if gpus_per_node else resolved.layout.world_size
    run_args = [a for item in overrides for a in ("--set", item)]
    if world != resolved.layout.world_size:
        resolved = resolve_or_refuse(recipe, overrides, world, None)
        run_args += ["--world-size", str(world)]
    problems = slurm.batch_problems(world=world, nodes=nodes, gpus_per_node=gpus_per_node,
                                    time=time_limit, signal_grace_s=signal_grace,
                                    spare_nodes=spare_nodes, max_restarts=max_restarts)
    if problems:
        raise Refused("dsforge sbatch", problems)
    limit = slurm.derived_time_limit(time_limit, signal_grace, resolved.recipe.train.time_limit)
    run_args += ["--set", f"train.time_limit={limit}"] if limit else []
    run_args += ["--max-restarts", str(max_restarts)] if max_restarts else []
    run_args += ["--spare-nodes", str(spare_nodes)] if spare_nodes else []
    name = resolved.recipe.name
    run_dir = (run_dir or runs_root() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    run_dir.parent.mkdir(parents=True, exist_ok=True)  # Slurm opens the output file there
    if run_dir.is_dir() and any(run_dir.iterdir()):  # the script runs --resume-or-start
        say(f"dsforge: note: {run_dir} is not empty: the job continues its run from the newest "
            "complete checkpoint, or, with none, sets what is there aside in attempts/ and "
            "starts over")
    job = slurm.BatchJob(
        recipe=str(Path(recipe).absolute()), run_dir=str(run_dir), job_name=f"dsforge-{name}",
        nodes=nodes, tasks_per_node=world // nodes, gpus_per_node=gpus_per_node,
        spare_nodes=spare_nodes, restarts=max_restarts > 0,
        time=time_limit, partition=partition, account=account, signal_grace_s=signal_grace,
        output=f"{run_dir}.slurm-%j.out", workdir=os.getcwd(), run_args=tuple(run_args),
        dsforge=slurm.dsforge_words())
    script = slurm.sbatch_script(job, command_line=shlex.join(["dsforge", "sbatch", *sys.argv[2:]]))
    if out is None:
        show(script)
        return
    try:
        with open(out, "x") as f:
            f.write(script)
    except FileExistsError:
        raise BadOptions(f"{out} exists; remove it or give another --out") from None
    out.chmod(0o755)
    spares = f" and {spare_nodes} spare" if spare_nodes else ""
    say(f"dsforge: wrote {out} ({nodes} node{'s' if nodes > 1 else ''} x {world // nodes} "
        f"ranks{spares}, run directory {run_dir}); submit it with: sbatch {out}")


SBATCH_OPTIONS = (
    click.option("--nodes", type=click.IntRange(min=1), default=None,
                 help="Nodes to ask for [the recipe's cluster.nodes, else 1]."),
    click.option("--gpus-per-node", type=click.IntRange(min=0), default=None,
                 help="GPUs a node, one rank each; 0 for CPU ranks [the recipe's "
                      "cluster.gpus_per_node, else its world / nodes]."),
    click.option("--time", "time_limit", default=None, metavar="T",
                 help="Slurm's --time (minutes, HH:MM:SS, D-HH:MM:SS); also sets train.time_limit "
                      "to T less --signal-grace unless the recipe has one."),
    click.option("--partition", default=None, help="Slurm partition."),
    click.option("--account", default=None, help="Slurm account."),
    click.option("--signal-grace", type=click.IntRange(min=1), default=300, show_default=True,
                 help="Seconds before the time limit at which Slurm sends SIGTERM to the script, "
                      "which has the ranks save and stop."),
    click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="The job's run directory, the same for every requeue [runs/NAME-TIMESTAMP]."),
    click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Write the script here (it must not exist) instead of printing it."),
    MAX_RESTARTS,  # passed to the script's `dsforge run`
    SPARE_NODES,  # the script asks for them, and passes the option on
    click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
                 help="Override a recipe field (passed to dsforge run in the script). Repeatable."),
)


def sbatch_options(command):
    """`dsforge sbatch`'s options (cli.py), in the order its --help lists them."""
    for option in reversed(SBATCH_OPTIONS):
        command = option(command)
    return command
