"""Start the ranks of a job on this machine and wait for them: `dsforge run` without a
hostfile (a hostfile's hosts get theirs from DeepSpeed's runner, Slurm's from srun).

It does for one machine what DeepSpeed's per-node launcher (deepspeed/launcher/launch.py,
0.19.8) does, without what that costs each job: importing DeepSpeed twice (its runner, then
the launcher: 2-3 s before a rank starts) and a once-a-second poll (1-2 s after the last rank
ends). As DeepSpeed's launcher:
- each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE,
  MASTER_ADDR and MASTER_PORT, and `--local_rank=N` before its own arguments;
- when a rank fails, every other rank's process tree gets SIGTERM (SIGKILL what is left after
  30 s), the line "rank R (pid P) exits with return code = N" goes to the job's log
  (launch/diagnose.py reads it) and this process exits with that code;
- SIGINT or SIGTERM to this process ends every rank the same way (exit 1). dsforge sends the
  save-and-stop signals to the ranks themselves, never here (launch/local.py).
Unlike it, it leaves CUDA_VISIBLE_DEVICES as the user set it (DeepSpeed's sets 0..N-1 over
it): rank LOCAL_RANK takes the LOCAL_RANK-th visible GPU.

Run as `python -m dsforge.launch.node --nproc N [--master_addr A] --master_port P --module
PROGRAM ARGS...`; it imports nothing heavier than psutil.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.05
TERM_GRACE_S = 30.0  # as DeepSpeed's launcher waits before SIGKILL


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    print(f"dsforge launcher: starting {args.nproc} rank{'s' if args.nproc > 1 else ''} "
          f"(--master_addr={args.master_addr} --master_port={args.master_port})", flush=True)
    ranks: list[subprocess.Popen] = []

    def end_all(signum: int, _frame) -> None:
        _ignore_stops()  # a second signal must not cut the ending short
        _terminate(ranks)
        sys.exit(1)

    # before the first rank starts: a signal while they start ends the ones started
    signal.signal(signal.SIGINT, end_all)
    signal.signal(signal.SIGTERM, end_all)
    for rank in range(args.nproc):
        ranks.append(_start(rank, args))
    failed = _wait(ranks)
    if failed is not None:
        _ignore_stops()  # the failing rank's code is the exit code, whatever comes now
        rank, proc = failed
        print(f"dsforge launcher: rank {rank} (pid {proc.pid}) exits with return code = "
              f"{proc.returncode}; ending the other ranks", flush=True)
        _terminate(ranks)
        sys.exit(proc.returncode)


def _ignore_stops() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The launcher's options, up to `--module PROGRAM`; every word after PROGRAM is the
    rank program's."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m dsforge.launch.node")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, required=True)
    if "--module" not in argv[:-1]:
        parser.error("--module PROGRAM is required (the rank program, run as python -m)")
    at = argv.index("--module")
    args = parser.parse_args(argv[:at])
    args.module, args.program_args = argv[at + 1], argv[at + 2:]
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    return args


def _start(rank: int, args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
           "WORLD_SIZE": str(args.nproc), "LOCAL_SIZE": str(args.nproc), "CROSS_RANK": "0",
           "CROSS_SIZE": "1", "MASTER_ADDR": args.master_addr,
           "MASTER_PORT": str(args.master_port)}
    # what importing DeepSpeed set in its launcher, and so in every rank, before torch's first
    # CUDA check (deepspeed/__init__.py)
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    command = [sys.executable, "-u", "-m", args.module, f"--local_rank={rank}", *args.program_args]
    proc = subprocess.Popen(command, env=env)
    print(f"dsforge launcher: rank {rank} started (pid {proc.pid}): {shlex.join(command)}",
          flush=True)
    return proc


def _wait(ranks: list[subprocess.Popen]) -> tuple[int, subprocess.Popen] | None:
    """Until every rank has exited 0 (None), or one has not (that rank and its process)."""
    running = dict(enumerate(ranks))
    while running:
        for rank, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            if code != 0:
                return rank, proc
            del running[rank]
        time.sleep(POLL_S)
    return None


def _terminate(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM to every process this launcher started, ranks and what they started, found as
    its descendants (a rank forked while a signal came, before its Popen returned, is one);
    SIGKILL to what is left after TERM_GRACE_S."""
    procs = psutil.Process().children(recursive=True)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=TERM_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    for proc in ranks:
        proc.poll()  # reap


if __name__ == "__main__":
    main()
