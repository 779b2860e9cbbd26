"""The planner's step time against the GPU kit's measured runs, phase by phase.

    python tools/kit_phases.py                                   # prints the table
    python tools/kit_phases.py --out benchmarks/search/kit_phases.md

Reads every run the GPU kit brought back (benchmarks/gpu/results/*/: each run's recipe as the
ranks resolved it, its median step time and its step breakdown from results.json; each
`dsforge bench` cell's result.json and metrics.jsonl) and sets beside each phase the share
of dsforge's predicted step time (dsforge/search/cost.py, the GPU's default profile) that
belongs to it. The model has one compute term; it is split by FLOPs here: forward = model
FLOPs / 3, backward = 2 x model / 3, recompute = hardware - model (docs/flops.md). This is
the measurement that issue 23's calibration starts from: which term misses, and by how much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsforge.estimate.flops import flops_per_token  # noqa: E402
from dsforge.hardware import gpu_for_device_name  # noqa: E402
from dsforge.recipe import resolve_file  # noqa: E402
from dsforge.search.cost import step_time  # noqa: E402
from dsforge.search.profile import default_profile  # noqa: E402

RESULTS = REPO / "benchmarks" / "gpu" / "results"
PHASES = ("forward", "backward", "recompute", "optimizer")


@dataclass(frozen=True)
class KitRun:
    folder: str  # the results folder, e.g. 2026-11-26-h200
    label: str
    recipe: Path
    device: str  # the GPU's name as torch reports it
    step_s: float
    phases: dict[str, float]  # seconds per step, the breakdown's medians


def kit_runs(results: Path = RESULTS) -> list[KitRun]:
    """Every finished run and bench cell under `results`, in folder order."""
    found = []
    for table in sorted(results.glob("*/*/results.json")):
        session = table.parent.parent
        data = json.loads(table.read_text())
        device = data["env"]["torch"]["device"] if data.get("env") else ""
        for run in data.get("runs") or []:
            if run.get("status") == "ok":
                recipe = next(session.glob(f"*/runs/{run['label']}/recipe.yaml"))
                found.append(KitRun(session.name, run["label"], recipe, device, run["step_s"],
                                    run["breakdown_s"]))
        for study in (data.get("studies") or {}):
            found += _cells(session, table.parent / "bench" / study, study, device)
    return found


def _cells(session: Path, study_dir: Path, study: str, device: str) -> list[KitRun]:
    cells = []
    for result in sorted(study_dir.glob("cells/*/repeat0/result.json")):
        row = json.loads(result.read_text())
        if row["status"] != "ok":
            continue
        lines = (result.parent / "metrics.jsonl").read_text().splitlines()
        steps = [s for s in map(json.loads, lines) if "step_time_s" in s and not s.get("warmup")]
        phases = {p: statistics.median(s["breakdown_s"][p] for s in steps) for p in PHASES}
        axes = " ".join(f"{k}={v}" for k, v in row["axes"].items())
        cells.append(KitRun(session.name, f"{study} {axes}", result.parent / "recipe.yaml", device,
                            statistics.median(s["step_time_s"] for s in steps), phases))
    return cells


def predicted_phases(run: KitRun) -> tuple[float, dict[str, float]]:
    """(predicted step seconds, predicted seconds per phase) on the GPU the run measured."""
    resolved = resolve_file(run.recipe, world_size=1)
    profile = default_profile(gpu_for_device_name(run.device).key, gpus_per_node=1)
    predicted = step_time(resolved, profile)
    m, t = resolved.recipe.model, resolved.recipe.train
    flops = flops_per_token(m, t.seq_len, t.activation_checkpointing)
    share = predicted.compute / flops.hardware
    return predicted.total, {"forward": share * flops.model / 3,
                             "backward": share * 2 * flops.model / 3,
                             "recompute": share * (flops.hardware - flops.model),
                             "optimizer": predicted.optimizer}


def table(runs: list[KitRun]) -> str:
    head = ("| folder | run | step s measured | predicted | error | "
            + " | ".join(f"{p} ms measured / predicted" for p in PHASES) + " |")
    lines = [head, "|" + "---|" * (5 + len(PHASES))]
    errors = []
    for run in runs:
        total, phases = predicted_phases(run)
        errors.append(total / run.step_s - 1)
        cells = " | ".join(f"{run.phases.get(p, 0) * 1e3:,.0f} / {phases[p] * 1e3:,.0f}"
                           for p in PHASES)
        lines.append(f"| {run.folder} | {run.label} | {run.step_s:.3f} | {total:.3f} | "
                     f"{errors[-1]:+.1%} | {cells} |")
    absolute = sorted(abs(e) for e in errors)
    lines.append("")
    lines.append(f"{len(runs)} runs: median |error| {statistics.median(absolute):.1%}, "
                 f"largest {absolute[-1]:.1%}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the table under a header to this file")
    args = parser.parse_args()
    text = table(kit_runs())
    if args.out is None:
        print(text, end="")
        return
    args.out.write_text(HEADER + text + FOOTER)
    print(f"wrote {args.out}")


HEADER = """# The planner against the GPU kit's runs, phase by phase

Written by `python tools/kit_phases.py --out benchmarks/search/kit_phases.md` from every run in
benchmarks/gpu/results/ (one H200, 2026-11-26). Measured: the median step and the median of
each phase of dsforge's step breakdown (docs/breakdown.md). Predicted: `dsforge plan`'s step
time (dsforge/search/cost.py with the GPU's default profile), its compute split by FLOPs
(forward = model / 3, backward = 2 model / 3, recompute = hardware - model).

"""
FOOTER = """
What the table says (issue 23 starts from here):
- **Optimizer**: measured since commit 89a52d2 (the profile's optimizer_bytes_per_param and
  optimizer_fixed_s: 8 ms + 109 bytes a parameter at the GPU's bandwidth, fitted to these
  runs). Before, 30 bytes at 80% of the bandwidth predicted it 3-4x too short (median |error|
  of the step 6.2%, now 4.1%).
- **Forward at micro-batch 1**: the 1B's forward takes 45-49 ms a microbatch at 4,096 tokens
  and 67 at 8,192: launched from Python, it cannot go below ~2.9 ms a layer. Its backward,
  launched by autograd's C++ engine, is linear in the tokens. A floor of 2.9 ms a layer alone
  turns the mb-1 runs' -9% to -19% into +6% to +12%: the backward is predicted too long.
- **Backward**: predicted longer than measured for the 1B (the model's GEMM rate, 62% x two
  saturation factors = 50-53% of peak at these shapes, is below the measured 72-75%); the
  terms it lacks (attention at its own rate, the non-GEMM work, Liger's fused cross-entropy
  doing the output layer's backward inside the forward) then cancel part of that.
- **ZeRO-3 on one GPU**: +452 ms in the forward and +416 ms in the recompute of the 1B (its
  per-module gathers), absent from the model: -39%.
- **Kernels**: torch's kernels cost the 1B 147 ms more backward than Liger's; the model does
  not know the kernels.
The compute terms cancel each other today; they have to be fitted together (issue 23).
"""

if __name__ == "__main__":
    main()
