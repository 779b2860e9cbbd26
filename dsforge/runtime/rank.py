"""The program each rank runs: `python -m dsforge.runtime.rank --job WORD`.

WORD (dsforge/job/word.py) holds the resolved recipe, the run directory, the options and
the forwarded environment. Every rank writes the recipe to RUN_DIR/recipe.yaml on its own node,
re-resolves it against WORLD_SIZE (pure and deterministic, so all ranks agree) and trains. The
order in which parallelism is applied is written once, in dsforge/runtime/assemble/engine.py's
`build_rank`; the training loop is trainer.py's `train_loop`.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from dsforge.job import failure
from dsforge.job.console import RankConsole
from dsforge.job.hosts import HOSTS_ENV
from dsforge.job.pids import write_pid
from dsforge.job.run_dir import RunDir
from dsforge.job.word import JobSpec, check_names
from dsforge.recipe import resolve_file
from dsforge.runtime.assemble.build_locks import clear_stale_locks
from dsforge.runtime.guard.drills import (FAULT_ENV, NumericDrill, StopDrill, host_down,
                                          inject_fault, parse_fault, passing_fault, save_fault)
from dsforge.runtime.guard.preempt import Stopped, StopRequest
from dsforge.runtime.guard.record import record_for
from dsforge.runtime.guard.supervise import run_supervised
from dsforge.runtime.guard.watchdog import Watchdog
from dsforge.runtime.startup import StartupClock

if TYPE_CHECKING:  # torch is imported in _train, once the rank runs under its supervisor
    import torch

    from dsforge.runtime.loop.bad_steps import Halted


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsforge.runtime.rank")
    parser.add_argument("--job", required=True, help="the job word made by dsforge run")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def pick_device(choice: str, backend: str) -> tuple["torch.device", str]:
    import torch

    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    return device, backend


def threads_per_rank(environ=os.environ) -> int | None:
    """Intra-op threads for each of this node's ranks: the CPUs divided among them.

    torch starts as many threads as there are CPUs in every process; with several ranks per
    node they oversubscribe the cores, and OpenMP threads spinning while gloo waits made ZeRO-0
    steps 6x slower on a 2-core machine (benchmarks/README.md). torchrun sets 1 for the same
    reason; DeepSpeed only with --bind_cores_to_rank. None = the user chose (OMP_NUM_THREADS).
    """
    if environ.get("OMP_NUM_THREADS"):
        return None
    local_ranks = max(1, int(environ.get("LOCAL_SIZE", 1)))
    return max(1, len(os.sched_getaffinity(0)) // local_ranks)


def main(argv=None) -> None:
    job = JobSpec.decode(parse_args(argv).job)
    if job.slurm:
        from dsforge.job.slurm_env import rank_env

        os.environ.update(rank_env(os.environ))
    if HOSTS_ENV in job.env:  # the supervisor's failure records name the host too (job/failure.py)
        os.environ[HOSTS_ENV] = job.env[HOSTS_ENV]
    run_supervised(lambda: run_rank(job), run_dir=job.directory,
                   rank=int(os.environ.get("RANK", 0)), forward=not job.slurm, owner=job.owner)


def run_rank(job: JobSpec) -> None:
    """Train this rank's part of the job; never returns (exit code 0, or 1 with the error).
    Its supervisor watches the job's owner from before this starts (runtime/guard/supervise.py):
    with many ranks on a few cores the imports take minutes, and an orphaned job must not wait
    for them."""
    # Before anything else: SIGTERM / SIGUSR1 ask for a checkpoint and a stop (preempt.py),
    # and `dsforge run` signals the ranks whose pid file exists.
    stop_request = StopRequest()
    stop_request.install()
    startup = StartupClock(launched_at=job.launched_at or job.started_at)
    check_names(job.env)
    os.environ.update(job.env)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    rank = int(os.environ.get("RANK", 0))
    # `kill -USR2` on a rank prints every thread's Python stack without stopping it.
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    console = RankConsole(marked=job.marked_output)
    write_pid(job.directory, rank, socket.gethostname(), os.getpid())
    progress = {"step": -1}
    try:
        stopped = _train(job, rank, progress, console, stop_request, startup)
    except Exception as exc:
        _report_failure(job, rank, progress["step"], exc, console)
        # Skip interpreter teardown: process-group destructors can block on dead peers.
        os._exit(1)
    from dsforge.runtime.loop.bad_steps import Halted  # loaded by _train

    # Exit 0 when the ranks stopped together: a non-zero code would make the launcher SIGTERM
    # this node's ranks; `dsforge run` gives the job's exit code.
    if isinstance(stopped, Halted):
        console.halted(rank, stopped.step, stopped.what)
    elif stopped is not None:
        console.stopped(rank, stopped.steps_done, stopped.reason, saved=stopped.saved)
    else:
        console.done(rank)  # `dsforge run` counts these: success means every rank got here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report_failure(job: JobSpec, rank: int, step: int, exc: Exception,
                    console: RankConsole) -> None:
    """The failure record, one line for the user, the whole traceback for the log (stderr,
    which `dsforge run` writes to RUN_DIR/job.log)."""
    detail = traceback.format_exc()
    record = record_for(exc, rank=rank, step=step, detail=detail)
    failure.write(job.directory, record)
    console.say(f"dsforge: {record.headline()}")
    print(f"dsforge: {record.headline()}\n{detail}", file=sys.stderr, flush=True)


def _train(job: JobSpec, rank: int, progress: dict, console: RankConsole,
           stop_request: StopRequest, startup: StartupClock) -> Stopped | Halted | None:
    import torch

    from dsforge.job.heartbeat import Heartbeat
    from dsforge.runtime.guard.preempt import Stopper, TimeBudget
    from dsforge.runtime.loop.trainer import Trainer, train_loop

    threads = threads_per_rank()
    if threads is not None:
        torch.set_num_threads(threads)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        # Before the process group forms, so no rank of this job is building an op yet.
        clear_stale_locks(log=console.say)
    run_dir = job.directory
    resolved = resolve_file(_write_recipe(run_dir, job.recipe_yaml, rank),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    device, backend = pick_device(job.device, job.backend)
    _readable_arch_list(resolved, device.type, rank, console)
    watchdog = Watchdog(job.step_timeout_s, rank, run_dir=run_dir, console=console)
    startup.mark("setup")
    trainer = Trainer(resolved, device=device, backend=backend, run_dir=run_dir,
                      collective_timeout_s=job.step_timeout_s, resume=job.resume,
                      census=job.census, console=console, startup=startup,
                      restarts=job.restarts)
    fault = parse_fault(os.environ.get(FAULT_ENV))
    stop_drill = StopDrill(fault, rank, job.owner, stop_request)
    numeric_drill = NumericDrill(fault, rank)
    numeric_drill.attach(trainer.chunks)
    heartbeat = Heartbeat(run_dir, rank)
    train = resolved.recipe.train
    budget = None if train.time_limit_s is None else TimeBudget(
        train.time_limit_s, job.started_at, eval_iters=train.eval_iters)

    def before_step(step: int) -> None:
        progress["step"] = step
        watchdog.arm(step)
        heartbeat.beat(step)
        inject_fault(fault, rank, step)
        host_down(fault, rank, step, run_dir)
        passing_fault(fault, rank, step, run_dir, device)
        stop_drill.before(step)
        numeric_drill.before_step(step)

    try:
        return train_loop(trainer, before_step=before_step,
                          after_step=lambda s: numeric_drill.after_step(s, trainer.engine.module),
                          after_steps=watchdog.disarm,
                          save_fault=save_fault(fault, job.owner, stop_request),
                          stopper=Stopper(stop_request, budget, device=device))
    finally:  # the step a failing rank was on, even when it fails within the write interval
        heartbeat.flush()


def _readable_arch_list(resolved, device: str, rank: int, console: RankConsole) -> None:
    """Before DeepSpeed builds an op on this rank: a TORCH_CUDA_ARCH_LIST it can parse
    ("9.0a" -> "9.0", translate/build_env.py), said once by rank 0."""
    from dsforge.translate.build_env import arch_list_for_rank

    mapped, line = arch_list_for_rank(resolved, device, os.environ)
    os.environ.update(mapped)
    if line and rank == 0:
        console.say(line)


def _write_recipe(run_dir: RunDir, text: str, rank: int) -> Path:
    """RUN_DIR/recipe.yaml on this node (ranks of one node write the same text, atomically)."""
    run_dir.path.mkdir(parents=True, exist_ok=True)
    path = run_dir.recipe
    partial = run_dir.path / f".recipe.yaml.rank{rank}"
    partial.write_text(text)
    os.replace(partial, path)
    return path


if __name__ == "__main__":
    main()
