"""The kit's markdown table, rendered from what kit_results.collect gathered (a GPU command's
results, or the dry run's invented ones).

MFU is shown twice with the same peak (dsforge's device table): by dsforge's formula
(docs/flops.md) and by KempnerForge's (kit_results.kempnerforge_flops_per_token).
"""

from __future__ import annotations

import time
from pathlib import Path

from dsforge.job.metrics_file import PHASES
from dsforge.units import GiB
import kit_peers
from kit_format import num as _num
from kit_format import pct
from kit_plan import MEASUREMENTS, PREDICTED_SPEEDUP
from kit_results import KERNEL_ATOL, KERNEL_RTOL, PRECISION_TOLERANCE, shape
from kit_steps import CALIBRATED, CALIBRATED_MOE, LOOP_TOP


def _gib(value) -> str:
    return f"{value / GiB:.1f}" if value is not None else "-"


def _pct(value) -> str:
    return pct(value, missing="n/a")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def render(result: dict, *, fake: bool = False) -> str:
    sections = [_render_head(result, fake), _render_steps(result), _render_correctness(result),
                _render_runs(result), _render_evidence(result), kit_peers.render(result["peers"]),
                _render_speedups(result), _render_fp8_loss(result),
                _render_breakdown(result),
                _render_startup(result),
                _render_gemm(result),
                _render_adam(result), _render_profile(result), _render_loop(result),
                _render_studies(result)]
    return "\n\n".join(s for s in sections if s) + "\n"


