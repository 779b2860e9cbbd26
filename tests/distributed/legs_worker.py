"""One rank of a world that trains legs of runs in turn with the real Trainer and `train_loop`
with its `Stopper`, in one world so the imports are paid once (tests/distributed/
test_preemption.py, test_guard.py; `run_legs` starts the world). A leg may resume its run
directory's latest checkpoint; may have one rank send a signal to itself at a chosen moment
(`signal`: [rank, "step" | "eval" | "save", step, name]): the other rank learns of it only
through the per-step agreement; may run one of the rank's numeric drills (`fault`:
"KIND:RANK:STEP", runtime/guard/drills.py) as runtime/rank.py does; and may start as a copy
of an earlier leg's run directory (`copy_of`) that resumes one of its checkpoints (`latest`).

Writes OUT/legs.json (rank 0): each leg's end: null (it finished), [steps done, reason] (it
stopped on request) or {"halted": step, "kind": ..., "what": ...} (the training went bad).
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
        results.append(_outcome(stopped))
    if rank == 0:
        (Path(spec["out"]) / "legs.json").write_text(json.dumps(results))
    os._exit(0)


def _outcome(stopped):
    from dsforge.runtime.loop.bad_steps import Halted

    if isinstance(stopped, Halted):
        return {"halted": stopped.step, "kind": stopped.kind, "what": stopped.what}
    return None if stopped is None else [stopped.steps_done, stopped.reason]


def _run_leg(leg: dict, spec: dict, rank: int, request):
    from megatron.core import parallel_state

    from dsforge.job.run_dir import RunDir
    from dsforge.recipe import resolve_file
    from dsforge.runtime.guard.drills import NumericDrill
    from dsforge.runtime.guard.preempt import Stopper, TimeBudget
    from dsforge.runtime.loop.trainer import Trainer, train_loop
    from dsforge.runtime.guard.drills import parse_fault

    started = time.time()
    resolved = resolve_file(leg.get("recipe") or spec["recipe"], leg["overrides"],
                            world_size=int(os.environ["WORLD_SIZE"]))
    run_dir = RunDir(Path(spec["out"]) / leg["run"])
    if leg.get("copy_of"):
        _copy_run(Path(spec["out"]) / leg["copy_of"], run_dir, leg.get("latest"), rank)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(resolved, device=torch.device("cpu"), backend="gloo", run_dir=run_dir,
                      collective_timeout_s=spec["timeout_s"], resume=leg["resume"])
    train = resolved.recipe.train
    budget = None if train.time_limit_s is None else TimeBudget(train.time_limit_s, started)
    drill = _Drill(leg.get("signal"), rank)
    numeric = NumericDrill(parse_fault(leg.get("fault")), rank)
    numeric.attach(trainer.chunks)
    module = trainer.engine.module

    def before_step(step: int) -> None:
        drill.before_step(step)
        numeric.before_step(step)

    stopped = train_loop(trainer, before_step=before_step,
                         after_step=lambda step: numeric.after_step(step, module),
                         save_fault=drill.while_saving, stopper=Stopper(request, budget))
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    del trainer
    gc.collect()
    return stopped


def _copy_run(source: Path, run_dir, latest: str | None, rank: int) -> None:
    """The leg's run directory starts as a copy of another leg's, resuming checkpoint
    `latest` of it (an earlier one than the run's last): rank 0 copies, the others wait."""
    import shutil

    if rank == 0:
        partial = run_dir.path.with_name(run_dir.path.name + ".partial")
        shutil.copytree(source, partial)
        if latest:
            (partial / "checkpoints" / "latest").write_text(latest)
        partial.rename(run_dir.path)
    deadline = time.monotonic() + 60
    while not run_dir.path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_dir.path} was never copied from {source}")
        time.sleep(0.05)


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


def run_legs(out: Path, recipe: Path, legs: list[dict], timeout_s: float = 300) -> list:
    """Train `legs` (dicts: run, overrides, resume, and optionally signal, fault, recipe) in one
    world of 2 ranks; every leg's end, as legs.json holds them. Both ranks are killed on a
    failure or at the timeout (harness._wait)."""
    import subprocess

    from dsforge.launch.local import free_port
    from tests.conftest import REPO
    from tests.distributed.harness import _wait

    spec = {"recipe": str(recipe), "out": str(out), "timeout_s": 60, "legs": legs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.legs_worker", str(out / "spec.json")],
            env=env, stdout=open(out / f"rank{rank}.log", "wb"), stderr=subprocess.STDOUT,
            cwd=REPO, start_new_session=True))
    _wait(procs, timeout_s, out)  # kills both on failure or timeout
    return json.loads((out / "legs.json").read_text())


if __name__ == "__main__":
    main()
