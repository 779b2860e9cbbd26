"""The GPU tests' training runs: `dsforge run`s of the smoke recipe and the tiny MoE on one GPU,
started together once per session and shared by every test (skipped without a GPU).

A `dsforge run` on a GPU spends ~20-40 s starting (imports, NCCL, DeepSpeed's engine) and well
under a second on 30 steps of the smoke model, so the tests share runs, and the runs share
the GPU at the same time: they check losses and what was built, never speed. All use one
rank, the same seed and data order, and lr 3e-4: at the recipe's 3e-3 the loss spikes near
the end of the warm-up and two bf16 runs that differ only in rounding part by up to 5% a step
(measured on the CPU, flash against math attention, 30 steps); at 3e-4 the same pair agrees
within 2e-5 at every step while the loss still falls from ~6.0 to ~4.8. So a gap between two
runs here is the kernels' or the precision's, not the training's chaos.

  default  bf16, model.kernels and train.adam_impl auto: what a user's GPU run gets
           (Liger's kernels where liger-kernel is installed, torch's fused AdamW)
  torch    bf16, model.kernels torch: the plain path
  fp32     fp32, model.kernels torch: the plain path in full precision
  moe_sequential, moe_grouped
           recipes/tiny_moe.yaml on the same text at ep 1 in bf16, its experts Megatron's
           SequentialMLP or dsforge's grouped ones (model.moe.experts)
  drill_device, drill_nan
           the default run with a checkpoint every 5 steps and a drill
           (runtime/guard/drills.py) in step 10: a real device-side assert with
           --max-restarts 1, and a NaN loss

Each run gets its own empty TORCH_EXTENSIONS_DIR, so a DeepSpeed op built at run time would
show there. The GPU kit (benchmarks/gpu/kit_results.py) reads the runs' metrics from
gpu-runs/NAME under pytest's base folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dsforge.job.metrics_file import read_metrics
from tests.conftest import REPO

STEPS = 30
LR = 3e-4
SMOKE, TINY_MOE = REPO / "recipes" / "smoke.yaml", REPO / "recipes" / "tiny_moe.yaml"
MOE_ON_TEXT = ("train.precision=bf16", "parallel.ep=1", f"data.source={REPO / 'data' / 'tempest'}",
               "model.vocab_size=257", "data.split=90,5,5")
RUNS = {  # name -> (recipe, --set overrides)
    "default": (SMOKE, ("train.precision=bf16",)),
    "torch": (SMOKE, ("train.precision=bf16", "model.kernels=torch")),
    "fp32": (SMOKE, ("train.precision=fp32", "model.kernels=torch")),
    "moe_sequential": (TINY_MOE, (*MOE_ON_TEXT, "model.moe.experts=sequential")),
    "moe_grouped": (TINY_MOE, (*MOE_ON_TEXT, "model.moe.experts=grouped")),
}
# name -> (DSFORGE_INJECT_FAULT, more `dsforge run` options): runs of the default recipe that
# fail on purpose (tests/gpu/test_gpu_failures.py)
DRILLS = {"drill_device": ("device:0:10", ("--max-restarts", "1")), "drill_nan": ("nan:0:10", ())}
RUNS.update({name: (SMOKE, ("train.precision=bf16", "train.checkpoint_every=5"))
             for name in DRILLS})
RUNS_FOLDER = "gpu-runs"  # under pytest's base folder; the kit's table reads it
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class GpuRun:
    name: str
    run_dir: Path
    extensions_dir: Path  # TORCH_EXTENSIONS_DIR the run had: empty unless it built an op
    returncode: int
    output: str  # dsforge's stdout and stderr

    def losses(self) -> list[float]:
        assert self.returncode == 0, f"the {self.name} run failed:\n{self.output[-3000:]}"
        records, _ = read_metrics(self.run_dir / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(STEPS))
        return [r["loss"] for r in records]


def _command(name: str, run_dir: Path) -> list[str]:
    recipe, overrides = RUNS[name]
    sets = [word for item in (*overrides, "parallel.dp=1", f"train.steps={STEPS}",
                              f"train.lr={LR}") for word in ("--set", item)]
    options = DRILLS[name][1] if name in DRILLS else ()
    return [sys.executable, "-m", "dsforge", "run", str(recipe), *sets, *options,
            "--run-dir", str(run_dir)]


def _start(name: str, folder: Path) -> tuple[subprocess.Popen, GpuRun]:
    run_dir, extensions = folder / name, folder / f"{name}-torch-extensions"
    extensions.mkdir(parents=True)
    log = (folder / f"{name}.out").open("w")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    if name in DRILLS:
        env["DSFORGE_INJECT_FAULT"] = DRILLS[name][0]
    proc = subprocess.Popen(_command(name, run_dir), cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, GpuRun(name=name, run_dir=run_dir, extensions_dir=extensions, returncode=-1,
                        output="")


def _finish(proc: subprocess.Popen, run: GpuRun, folder: Path) -> GpuRun:
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # dsforge stops its job on SIGTERM
        code = proc.wait(timeout=60)
    output = (folder / f"{run.name}.out").read_text(errors="replace")
    return GpuRun(name=run.name, run_dir=run.run_dir, extensions_dir=run.extensions_dir,
                  returncode=code, output=output)


@pytest.fixture(scope="session")
def gpu_runs(tmp_path_factory) -> dict[str, GpuRun]:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    folder = tmp_path_factory.getbasetemp() / RUNS_FOLDER
    started = {name: _start(name, folder) for name in RUNS}
    return {name: _finish(proc, run, folder) for name, (proc, run) in started.items()}
