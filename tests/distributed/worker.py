"""One rank of a shared test world: trains several layouts in turn with the real Trainer and
the rank's own loop (`train_loop`, without the launched rank's watchdog, heartbeat and faults).

Started by tests/distributed/harness.py with RANK/WORLD_SIZE/MASTER_* set, as a launcher
would. Sharing the world across layouts pays the process start and imports once.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import traceback
import warnings
from pathlib import Path

import torch


def main() -> None:
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    for case in spec["cases"]:
        try:
            _run_case(case, spec)
        except Exception:
            print(f"worker rank {rank} case {case['name']} failed:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            os._exit(1)
    os._exit(0)


def _stopped_after(root: Path, step: int) -> None:
    """The checkpoints as a run that stopped after `step` left them: the later ones removed,
    `latest` naming that step's."""
    from dsforge.ckpt.format import LATEST
    from dsforge.ckpt.trust import tag_for

    for later in root.glob("step*"):
        if int(later.name[len("step"):]) > step:
            shutil.rmtree(later)
    (root / LATEST).write_text(tag_for(step))


def _run_case(case: dict, spec: dict) -> None:
    from megatron.core import parallel_state

    from dsforge.job.run_dir import RunDir
    from dsforge.recipe import resolve_file
    from dsforge.runtime.loop.trainer import Trainer, train_loop

    recipe = case.get("recipe") or spec["recipe"]
    resolved = resolve_file(recipe, case["overrides"], world_size=int(os.environ["WORLD_SIZE"]))
    run_dir = RunDir(Path(spec["out"]) / case["name"])
    # resume_from: a case trained earlier in this world (so the process group exists); its
    # checkpoints are copied, then this case resumes from them on its own layout.
    resume_from = case.get("resume_from")
    if resume_from and int(os.environ["RANK"]) == 0:
        shutil.copytree(RunDir(Path(spec["out"]) / resume_from).checkpoints, run_dir.checkpoints)
        if case.get("resume_step") is not None:
            _stopped_after(run_dir.checkpoints, case["resume_step"])
    run_dir.path.mkdir(parents=True, exist_ok=True)
    if resume_from:
        torch.distributed.barrier()
    trainer = Trainer(resolved, device=torch.device("cpu"), backend="gloo", run_dir=run_dir,
                      collective_timeout_s=spec["timeout_s"], resume=bool(resume_from))
    train_loop(trainer)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    # Megatron keeps the MoE aux-loss scale at class level; a fresh process starts without it.
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    del trainer
    gc.collect()


if __name__ == "__main__":
    main()
