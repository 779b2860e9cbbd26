"""The kit's results: read what the steps left in the work folder, compute the comparisons,
render the markdown table.

Everything is read from files in dsforge's own formats (a run directory's summary.json,
metrics.jsonl, ranks/ and manifest.json; a bench results.db; pytest's JUnit XML and the GPU
tests' run directories; gemm.py's, adam_step.py's and probe_env.py's JSON), so the dry run can
feed the same functions with invented inputs (kit_fake.py) and check the table
without a GPU. The step breakdown (dsforge.job.metrics_file.PHASES; a run's summary.json
`median_breakdown_s`, a bench cell's `breakdown_s`) is read where present: runs of a dsforge
without it show none.

MFU is shown twice with the same peak (dsforge's device table): by dsforge's formula
(docs/flops.md: 6N + 12 L s heads head_dim, N the matmul parameters incl. the output layer)
and by KempnerForge's (kempnerforge/metrics/mfu.py: 6P + 12 L D S, P = L (attention + MLP) +
V D, D the hidden size). They differ only where heads x head_dim != hidden size.
"""

from __future__ import annotations

import json
import re
import statistics
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from dsforge.hardware import gpu_for_device_name
from dsforge.job.metrics_file import PHASES, is_validation
from dsforge.job.run_dir import RunDir
from dsforge.units import GiB
import kit_peers
from kit_format import num as _num
from kit_format import pct
from kit_plan import (CALIBRATED, LOOP_TOP, MEASUREMENTS, PREDICTED_SPEEDUP, RunSpec, Step,
                      StudySpec, resolve_run)
from kit_wheels import dsforge_version

PRECISION_TOLERANCE = 0.05  # |bf16 - fp32| / fp32 of the last-10-step mean loss
KERNEL_RTOL, KERNEL_ATOL = 1e-2, 1e-3  # Liger's own bf16 loss tolerance (tests/gpu)
GPU_RUNS = "pytest/gpu-runs"  # tests/gpu/conftest.py's run directories under the work folder


def kempnerforge_flops_per_token(model, seq_len: int) -> float:
    """6 P + 12 L D S (KempnerForge's dense formula; P counts the output layer even when tied)."""
    d, head_dim = model.hidden_size, model.head_dim
    attention = d * model.num_attention_heads * head_dim + 2 * d * model.query_groups * head_dim \
        + model.num_attention_heads * head_dim * d
    mlp = 3 * d * model.ffn_hidden_size
    params = model.num_layers * (attention + mlp) + model.vocab_size * d
    return 6.0 * params + 12.0 * model.num_layers * d * seq_len


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def step_records(metrics: Path) -> list[dict]:
    """A metrics.jsonl's step records (its validation lines left out)."""
    return [r for r in read_jsonl(metrics) if not is_validation(r)]


def peak_flops(device_name: str | None) -> float | None:
    """The run's device's dense bf16 peak; None (MFU n/a) for a CPU or an unknown device."""
    gpu = gpu_for_device_name(device_name) if device_name else None
    return gpu.peak_bf16_flops if gpu else None


def losses(records: list[dict]) -> dict:
    """Did the run learn: its first and last step's loss, and whether the mean of the last
    three steps is below the first (one noisy last step does not decide it)."""
    values = [r["loss"] for r in records if r.get("loss") is not None]
    if not values:
        return {"first_loss": None, "last_loss": None, "loss_falls": None, "tail_loss": None}
    tail = values[-3:]
    return {"first_loss": values[0], "last_loss": values[-1],
            "loss_falls": len(values) > 1 and sum(tail) / len(tail) < values[0],
            "tail_loss": statistics.mean(values[-10:])}


def provenance(manifest: dict) -> dict:
    """What a reader needs to find the run's source and machine again (manifest.json)."""
    device = manifest.get("device") or {}
    return {"commit": manifest.get("git_commit"), "dirty": manifest.get("git_dirty"),
            "diff_sha256": manifest.get("git_diff_sha256"), "gpu_uuid": device.get("uuid"),
            "driver": device.get("driver"), "machine_id": manifest.get("machine_id")}


