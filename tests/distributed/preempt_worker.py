"""One rank of the preemption test's world (tests/distributed/test_preemption.py): legs of runs
trained in turn with the real Trainer and `train_loop` with its `Stopper`, in one world so the
imports are paid once. A leg may resume its run directory's latest checkpoint, and may have
one rank send a signal to itself at a chosen moment (`signal`: [rank, "step" | "eval" |
"save", step, name]): the other rank learns of it only through the per-step agreement.

Writes OUT/legs.json (rank 0): each leg's stop (steps done, reason) or null.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch


def main() -> None:
    from dsforge.runtime.guard.preempt import StopRequest

    warnings.filterwarnings("ignore")
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    request = StopRequest()
    request.install()
    results = []
    for leg in spec["legs"]:
        request.signum = None
        try:
            stopped = _run_leg(leg, spec, rank, request)
        except Exception:
            print(f"worker rank {rank} leg {leg} failed:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            os._exit(1)
        results.append(None if stopped is None else [stopped.steps_done, stopped.reason])
    if rank == 0:
        (Path(spec["out"]) / "legs.json").write_text(json.dumps(results))
    os._exit(0)


def _run_leg(leg: dict, spec: dict, rank: int, request):
    from megatron.core import parallel_state

    from dsforge.recipe import resolve_file
    from dsforge.runtime.guard.preempt import Stopper, TimeBudget
    from dsforge.runtime.loop.trainer import Trainer, train_loop

    started = time.time()
    resolved = resolve_file(spec["recipe"], leg["overrides"], world_size=int(os.environ["WORLD_SIZE"]))
    run_dir = Path(spec["out"]) / leg["run"]
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(resolved, device=torch.device("cpu"), backend="gloo", run_dir=run_dir,
                      collective_timeout_s=spec["timeout_s"], resume=leg["resume"])
    train = resolved.recipe.train
    budget = None if train.time_limit_s is None else TimeBudget(train.time_limit_s, started)
    drill = _Drill(leg.get("signal"), rank)
    stopped = train_loop(trainer, before_step=drill.before_step, save_fault=drill.while_saving,
                         stopper=Stopper(request, budget))
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    del trainer
    gc.collect()
    return stopped


class _Drill:
    def __init__(self, spec, rank: int):
        self.spec = spec if spec and spec[0] == rank else None
        self.calls = 0

    def _send(self) -> None:
        os.kill(os.getpid(), getattr(signal, self.spec[3]))
        self.spec = None

    def before_step(self, step: int) -> None:
        """Called when a step starts and before each of its validation batches."""
        if self.spec is None or step != self.spec[2]:
            return
        self.calls += 1
        if (self.spec[1], self.calls) in (("step", 1), ("eval", 2)):
            self._send()

    def while_saving(self, rank: int, steps_done: int) -> None:
        if self.spec is not None and self.spec[1] == "save" and steps_done == self.spec[2]:
            self._send()


if __name__ == "__main__":
    main()