def _render_head(result: dict, fake: bool) -> str:
    env = result.get("env") or {}
    device = (env.get("torch") or {}).get("device") or "no GPU"
    lines = [f"## dsforge GPU kit: {device} (planned as {result['gpu']}), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    if result.get("command"):
        lines.append(f"Command: `{result['command']}`")
    versions = _versions(env)
    if versions:
        lines.append(f"Versions: {versions}")
    if fake:
        lines.append("FAKE INPUTS (dry run on CPU): every run, test and study figure below is "
                     "invented to exercise the table; the GEMM line was measured on the CPU at "
                     "tiny shapes. Nothing here is a GPU measurement.")
    return "\n".join(lines)


def _versions(env: dict) -> str:
    """The versions env.json (probe_env.py) recorded, on one line."""
    torch_facts, packages = env.get("torch") or {}, env.get("packages") or {}
    if not torch_facts:
        return ""
    parts = [f"python {(env.get('host') or {}).get('python')}",
             f"torch {torch_facts.get('version')} (CUDA {torch_facts.get('cuda')}, cuDNN "
             f"{torch_facts.get('cudnn')}, NCCL {torch_facts.get('nccl')})"]
    parts += [f"{name} {facts.get('version')}" for name, facts in packages.items()
              if facts.get("version")]
    kernels = env.get("kernels_auto")
    if kernels:
        parts.append(f"model.kernels auto -> {kernels['impl']}")
    return ", ".join(parts)


def _render_steps(result: dict) -> str:
    lines = ["| step | status | seconds | estimated | note |", "|---|---|---:|---:|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['name']} | {s.get('status', 'not run')} | {_num(s.get('seconds'), '.0f')} "
                     f"| {_num(s.get('expected_s'), '.0f')} | {s.get('note') or ''} |")
    return "### Steps\n" + "\n".join(lines)


def _render_correctness(result: dict) -> str:
    lines = []
    tests = result.get("gpu_tests")
    if tests:
        c = tests["counts"]
        lines.append(f"- tests/gpu: {c['passed']} passed, {c['failure'] + c['error']} failed, "
                     f"{c['skipped']} skipped")
    p = result.get("precision")
    if p:
        verdict = "within" if p["within_tolerance"] else "OUTSIDE"
        lines.append(f"- bf16 vs fp32 (smoke recipe, dp 1, {p['steps']} steps, loss from "
                     f"{p['first_loss']:.3f}): last-10 mean fp32 {p['fp32_tail']:.4f}, bf16 "
                     f"{p['bf16_tail']:.4f} ({p['relative_difference']:+.2%}, {verdict} "
                     f"{PRECISION_TOLERANCE:.0%}); largest per-step gap {p['max_step_difference']:.4f}")
    k = result.get("kernels")
    if k:
        verdict = "within" if k["within_tolerance"] else "OUTSIDE"
        lines.append(f"- Liger's kernels (default run) vs torch's, bf16, {k['steps']} steps, loss from "
                     f"{k['first_loss']:.3f} to {k['last_fused']:.4f} / {k['last_plain']:.4f}: largest "
                     f"gap {k['max_relative_gap']:.2%} at step {k['at_step']} ({verdict} "
                     f"{KERNEL_RTOL:.0%} + {KERNEL_ATOL:g})")
    return "### Correctness\n" + "\n".join(lines) if lines else ""


def _render_runs(result: dict) -> str:
    if not result["runs"]:
        return ""
    lines = ["| run | status | s/step | tok/s/GPU | MFU dsforge | MFU 6P+12LDS | HFU | predicted GiB "
             "| allocated GiB | nvidia-smi GiB | allocated/predicted |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        status = r["status"] if r["status"] != "skipped" else f"skipped: {r['note']}"
        lines.append(f"| {r['label']} | {status} | {_num(r.get('step_s'), '.2f')} "
                     f"| {_num(r.get('tokens_per_s_per_gpu'))} | {_pct(r.get('mfu'))} "
                     f"| {_pct(r.get('mfu_kempnerforge'))} | {_pct(r.get('hfu'))} "
                     f"| {_gib(r['predicted_bytes'])} | {_gib(r['allocated_bytes'])} "
                     f"| {_gib(r['smi_peak_bytes'])} | {_ratio(r['allocated_bytes'], r['predicted_bytes'])} |")
    return ("### MFU and memory (dsforge run, one GPU; allocated = torch max_memory_allocated, "
            "nvidia-smi = peak device memory used: reserved + CUDA context)\n" + "\n".join(lines))


MIN_MEASURED_STEPS = 10  # issue 39: a GPU figure counts with >= 10 measured steps


def _render_evidence(result: dict) -> str:
    """What makes each figure checkable: measured steps, the loss from first to last step (a
    run that does not learn is marked), the planner's step time written before the run and its
    error, what was shrunk to fit the command, and the manifest's source and machine."""
    rows = [r for r in result["runs"] if r.get("step_s") is not None]
    for label, cells in result["studies"].items():
        rows += [_cell_evidence(label, c) for c in cells if c.get("step_time_median") is not None]
    if not rows:
        return ""
    lines = ["| run | measured steps | loss first -> last | predicted s/step | measured s/step "
             "| error | shrunk to fit | source, machine |", "|---|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        steps = r.get("measured_steps")
        few = "" if steps is None or steps >= MIN_MEASURED_STEPS else " (FEWER THAN 10)"
        lines.append(f"| {r['label']} | {_num(steps, 'd')}{few} | {_loss(r)} "
                     f"| {_num(r.get('predicted_step_s'), '.2f')} | {_num(r.get('step_s'), '.2f')} "
                     f"| {_error(r.get('predicted_step_s'), r.get('step_s'))} | {r.get('shrunk') or '-'} "
                     f"| {_source(r.get('provenance'))} |")
    return ("### Evidence (each figure above: steps measured after warm-up, on the kit's corpus; "
            "the planner's step time on the GPU's profile as shipped, written before the run)\n"
            + "\n".join(lines))


FP8_LOSS_TOLERANCE = 0.015  # issue 40: fp8's final loss within 1.5% of bf16's


def _render_speedups(result: dict) -> str:
    """Each run of a measurement with a baseline (compile-fp8) as a ratio of the baseline's
    step time, beside the planner's predicted ratio (kit_plan.PREDICTED_SPEEDUP, written
    before any such run)."""
    lines = []
    for name in dict.fromkeys(r["measurement"] for r in result["runs"]):
        baseline = MEASUREMENTS[name].baseline if name in MEASUREMENTS else None
        rows = [r for r in result["runs"] if r["measurement"] == name]
        base = next((r for r in rows if baseline and r["label"].endswith(baseline)), None)
        if base is None or base.get("step_s") is None:
            continue
        for r in rows:
            variant = r["label"].split("-", 1)[1]
            ratio = base["step_s"] / r["step_s"] if r.get("step_s") else None
            predicted = PREDICTED_SPEEDUP.get(variant, 1.0) if r["label"].startswith("7b") else None
            lines.append(f"| {r['label']} | {_num(r.get('step_s'), '.3f')} | {_num(ratio, '.3f')} "
                         f"| {_num(predicted, '.2f')} | {_pct(r.get('mfu'))} |")
    if not lines:
        return ""
    return ("### Compiled layers and float8 GEMMs against eager bf16 (MFU by dsforge's bf16 "
            "formula and peak for every run, as peers report fp8 runs)\n"
            "| run | s/step | speed-up | predicted (the 7B, H200 profile) | MFU |\n|---|---:|---:|---:|---:|\n" + "\n".join(lines))


def _render_fp8_loss(result: dict) -> str:
    """fp8 follows bf16: the mean loss of the last 10 steps of each (fp8-loss)."""
    runs = {r["label"]: r for r in result["runs"]}
    bf16, fp8 = runs.get("1b-loss-bf16") or {}, runs.get("1b-loss-fp8") or {}
    if bf16.get("tail_loss") is None or fp8.get("tail_loss") is None:
        return ""
    diff = (fp8["tail_loss"] - bf16["tail_loss"]) / bf16["tail_loss"]
    verdict = "within" if abs(diff) <= FP8_LOSS_TOLERANCE else "OUTSIDE"
    return (f"### float8 follows bf16 (the 1B on the corpus)\n- last-10 mean loss: bf16 "
            f"{bf16['tail_loss']:.4f}, fp8 {fp8['tail_loss']:.4f} ({diff:+.2%}, {verdict} "
            f"{FP8_LOSS_TOLERANCE:.1%}); from {bf16.get('first_loss') or 0:.3f} at the first step")


def _cell_evidence(label: str, cell: dict) -> dict:
    prediction = cell.get("prediction") or {}
    return {"label": f"{label} " + ", ".join(f"{k}={v}" for k, v in cell["axes"].items()),
            "measured_steps": cell.get("measured_steps"), "first_loss": cell.get("first_loss"),
            "last_loss": cell.get("final_loss"), "loss_falls": _falls(cell),
            "predicted_step_s": prediction.get("step_time_s"), "step_s": cell.get("step_time_median"),
            "shrunk": cell.get("shrunk"), "provenance": cell.get("provenance")}


def _falls(cell: dict):
    first, last = cell.get("first_loss"), cell.get("final_loss")
    return None if first is None or last is None else last < first


def _loss(row: dict) -> str:
    first, last = row.get("first_loss"), row.get("last_loss")
    if first is None or last is None:
        return "-"
    mark = "" if row.get("loss_falls") else " **does not fall**"
    return f"{first:.3f} -> {last:.3f}{mark}"


def _source(p: dict | None) -> str:
    if not p:
        return "no manifest"
    commit = (p.get("commit") or "?")[:9]
    tree = "" if p.get("dirty") is False else f" + diff {(p.get('diff_sha256') or '?')[:8]}" \
        if p.get("dirty") else " (tree unknown)"
    gpu = (p.get("gpu_uuid") or "GPU ?")[:12]
    return f"{commit}{tree}; {gpu}, driver {p.get('driver') or '?'}"


def _render_breakdown(result: dict) -> str:
    """Each run's and study cell's median ms per phase (dsforge.job.metrics_file.PHASES) and
    its share of the median step, where the run measured a breakdown."""
    rows = [(r["label"], r.get("step_s"), r.get("breakdown_s")) for r in result["runs"]]
    for label, cells in result["studies"].items():
        rows += [(f"{label} " + ", ".join(f"{k}={v}" for k, v in c["axes"].items()),
                  c.get("step_time_median"), c.get("breakdown_s")) for c in cells]
    rows = [row for row in rows if row[2]]
    if not rows:
        return ""
    lines = ["| run | step ms | " + " | ".join(PHASES) + " |", "|---|---:|" + "---:|" * len(PHASES)]
    for label, step, phases in rows:
        cells = [_phase(phases.get(p), step) for p in PHASES]
        step_ms = _num(step * 1e3 if step else None, ",.0f")
        lines.append(f"| {label} | {step_ms} | " + " | ".join(cells) + " |")
    return ("### Where the step goes (median ms per phase and share of the median step; "
            "docs/breakdown.md)\n" + "\n".join(lines))


def _render_startup(result: dict) -> str:
    """Each run's seconds from `dsforge run` to its first step, by phase (summary.json
    `startup_s`, dsforge/runtime/startup.py), where the run recorded them."""
    rows = [(r["label"], r["startup_s"]) for r in result["runs"] if r.get("startup_s")]
    if not rows:
        return ""
    names = list(dict.fromkeys(name for _, phases in rows for name in phases))
    lines = ["| run | start-up s | " + " | ".join(names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for label, phases in rows:
        cells = [_num(phases.get(name), ".1f") for name in names]
        before = sum(v for name, v in phases.items() if name != "compile")  # paid in step 0
        lines.append(f"| {label} | {before:.1f} | " + " | ".join(cells) + " |")
    return ("### Start-up: seconds from `dsforge run` to the first step (docs/breakdown.md; "
            "`compile`, where a run compiles its layers, is paid inside the first step and not "
            "in the total)\n" + "\n".join(lines))


def _phase(seconds, step) -> str:
    if seconds is None:
        return "-"
    share = f" ({seconds / step:.0%})" if step else ""
    return f"{seconds * 1e3:,.0f}{share}"


def _render_gemm(result: dict) -> str:
    g = result.get("gemm")
    if not g:
        return ""
    backends = list(g["models"][0]["attention"]["backends"]) if g["models"] else []
    lines = ["| model | tokens | GEMM TFLOP/s | share of peak | planner assumes | "
             + " | ".join(f"SDPA {b} TFLOP/s" for b in backends) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(backends)]
    for m in g["models"]:
        sdpa = [_sdpa(m["attention"]["backends"].get(b)) for b in backends]
        lines.append(f"| {Path(m['recipe']).stem} | {m['tokens']} | {m['tflops']:.3g} "
                     f"| {_pct(m.get('share_of_peak'))} | {_pct(g['planner_compute_efficiency'])} "
                     f"| " + " | ".join(sdpa) + " |")
    where = "CPU, fp32, tiny shapes" if g.get("tiny") else f"{g['device']}, {g['dtype']}"
    return (f"### GEMMs and attention at the models' shapes ({where}; median of {g['reps']}; "
            "attention forward + backward through dsforge's SDPAttention per model.sdpa_backend, "
            "full-matrix FLOP count)\n" + "\n".join(lines))


def _sdpa(timed: dict | None) -> str:
    if not timed:
        return "-"
    return "no kernel" if "error" in timed else f"{timed['tflops_full_matrix']:.3g}"


def _render_adam(result: dict) -> str:
    a = result.get("adam")
    if not a:
        return ""
    lines = ["| ZeRO | Adam | DeepSpeed's optimizer | step ms | peak GiB | note |",
             "|---:|---|---|---:|---:|---|"]
    for r in a["results"]:
        step = r.get("step_s")
        lines.append(f"| {r['stage']} | {r['impl']} | {r.get('optimizer') or '-'} "
                     f"| {_num(step * 1e3 if step is not None else None, ',.1f')} "
                     f"| {_gib(r.get('peak_memory_bytes'))} | {r.get('error') or ''} |")
    return (f"### The optimizer step alone ({a['device']}, {a['parameters'] / 1e9:.2f}B parameters "
            f"of {Path(a['recipe']).stem}'s shapes, {a['dtype']}; median of {a['reps']})\n"
            + "\n".join(lines))


PROFILE_FIELDS = ("compute_efficiency", "attention_efficiency", "expert_efficiency",
                  "fp8_gemm_speedup", "gemm_knee_tokens", "optimizer_bytes_per_param",
                  "optimizer_bytes_per_param_fp32", "optimizer_fixed_s", "host_layer_s",
                  "host_layer_zero3_s", "other_s_per_token_hidden")


def _render_profile(result: dict) -> str:
    """The calibrated profiles: the 7B's (`calibrate`) and the MoE's (`calibrate-moe`)."""
    shown = [(name, result.get(key)) for name, key in ((CALIBRATED, "profile"),
                                                       (CALIBRATED_MOE, "profile_moe"))]
    return "\n\n".join(
        f"### The profile dsforge calibrate measured ({p['measured_on']}, {name}; its comments "
        "hold every figure)\n" + "\n".join(
            ["| field | measured |", "|---|---:|"]
            + [f"| {f} | {_num(p.get(f), '.4g')} |" for f in PROFILE_FIELDS])
        for name, p in shown if p)


def _render_loop(result: dict) -> str:
    """The search's trials, predicted (by the calibrated profile where calibrate ran first)
    against measured, and each predicted again by the refit on the others."""
    loop = result.get("loop")
    if not loop:
        return ""
    refit = loop.get("refit") or {}
    left_out = {row["label"]: row["left_out_s"] for row in refit.get("trials", [])}
    lines = ["| # | layout | status | predicted s | measured s | error | refit without it s | error |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for t in loop.get("measured", []):
        label, measured = shape(t["layout"]), t["measured_step_s"]
        alone = left_out.get(label)
        lines.append(f"| {t['predicted_rank']} | {label} | {t['status']} "
                     f"| {t['predicted_step_s']:.3f} | {_num(measured, '.3f')} "
                     f"| {_error(t['predicted_step_s'], measured)} | {_num(alone, '.3f')} "
                     f"| {_error(alone, measured)} |")
    tail = [f"- {loop.get('measured_verdict', 'no trial finished')}"]
    if refit:
        tail.append(f"- refit: band +-{refit['prediction_error']:.1%} (each trial predicted from "
                    "the others); coefficients " + ", ".join(
                        f"{k} {v:.3g}" for k, v in refit["coefficients"].items()))
    return (f"### The loop: dsforge plan --search --measure, top {LOOP_TOP} (the profile it "
            f"started from: {loop['profile_measured_on']})\n" + "\n".join(lines + [""] + tail))



def _error(predicted, measured) -> str:
    return f"{predicted / measured - 1:+.1%}" if predicted and measured else "-"


def _render_studies(result: dict) -> str:
    out = []
    for label, cells in result["studies"].items():
        lines = ["| cell | status | s/step | tok/s/GPU | MFU | predicted GiB | allocated GiB "
                 "| allocated/predicted | census params/grads/optimizer/other GiB |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for c in cells:
            predicted = ((c.get("prediction") or {}).get("memory_bytes") or {}).get("total")
            census = c.get("tensor_bytes")
            parts = "/".join(_gib(census[k]) for k in ("params", "grads", "optimizer", "other")) \
                if census else "-"
            axes = ", ".join(f"{k}={v}" for k, v in c["axes"].items())
            lines.append(f"| {axes} | {c['status']} | {_num(c.get('step_time_median'), '.2f')} "
                         f"| {_num(c.get('tokens_per_s_per_gpu'))} | {_pct(c.get('mfu'))} "
                         f"| {_gib(predicted)} | {_gib(c.get('peak_memory_bytes'))} "
                         f"| {_ratio(c.get('peak_memory_bytes'), predicted)} | {parts} |")
        out.append(f"### {label} (dsforge bench)\n" + "\n".join(lines))
    return "\n\n".join(out)
