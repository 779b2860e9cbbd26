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
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
STAGES = (0, 1, 2, 3)
IMPLS = ("fused", "deepspeed")  # train.adam_impl values
TINY_DIVISOR = 32


class _Layer(nn.Module):
    """Some of the model's parameters, held directly (ZeRO-3 gathers a module's own
    parameters when it is called); forward touches each."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        super().__init__()
        for index, shape in enumerate(shapes):
            self.register_parameter(f"w{index}", nn.Parameter(torch.randn(shape) * 0.02))

    def forward(self, total: torch.Tensor) -> torch.Tensor:
        for weight in self.parameters(recurse=False):
            total = total + weight.float().sum()
        return total


class ParameterModel(nn.Module):
    """The parameters of a transformer of `model`'s shapes, one module per layer."""

    def __init__(self, model, divisor: int = 1):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(shapes) for shapes in parameter_shapes(model, divisor))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=scale.device)
        for layer in self.layers:
            total = layer(total)
        return total * scale


def parameter_shapes(model, divisor: int = 1) -> list[list[tuple[int, ...]]]:
    """Per module: the embedding (and an untied output layer), each layer's four projections
    and two norms, the final norm, as dsforge's Llama-style GPT holds them."""
    h, ffn = model.hidden_size // divisor, model.ffn_hidden_size // divisor
    d = max(model.head_dim // divisor, 1)
    heads, groups, vocab = model.num_attention_heads, model.query_groups, max(model.vocab_size // divisor, 1)
    layer = [((heads + 2 * groups) * d, h), (h, heads * d), (2 * ffn, h), (h, ffn), (h,), (h,)]
    outer = [[(vocab, h)]] + ([] if model.tie_embeddings else [[(vocab, h)]])
    return outer + [list(layer) for _ in range(model.num_layers)] + [[(h,)]]


def resolve(recipe: str, stage: int, impl: str):
    """The recipe at `stage` with `impl`, one rank."""
    from dsforge.recipe import resolve_file

    return resolve_file(REPO / recipe, (f"zero.stage={stage}", f"train.adam_impl={impl}"),
                        world_size=1)


def engine_config(resolved, device: str) -> tuple[dict, object]:
    """dsforge's DeepSpeed config for the resolved recipe, one microbatch a step."""
    from dsforge.translate.deepspeed_config import deepspeed_config

    r = resolved.recipe
    config = deepspeed_config(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                              device=device)
    micro = resolved.layout.micro_batch
    config.update(train_batch_size=micro, train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=1)
    return config, r.model


def init_world(device: torch.device) -> None:
    """One rank of a world of one, as DeepSpeed's launcher would set it up."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device.type == "cpu":
        from dsforge.runtime.build.cpu_backend import skip_deepspeed_shm_allreduce

        skip_deepspeed_shm_allreduce()  # the CPU all-reduce op DeepSpeed would compile
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


def build_environment(resolved) -> dict[str, str]:
    """What a dsforge rank on a GPU sets before DeepSpeed builds the recipe's ops (nothing
    where no op is built or the list is readable already), and says so."""
    from dsforge.translate.build_env import arch_list_for_rank

    mapped, line = arch_list_for_rank(resolved, "cuda", os.environ)
    if line:
        print(line)
    return mapped


def timed_step(engine, device: torch.device) -> float:
    """Seconds of one engine.step() after a backward that filled every gradient."""
    scale = torch.full((), 1e-6, device=device)
    engine.backward(engine(scale))
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    engine.step()
    return time.perf_counter() - begin


def measure(recipe: str, stage: int, impl: str, device: torch.device, reps: int, divisor: int) -> dict:
    """One engine: its optimizer's name, the median step, the peak memory."""
    import deepspeed

    resolved = resolve(recipe, stage, impl)
    config, model = engine_config(resolved, device.type)
    if device.type == "cuda":
        os.environ.update(build_environment(resolved))
        torch.cuda.reset_peak_memory_stats(device)
    engine, _, _, _ = deepspeed.initialize(model=ParameterModel(model, divisor).to(device),
                                           config=config)
    try:
        timed_step(engine, device)  # warm-up: the optimizer's state is made on the first step
        seconds = [timed_step(engine, device) for _ in range(reps)]
        basic = engine.basic_optimizer
        fused = " (fused)" if basic.defaults.get("fused") else ""
        optimizer = f"{type(engine.optimizer).__name__} around {type(basic).__name__}{fused}"
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        engine.destroy()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"stage": stage, "impl": impl, "optimizer": optimizer, "step_s": statistics.median(seconds),
            "steps_s": seconds, "peak_memory_bytes": peak}


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
    sys.path.insert(0, str(REPO))
    sys.exit(main())
