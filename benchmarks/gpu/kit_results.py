"""The kit's results: read what the steps left in the work folder and compute the comparisons
(kit_table.py renders them).

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
import xml.etree.ElementTree as ET
from pathlib import Path

from dsforge.hardware import gpu_for_device_name
from dsforge.job.metrics_file import is_validation
from dsforge.job.run_dir import RunDir
import kit_peers
from kit_plan import MEASUREMENTS, RunSpec, StudySpec
from kit_steps import CALIBRATED, CALIBRATED_MOE, Step, resolve_run
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
              "profile": calibrated_profile(work),
              "profile_moe": calibrated_profile(work, CALIBRATED_MOE), "loop": loop_result(work),
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


def calibrated_profile(work: Path, name: str = CALIBRATED) -> dict | None:
    """The fields of the profile a calibrate step wrote (`name` in the work folder), None where
    it wrote none."""
    import dataclasses

    from dsforge.cost.profile import read_profile

    path = work / name
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


def shape(layout: dict) -> str:
    """The layout as calibrate's rows label it (search.Ranked.shape)."""
    from dsforge.search.search import shape_of

    return shape_of(layout)
