"""The per-step stop agreement's cost (runtime/guard/preempt.py `Stopper.agree`: one all-reduce MAX
of two int64 over the world, then a host read), alone in a gloo world of N CPU ranks.

    python benchmarks/overhead/agreement.py --ranks 2 --calls 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, ranks: int, calls: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=ranks)
    from dsforge.runtime.guard.preempt import Stopper, StopRequest

    stopper = Stopper(StopRequest(), None)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        stopper.agree(1, next_evaluates=False)
        times.append(time.perf_counter() - start)
    torch.distributed.barrier()
    if rank == 0:
        measured = times[calls // 10:]
        out.put((statistics.median(measured), statistics.quantiles(measured, n=100)[98]))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    from dsforge.launch.local import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, args.calls, port, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    median, p99 = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"{args.ranks} gloo ranks, {args.calls} agreements: median {median * 1e6:.0f} us, "
          f"p99 {p99 * 1e6:.0f} us")


if __name__ == "__main__":
    main()
