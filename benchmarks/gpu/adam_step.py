"""The optimizer step alone: torch's fused AdamW against DeepSpeed's FusedAdam, per ZeRO stage.

For each ZeRO stage (0-3) and each `train.adam_impl` ("fused": torch.optim.AdamW(fused=True),
dsforge's default on GPUs; "deepspeed": DeepSpeed's FusedAdam, JIT-built on its first use,
~60 s measured on 2026-11-26), DeepSpeed's engine is built from the config dsforge translates
for the recipe (dsforge.translate.deepspeed_config: the same optimizer section, the same
wrapper DeepSpeed then puts around it, e.g. FP16_UnfusedOptimizer at ZeRO-0 in bf16) around
parameters of the recipe's model's shapes. No Megatron model: the step sees only parameters and
their gradients, so a cheap forward (each parameter summed) fills every gradient. With one
microbatch a step, `engine.step()` is timed (CUDA events on a GPU, median of --reps after one
warm-up step) with the peak memory. Issue 21 asks that torch's step be no slower than
FusedAdam's at every stage. Engines are built, timed and freed one at a time in this process
(one rank); FusedAdam's go last, after its build, in the environment a dsforge rank gives
DeepSpeed's build (TORCH_CUDA_ARCH_LIST mapped by dsforge.translate.build_env, as
dsforge/runtime/rank.py does: on 2026-11-26 the script built FusedAdam without it and every
engine died on the image's "9.0a").

    python benchmarks/gpu/adam_step.py --recipe benchmarks/gpu/recipes/1b_1gpu.yaml --gpu h200 --out adam.json

--cpu-tiny (no GPU) runs torch's AdamW only, on the CPU with gloo, every width divided by 32:
it checks the code, not the hardware.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the working tree's dsforge first, as run.sh sets it

from dsforge.calibrate.optimizer_timing import init_world, parameter_shapes, time_optimizer  # noqa: E402
STAGES = (0, 1, 2, 3)
IMPLS = ("fused", "deepspeed")  # train.adam_impl values
TINY_DIVISOR = 32


def resolve(recipe: str, stage: int, impl: str):
    """The recipe at `stage` with `impl`, one rank."""
    from dsforge.recipe import resolve_file

    return resolve_file(REPO / recipe, (f"zero.stage={stage}", f"train.adam_impl={impl}"),
                        world_size=1)


def measure(recipe: str, stage: int, impl: str, device: torch.device, reps: int, divisor: int) -> dict:
    """One engine: its optimizer's name, the median step, the peak memory."""
    return {"stage": stage, "impl": impl,
            **time_optimizer(resolve(recipe, stage, impl), device, reps, divisor)}


def run(recipe: str, gpu: str | None, *, tiny: bool, reps: int) -> dict:
    """Every stage with each implementation the device has; a failure is recorded, not raised."""
    from dsforge.recipe import resolve_file

    device = torch.device("cpu" if tiny else "cuda")
    divisor = TINY_DIVISOR if tiny else 1
    init_world(device)
    impls = ("fused",) if tiny else IMPLS  # DeepSpeed's FusedAdam is a CUDA op
    results = []
    for impl in impls:  # torch's first: FusedAdam's build comes after them
        for stage in STAGES:
            try:
                results.append(measure(recipe, stage, impl, device, reps, divisor))
            except Exception as exc:  # one engine that cannot be built is the finding
                results.append({"stage": stage, "impl": impl, "error": f"{type(exc).__name__}: {exc}"[:300]})
    r = resolve_file(REPO / recipe, world_size=1).recipe
    count = sum(torch.Size(s).numel() for shapes in parameter_shapes(r.model, divisor) for s in shapes)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "gpu": gpu, "recipe": recipe, "parameters": count, "tiny": tiny, "reps": reps,
            "dtype": r.train.precision, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="relative to the repository root")
    parser.add_argument("--gpu", help="dsforge GPU key, recorded")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-tiny", action="store_true", help="CPU, torch's AdamW, tiny shapes")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if not args.cpu_tiny and not torch.cuda.is_available():
        print("adam_step.py: no GPU visible; use --cpu-tiny to check the code on the CPU",
              file=sys.stderr)
        return 2
    result = run(args.recipe, args.gpu, tiny=args.cpu_tiny, reps=args.reps)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in result["results"]:
        figure = f"{r['step_s'] * 1e3:.1f} ms ({r['optimizer']})" if "step_s" in r else r["error"]
        print(f"ZeRO-{r['stage']} {r['impl']}: {figure}")
    return 1 if any("error" in r for r in result["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
