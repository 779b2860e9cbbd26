"""`dsforge run`'s options, in the order its --help lists them (`--max-restarts` is also
`dsforge sbatch`'s, launch/sbatch.py), and `RunOptions`, which cli.py gathers them into.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from dsforge.job.run_dir import RunDir
from dsforge.job.word import JobSpec
from dsforge.launch.commands import job_spec
from dsforge.launch.local import STOP_GRACE_S
from dsforge.recipe import Resolved

# `dsforge run`'s, and `dsforge sbatch`'s for the `dsforge run` line of its script.
MAX_RESTARTS = click.option(
    "--max-restarts", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
    help="When a rank dies, hangs or loses its peers (NCCL, CUDA errors), start the job again "
         "from its last complete checkpoint, up to N times (in a Slurm job: srun again inside "
         "the allocation).")

# `dsforge run`'s, and `dsforge sbatch`'s, which asks Slurm for that many more nodes.
SPARE_NODES = click.option(
    "--spare-nodes", type=click.IntRange(min=0), default=0, show_default=True, metavar="S",
    help="Slurm nodes standing by for the restarts (with --max-restarts): the allocation's last "
         "S nodes; a restart puts one in place of a node left out (--exclude-after). "
         "`dsforge sbatch` asks for S more nodes.")

RUN_OPTIONS = (
    click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
                 help="Where metrics, the resolved recipe and checkpoints go "
                      "[default: runs/NAME-TIMESTAMP]."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                 show_default=True, help="auto = cuda when a GPU is visible, else cpu."),
    click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto",
                 show_default=True, help="auto = nccl on GPUs, gloo on CPU."),
    click.option("--step-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0,
                 show_default=True,
                 help="Seconds a step may take before its rank is declared stuck and the job ends."),
    click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Wall-clock limit for the whole job."),
    click.option("--stop-grace", type=click.FloatRange(min=0), default=300.0, show_default=True,
                 help="Seconds the ranks get to save a checkpoint and exit after SIGTERM or SIGUSR1 "
                      "before the job is stopped at once."),
    click.option("--resume", is_flag=True,
                 help="Continue the run in --run-dir from its latest complete checkpoint."),
    click.option("--resume-or-start", is_flag=True,
                 help="Continue the run in --run-dir from its latest complete checkpoint where it "
                      "has one; where it has none (a job that ended before its first checkpoint), "
                      "start it there from the beginning, what it wrote set aside in "
                      "RUN_DIR/attempts/. For a scheduler that starts the same command again "
                      "(a Slurm requeue: dsforge sbatch's script uses it)."),
    MAX_RESTARTS,
    click.option("--exclude-after", type=click.IntRange(min=1), default=None, metavar="K",
                 help="With --max-restarts, over --hostfile or in a Slurm allocation: leave a host "
                      "out of the restarts once it caused K failures, a spare (a `#spare HOST "
                      "slots=N` line's host, a --spare-nodes node) taking its place "
                      "[default: 1 for a device error, a host gone or a failed preflight; 2 for "
                      "others]."),
    SPARE_NODES,
    click.option("--launcher", type=click.Choice(["pdsh", "openmpi", "mvapich", "slurm"]),
                 default="pdsh", show_default=True,
                 help="With --hostfile: DeepSpeed's multi-node runner. slurm: start the ranks with "
                      "srun inside a Slurm allocation (salloc, or a script from `dsforge sbatch`)."),
    click.option("--include", default="", help="DeepSpeed --include: NODE[:SLOT,...][@NODE...]."),
    click.option("--exclude", default="", help="DeepSpeed --exclude, same format."),
    click.option("--no-ssh", "node_rank", type=click.IntRange(min=0), default=None,
                 metavar="NODE_RANK",
                 help="Start only this node's ranks, without ssh (run once per node)."),
    click.option("--master-addr", default=None, help="Address of the first node (multi-node)."),
    click.option("--master-port", type=click.IntRange(1, 65535), default=None,
                 help="Rendezvous port [default: free; 29500 with --no-ssh, so every node agrees]."),
    click.option("--dry-run", is_flag=True, help="Print the command lines and exit."),
    click.option("--tiny", is_flag=True,
                 help="Keep the recipe's layout, shrink model and batch to the smallest valid size, "
                      "train a few steps on CPU ranks and compare the loss with one rank's."),
    click.option("--skip-fit-check", is_flag=True,
                 help="Start even if the job's ranks or memory do not fit this machine, or it lacks "
                      "what the ranks build or run."),
    click.option("--verbose", is_flag=True,
                 help="Also show the engines' and the launcher's output (always in RUN_DIR/job.log)."),
    click.option("--profile", "profile_steps", metavar="A:B", default=None,
                 help="Write a torch profiler trace of steps A to B (0-based) of rank 0 to "
                      "RUN_DIR/profile; the same as --set tracking.profile=\"A:B\"."),
    click.option("--local_rank", type=int, default=None, hidden=True),
)


def run_options(command):
    """`dsforge run`'s options, applied to the click command."""
    for option in reversed(RUN_OPTIONS):
        command = option(command)
    return command


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
    resume_or_start: bool = False  # resume, or start over in the run directory (start.py)
    max_restarts: int = 0  # starts again after a lost rank (launch/restart.py)
    exclude_after: int | None = None  # failures before a host is left out (launch/host_pool.py)
    spare_nodes: int = 0  # the Slurm allocation's nodes that stand by for restarts
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
            from dsforge.launch.checks import profile_override

            overrides = (*overrides, profile_override(profile_steps))
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