def run_row(spec: RunSpec, record: dict, work: Path, gpu: str) -> dict:
    """One `dsforge run`: measured figures next to the prediction and both MFUs. A run without
    its manifest.json gives no figures (issue 39: none without the record of what ran)."""
    run_dir = RunDir(work / "runs" / spec.label)
    plan = read_json(work / "plans" / f"{spec.label}.json") or {}
    summary = read_json(run_dir.summary)
    rank = read_json(run_dir.rank_summary(0)) or {}
    manifest = read_json(run_dir.manifest)
    device = ((manifest or {}).get("device") or {}).get("name")
    row = {"label": spec.label, "status": record.get("status"), "seconds": record.get("seconds"),
           "note": record.get("note"), "device": device, "shrunk": spec.shrunk,
           "predicted_bytes": (plan.get("memory_bytes") or {}).get("total"),
           "predicted": plan.get("memory_bytes"), "smi_peak_bytes": record.get("smi_peak_bytes"),
           "predicted_step_s": (plan.get("step_time") or {}).get("total"),
           "allocated_bytes": rank.get("peak_memory_bytes"),
           "provenance": provenance(manifest) if manifest else None}
    if summary and not manifest:
        row.update(status=f"{row['status']}; no manifest.json: figures left out")
    elif summary:
        recipe = resolve_run(spec, gpu).recipe
        peak = peak_flops(device)
        per_gpu = summary["median_tokens_per_s_per_gpu"]
        # KempnerForge's formula is for dense models: no figure for an MoE.
        kf = None if recipe.model.moe else kempnerforge_flops_per_token(recipe.model, recipe.train.seq_len)
        steps = step_records(run_dir.metrics)
        hfus = [r["hfu"] for r in steps if not r["warmup"] and r["hfu"]]
        row.update(losses(steps), measured_steps=sum(1 for r in steps if not r["warmup"]))
        row.update(step_s=summary["median_step_time_s"], tokens_per_s_per_gpu=per_gpu,
                   mfu=summary["median_mfu"], hfu=statistics.median(hfus) if hfus else None,
                   mfu_kempnerforge=per_gpu * kf / peak if peak and kf else None,
                   final_loss=summary["final_loss"], breakdown_s=summary.get("median_breakdown_s"),
                   startup_s=summary.get("startup_s"))
    return row


def junit_counts(path: Path) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = root.iter("testcase")
    outcome = lambda case: next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    results = {f"{c.get('classname')}::{c.get('name')}": outcome(c) for c in cases}
    counts = {k: sum(1 for v in results.values() if v == k) for k in ("passed", "failure", "error", "skipped")}
    return {"counts": counts, "tests": results}


def _gpu_test_losses(work: Path, name: str) -> list[float]:
    return [r["loss"] for r in step_records(RunDir(work / GPU_RUNS / name).metrics)]


def precision_row(work: Path) -> dict | None:
    """bf16 against fp32 (both with torch's kernels) from tests/gpu's runs."""
    curves = {"fp32": _gpu_test_losses(work, "fp32"), "bf16": _gpu_test_losses(work, "torch")}
    if not all(curves.values()):
        return None
    tail = {p: statistics.mean(c[-10:]) for p, c in curves.items()}
    steps = min(len(c) for c in curves.values())
    diff = (tail["bf16"] - tail["fp32"]) / tail["fp32"]
    return {"steps": steps, "first_loss": curves["fp32"][0], "fp32_tail": tail["fp32"],
            "bf16_tail": tail["bf16"], "relative_difference": diff,
            "max_step_difference": max(abs(curves["bf16"][i] - curves["fp32"][i]) for i in range(steps)),
            "within_tolerance": abs(diff) <= PRECISION_TOLERANCE}


def kernels_row(work: Path) -> dict | None:
    """The default run (Liger's kernels where installed) against torch's, both bf16, from
    tests/gpu's runs: the largest per-step gap, relative to torch's loss."""
    fused, plain = _gpu_test_losses(work, "default"), _gpu_test_losses(work, "torch")
    if not fused or not plain:
        return None
    steps = min(len(fused), len(plain))
    gaps = [abs(fused[i] - plain[i]) / abs(plain[i]) for i in range(steps)]
    worst = max(range(steps), key=gaps.__getitem__)
    within = all(abs(fused[i] - plain[i]) <= KERNEL_ATOL + KERNEL_RTOL * abs(plain[i])
                 for i in range(steps))
    return {"steps": steps, "first_loss": plain[0], "last_fused": fused[steps - 1],
            "last_plain": plain[steps - 1], "max_relative_gap": gaps[worst], "at_step": worst,
            "within_tolerance": within}


