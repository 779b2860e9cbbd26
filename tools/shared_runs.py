"""Issue 23's first target: the four H200 runs of ../shared/reference/gpu-h200-2026-11-26,
each predicted by a profile calibrated on that session's GEMM table and the other three runs.

    python tools/shared_runs.py

The runs (that folder's README): Llama-2 7B at ZeRO-3 with full checkpointing, 8 sequences,
micro-batch 1 and 2; the kit's 1B with full checkpointing at micro-batch 2, 16 sequences, ZeRO-0
and ZeRO-1. They ran before Liger's kernels and torch's fused AdamW were dsforge's defaults on
GPUs, so each recipe is set to the kernels and optimizer they ran with (torch's kernels,
DeepSpeed's FusedAdam). Measured: the median step of each 7B run's metrics after its warm-up,
and the 1B study's medians from its report.

The profile: the H200's default with `compute_efficiency` set so that the cost model's GEMM
rate at each model's shapes is the rate gemm.json measured there (the mean of the two models'
figures; gemm.json times one token count a model, so the knee keeps its default). It keeps
the H200's host floors, which the GPU kit's own runs measured (cost/profile.py; they
include the same 7B layout with Liger's kernels and torch's AdamW, not these runs). Then
dsforge's own refit on a GPU (`dsforge plan --search --measure`, cost/fit.py) on
every three runs predicts the fourth. The target is within 5% each. The second table is the
same without the kit's floors: what three runs alone can tell.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsforge.cost.fit import Point, calibrate  # noqa: E402
from dsforge.cost.profile import default_profile  # noqa: E402
from dsforge.cost.step_time import modelled_gemm_rate  # noqa: E402
from dsforge.recipe import resolve_file  # noqa: E402

SHARED = REPO.parent / "shared" / "reference" / "gpu-h200-2026-11-26"
AS_RUN = ["model.kernels=torch", "train.adam_impl=deepspeed", "train.activation_checkpointing=full"]
SEVEN_B = ["zero.stage=3", "train.global_batch=8", *AS_RUN]
ONE_B = ["train.micro_batch=2", "train.global_batch=16", *AS_RUN]
SEVEN_B_RECIPE, ONE_B_RECIPE = "recipes/7b_1gpu.yaml", "benchmarks/gpu/recipes/1b_1gpu.yaml"
RUNS = (  # label, recipe, overrides, where its measurement is
    ("7b ZeRO-3 full mb1", SEVEN_B_RECIPE, [*SEVEN_B, "train.micro_batch=1"],
     "7b-mb1-metrics.jsonl"),
    ("7b ZeRO-3 full mb2", SEVEN_B_RECIPE, [*SEVEN_B, "train.micro_batch=2"],
     "7b-mb2-metrics.jsonl"),
    ("1b ZeRO-0 full mb2", ONE_B_RECIPE, [*ONE_B, "zero.stage=0"], "zero-1b-report.md 0"),
    ("1b ZeRO-1 full mb2", ONE_B_RECIPE, [*ONE_B, "zero.stage=1"], "zero-1b-report.md 1"),
)


def measured_step(source: str) -> float:
    """Seconds: a metrics file's median step after warm-up, or a bench report row's median."""
    name, _, stage = source.partition(" ")
    text = (SHARED / name).read_text()
    if name.endswith(".jsonl"):
        steps = [json.loads(line) for line in text.splitlines() if line.strip()]
        return statistics.median(s["step_time_s"] for s in steps
                                 if "step_time_s" in s and not s["warmup"])
    row = re.search(rf"^\| {stage} \| ok \| [^|]+\| [^|]+\| ([0-9.]+) ", text, re.MULTILINE)
    return float(row.group(1)) / 1e3


def gemm_profile(resolved_by_recipe: dict):
    """The H200's default profile, its compute efficiency from gemm.json's measured rates."""
    gemm = json.loads((SHARED / "gemm.json").read_text())
    profile = default_profile("h200", gpus_per_node=1)
    efficiencies = []
    for entry in gemm["models"]:
        resolved = resolved_by_recipe.get(entry["recipe"])
        if resolved is None:
            continue  # the 3B: none of the four runs
        micro_batch = entry["tokens"] // resolved.recipe.train.seq_len  # the shape gemm.json timed
        resolved = dataclasses.replace(
            resolved, layout=dataclasses.replace(resolved.layout, micro_batch=micro_batch))
        modelled = modelled_gemm_rate(resolved, profile, profile.compute_efficiency)
        efficiencies.append(profile.compute_efficiency * entry["tflops"] * 1e12 / modelled)
    return dataclasses.replace(profile, compute_efficiency=min(1.0, statistics.fmean(efficiencies)),
                               measured_on="NVIDIA H200, gemm.json of 2026-11-26")


def left_out(include_gpu_floors: bool = True):
    """(the GEMM table's profile, the calibration: each run predicted from the other three)."""
    resolved = {label: resolve_file(REPO / recipe, overrides, world_size=1)
                for label, recipe, overrides, _ in RUNS}
    first_of = {recipe: resolved[label] for label, recipe, _, _ in reversed(RUNS)}
    profile = gemm_profile(first_of)
    if not include_gpu_floors:
        profile = dataclasses.replace(profile, host_layer_s=0.0, host_layer_zero3_s=0.0)
    points = [Point(label, resolved[label], measured_step(source)) for label, _, _, source in RUNS]
    return profile, calibrate(points, profile, measured_on="the four shared H200 runs",
                              host_floors=True)


def main() -> None:
    if not SHARED.is_dir():
        sys.exit(f"needs {SHARED} (the shared folder beside the repository)")
    for floors in (True, False):
        profile, result = left_out(floors)
        print(f"\ncompute_efficiency from gemm.json: {profile.compute_efficiency:.3f} (the H200's "
              f"default {default_profile('h200').compute_efficiency}); host floors "
              f"{profile.host_layer_s * 1e3:.2f} ms and {profile.host_layer_zero3_s * 1e3:.2f} ms "
              "at ZeRO-3" + (" (the H200's, from the GPU kit's runs)" if floors else ""))
        print("| run | measured s | GEMM profile s | refit on the other three s | error |")
        print("|---|---|---|---|---|")
        for row in result.rows:
            print(f"| {row.label} | {row.measured_s:.3f} | {row.before_s:.3f} | "
                  f"{row.left_out_s:.3f} | {row.left_out_s / row.measured_s - 1:+.1%} |")


if __name__ == "__main__":
    main()