def study_rows(spec: StudySpec, work: Path) -> list[dict]:
    """The study's cells as dsforge report aggregates them, with what was shrunk and each
    cell's provenance (its manifest); a cell without a manifest keeps no figures."""
    path = work / "bench" / spec.label / "results.db"
    if not path.exists():
        return []
    from dsforge.bench.report import aggregate
    from dsforge.bench.store import Store

    store = Store(path)
    try:
        rows = store.rows()
    finally:
        store.close()
    cells = aggregate(rows)
    for cell in cells:
        manifest = next((r.manifest for r in rows if r.axes == cell["axes"] and r.manifest), None)
        cell.update(shrunk=spec.shrunk, provenance=provenance(manifest) if manifest else None)
        if manifest is None and cell.get("step_time_median") is not None:
            cell.update(step_time_median=None, tokens_per_s_per_gpu=None, mfu=None,
                        status=f"{cell['status']}; no manifest: figures left out")
    return cells


def collect(steps: list[Step], records: dict[str, dict], work: Path, gpu: str) -> dict:
    """Every result of a call: step records, environment, tests, runs, GEMMs, studies."""
    result = {"gpu": gpu, "steps": [{"name": s.name, "kind": s.kind, "expected_s": s.expected_s,
                                     "basis": s.basis, **records.get(s.name, {})} for s in steps],
              "env": read_json(work / "env.json"), "gemm": read_json(work / "gemm.json"),
              "gpu_tests": junit_counts(work / "gpu-tests.xml"), "precision": precision_row(work),
              "kernels": kernels_row(work), "adam": read_json(work / "adam_step.json"),
              "profile": calibrated_profile(work), "loop": loop_result(work),
              "runs": [], "studies": {}, "peers": []}
    for step in steps:
        if step.kind in ("run", "skip") and isinstance(step.spec, RunSpec):
            record = {**records.get(step.name, {}), **({"status": "skipped", "note": step.note}
                                                        if step.kind == "skip" else {})}
            result["runs"].append({**run_row(step.spec, record, work, gpu),
                                   "measurement": step.measurement})
        elif step.kind == "bench":
            result["studies"][step.spec.label] = study_rows(step.spec, work)
    result["peers"] = peer_rows(steps, records, result["runs"], work, gpu)
    return result


def peer_rows(steps: list[Step], records: dict, runs: list[dict], work: Path, gpu: str) -> list[dict]:
    """peers.json's rows for each measurement with peers in this command (kit_peers)."""
    names = dict.fromkeys(s.measurement for s in steps if s.kind == "peer")
    device = next((r["device"] for r in runs if r.get("device")), None)
    out = []
    for name in names:
        out += kit_peers.rows(MEASUREMENTS[name], runs, records, work, gpu, peak_flops(device),
                              dsforge_version())
    return out


def calibrated_profile(work: Path) -> dict | None:
    """The fields of the profile the calibrate step wrote, None where it wrote none."""
    import dataclasses

    from dsforge.cost.profile import read_profile

    path = work / CALIBRATED
    return dataclasses.asdict(read_profile(path)) if path.is_file() else None


def loop_result(work: Path) -> dict | None:
    """The loop step's `plan --search --json`, which ends its log (dsforge's progress lines
    come first), with where the profile it started from was measured; None where there is none."""
    path = work / "logs" / "loop.log"
    text = path.read_text(errors="replace") if path.is_file() else ""
    start = re.search(r"^\{$", text, flags=re.MULTILINE)
    if start is None:
        return None
    try:
        data, _ = json.JSONDecoder().raw_decode(text, start.start())
    except json.JSONDecodeError:
        return None
    return {**data, "profile_measured_on": data["profile"]["measured_on"] or "the default"}


# ---------------------------------------------------------------------------------------------
# Rendering


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


def _render_profile(result: dict) -> str:
    p = result.get("profile")
    if not p:
        return ""
    fields = ("compute_efficiency", "attention_efficiency", "gemm_knee_tokens",
              "optimizer_bytes_per_param", "optimizer_bytes_per_param_fp32", "optimizer_fixed_s",
              "host_layer_s", "host_layer_zero3_s", "other_s_per_token_hidden")
    lines = ["| field | measured |", "|---|---:|"] + [f"| {f} | {_num(p.get(f), '.4g')} |"
                                                     for f in fields]
    return (f"### The profile dsforge calibrate measured ({p['measured_on']}, "
            f"{CALIBRATED}; its comments hold every figure)\n" + "\n".join(lines))


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


def shape(layout: dict) -> str:
    """The layout as calibrate's rows label it (search.Ranked.shape)."""
    from dsforge.search.search import shape_of

    return shape_of(layout)


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
