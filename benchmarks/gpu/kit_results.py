"""The kit's results: read what the steps left in the work folder, compute the comparisons,
render the markdown table.

Everything is read from files in dsforge's own formats (a run directory's summary.json,
metrics.jsonl, ranks/ and manifest.json; a bench results.db; pytest's JUnit XML; gemm.py's and
probe_env.py's JSON), so the dry run can feed the same functions with invented inputs
(`write_fake_inputs`) and check the table without a GPU.

MFU is shown twice with the same peak (dsforge's device table): by dsforge's formula
(docs/flops.md: 6N + 12 L s heads head_dim, N the matmul parameters incl. the output layer)
and by KempnerForge's (kempnerforge/metrics/mfu.py: 6P + 12 L D S, P = L (attention + MLP) +
V D, D the hidden size). They differ only where heads x head_dim != hidden size.
"""

from __future__ import annotations

import json
import statistics
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from kit_plan import RunSpec, Step, StudySpec, prediction, resolve_run

from dsforge.estimate.hardware import gpu_by_key, gpu_for_device_name
from dsforge.metrics_file import is_validation

GiB = 1024**3
PRECISION_TOLERANCE = 0.05  # |bf16 - fp32| / fp32 of the last-10-step mean loss


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


def run_row(spec: RunSpec, record: dict, work: Path, gpu: str) -> dict:
    """One `dsforge run`: measured figures next to the prediction and both MFUs."""
    run_dir = work / "runs" / spec.label
    plan = read_json(work / "plans" / f"{spec.label}.json") or {}
    summary = read_json(run_dir / "summary.json")
    rank = read_json(run_dir / "ranks" / "rank00000.json") or {}
    device = ((read_json(run_dir / "manifest.json") or {}).get("device") or {}).get("name")
    row = {"label": spec.label, "status": record.get("status"), "seconds": record.get("seconds"),
           "note": record.get("note"), "device": device,
           "predicted_bytes": (plan.get("memory_bytes") or {}).get("total"),
           "predicted": plan.get("memory_bytes"), "smi_peak_bytes": record.get("smi_peak_bytes"),
           "allocated_bytes": rank.get("peak_memory_bytes")}
    if summary:
        recipe = resolve_run(spec, gpu).recipe
        peak = peak_flops(device)
        per_gpu = summary["median_tokens_per_s_per_gpu"]
        kf = kempnerforge_flops_per_token(recipe.model, recipe.train.seq_len)
        hfus = [r["hfu"] for r in step_records(run_dir / "metrics.jsonl") if not r["warmup"] and r["hfu"]]
        row.update(step_s=summary["median_step_time_s"], tokens_per_s_per_gpu=per_gpu,
                   mfu=summary["median_mfu"], hfu=statistics.median(hfus) if hfus else None,
                   mfu_kempnerforge=per_gpu * kf / peak if peak else None,
                   final_loss=summary["final_loss"])
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


def precision_row(work: Path) -> dict | None:
    """bf16 against fp32 on the smoke recipe, from tests/gpu/test_gpu_precision.py's runs."""
    curves = {}
    for precision in ("fp32", "bf16"):
        found = sorted((work / "pytest").glob(f"**/precision-{precision}/metrics.jsonl"))
        records = step_records(found[-1]) if found else []
        if not records:
            return None
        curves[precision] = [r["loss"] for r in records]
    tail = {p: statistics.mean(c[-10:]) for p, c in curves.items()}
    steps = min(len(c) for c in curves.values())
    diff = (tail["bf16"] - tail["fp32"]) / tail["fp32"]
    return {"steps": steps, "first_loss": curves["fp32"][0], "fp32_tail": tail["fp32"],
            "bf16_tail": tail["bf16"], "relative_difference": diff,
            "max_step_difference": max(abs(curves["bf16"][i] - curves["fp32"][i]) for i in range(steps)),
            "within_tolerance": abs(diff) <= PRECISION_TOLERANCE}


def study_rows(spec: StudySpec, work: Path) -> list[dict]:
    """The study's cells as dsforge report aggregates them."""
    path = work / "bench" / spec.label / "results.db"
    if not path.exists():
        return []
    from dsforge.bench.report import aggregate
    from dsforge.bench.store import Store

    store = Store(path)
    try:
        return aggregate(store.rows())
    finally:
        store.close()


def collect(steps: list[Step], records: dict[str, dict], work: Path, gpu: str) -> dict:
    """Every result of a call: step records, environment, tests, runs, GEMMs, studies."""
    result = {"gpu": gpu, "steps": [{"name": s.name, "kind": s.kind, **records.get(s.name, {})}
                                    for s in steps],
              "env": read_json(work / "env.json"), "gemm": read_json(work / "gemm.json"),
              "gpu_tests": junit_counts(work / "gpu-tests.xml"), "precision": precision_row(work),
              "runs": [], "studies": {}}
    for step in steps:
        if step.kind in ("run", "skip") and isinstance(step.spec, RunSpec):
            record = {**records.get(step.name, {}), **({"status": "skipped", "note": step.note}
                                                        if step.kind == "skip" else {})}
            result["runs"].append(run_row(step.spec, record, work, gpu))
        elif step.kind == "bench":
            result["studies"][step.spec.label] = study_rows(step.spec, work)
    return result


# ---------------------------------------------------------------------------------------------
# Rendering


def _gib(value) -> str:
    return f"{value / GiB:.1f}" if value is not None else "-"


def _pct(value) -> str:
    return f"{value:.1%}" if value is not None else "n/a"


def _num(value, fmt: str = ",.0f") -> str:
    return format(value, fmt) if value is not None else "-"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def render(result: dict, *, fake: bool = False) -> str:
    sections = [_render_head(result, fake), _render_steps(result), _render_correctness(result),
                _render_runs(result), _render_gemm(result), _render_studies(result)]
    return "\n\n".join(s for s in sections if s) + "\n"


def _render_head(result: dict, fake: bool) -> str:
    env = result.get("env") or {}
    device = (env.get("torch") or {}).get("device") or "no GPU"
    lines = [f"## dsforge GPU kit: {device} (planned as {result['gpu']}), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    if fake:
        lines.append("FAKE INPUTS (dry run on CPU): every run, test and study figure below is "
                     "invented to exercise the table; the GEMM line was measured on the CPU at "
                     "tiny shapes. Nothing here is a GPU measurement.")
    return "\n".join(lines)


def _render_steps(result: dict) -> str:
    lines = ["| step | status | seconds | note |", "|---|---|---:|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['name']} | {s.get('status', 'not run')} | {_num(s.get('seconds'), '.0f')} "
                     f"| {s.get('note') or ''} |")
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


def _render_gemm(result: dict) -> str:
    g = result.get("gemm")
    if not g:
        return ""
    lines = ["| model | tokens | GEMM TFLOP/s | share of peak | planner assumes | attention TFLOP/s "
             "(full-matrix count) |", "|---|---:|---:|---:|---:|---:|"]
    for m in g["models"]:
        lines.append(f"| {Path(m['recipe']).stem} | {m['tokens']} | {m['tflops']:.3g} "
                     f"| {_pct(m.get('share_of_peak'))} | {_pct(g['planner_compute_efficiency'])} "
                     f"| {m['attention']['tflops_full_matrix']:.3g} |")
    where = "CPU, fp32, tiny shapes" if g.get("tiny") else f"{g['device']}, {g['dtype']}"
    return f"### GEMMs at the models' shapes ({where}; median of {g['reps']})\n" + "\n".join(lines)


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


# ---------------------------------------------------------------------------------------------
# Invented inputs for the dry run


FAKE_MFU = 0.40  # the invented runs' MFU
FAKE_ALLOCATED_SHARE = 0.9  # invented allocated / predicted


def write_fake_inputs(steps: list[Step], work: Path, gpu: str) -> dict[str, dict]:
    """Files shaped like a GPU call's, with invented figures; returns the step records."""
    records = {}
    for step in steps:
        if step.kind == "plan":
            _write(work / "plans" / f"{step.spec.label}.json", prediction(resolve_run(step.spec, gpu)))
        elif step.kind == "run":
            records[step.name] = _fake_run(step.spec, work, gpu)
        elif step.kind == "bench":
            _fake_study(step.spec, work, gpu)
        elif step.kind == "pytest":
            _fake_tests(work)
        if step.kind != "skip":
            records.setdefault(step.name, {"status": "fake", "seconds": step.expected_s})
    return records


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _fake_records(predicted: dict, tokens_per_step: int, peak: float, allocated: int, steps: int = 8):
    from dsforge.runtime.metrics import StepRecord

    per_gpu = FAKE_MFU * peak / predicted["flops_per_token"]
    hfu = FAKE_MFU * predicted["hardware_flops_per_token"] / predicted["flops_per_token"]
    return [StepRecord(step=i, warmup=i < 3, loss=11.0 - 0.1 * i, grad_norm=1.0, lr=3e-4,
                       step_time_s=tokens_per_step / per_gpu, tokens_per_s=per_gpu,
                       tokens_per_s_per_gpu=per_gpu,
                       tflops_per_gpu=per_gpu * predicted["flops_per_token"] / 1e12, mfu=FAKE_MFU, hfu=hfu,
                       peak_memory_bytes=allocated, memory_source="FAKE") for i in range(steps)]


def _fake_run(spec: RunSpec, work: Path, gpu: str) -> dict:
    from dsforge.runtime.metrics import MetricsWriter

    resolved = resolve_run(spec, gpu)
    predicted = prediction(resolved)
    allocated = int(FAKE_ALLOCATED_SHARE * predicted["memory_bytes"]["total"])
    run_dir = work / "runs" / spec.label
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    tokens = resolved.layout.global_batch * resolved.recipe.train.seq_len
    for record in _fake_records(predicted, tokens, gpu_by_key(gpu).peak_bf16_flops, allocated):
        writer.write(record)
    _write(run_dir / "summary.json", writer.summary())
    _write(run_dir / "ranks" / "rank00000.json", {"rank": 0, "peak_memory_bytes": allocated,
                                                   "memory_source": "FAKE"})
    _write(run_dir / "manifest.json", {"device": {"type": "cuda", "name": gpu_by_key(gpu).name}})
    return {"status": "fake", "seconds": spec.expected_s, "smi_peak_bytes": allocated + GiB}


def _fake_study(spec: StudySpec, work: Path, gpu: str) -> None:
    from dataclasses import asdict

    from kit_wheels import REPO

    from dsforge.bench.store import Row, Store
    from dsforge.bench.study import expand, load_study, study_identity
    from dsforge.recipe import resolve_file

    study, recipe_path = load_study(REPO / spec.study)
    path = work / "bench" / spec.label / "results.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    store = Store(path)
    try:
        for cell in expand(study, base=study_identity(study, recipe_path)):
            resolved = resolve_file(recipe_path, cell.overrides, world_size=study.world_size)
            predicted = prediction(resolved)
            allocated = int(FAKE_ALLOCATED_SHARE * predicted["memory_bytes"]["total"])
            records = _fake_records(predicted, resolved.layout.global_batch
                                    * resolved.recipe.train.seq_len, gpu_by_key(gpu).peak_bf16_flops,
                                    allocated)
            figures = {"step_times_s": [r.step_time_s for r in records if not r.warmup],
                       "tokens_per_s": records[-1].tokens_per_s,
                       "tokens_per_s_per_gpu": records[-1].tokens_per_s_per_gpu, "mfu": FAKE_MFU,
                       "hfu": records[-1].hfu, "final_loss": records[-1].loss, "peak_memory_bytes": allocated,
                       "memory_source": "FAKE", "bubble_share_by_stage": {}, "tensor_bytes": None}
            store.write(Row(study=study.name, cell=cell.key, repeat=0, axes=cell.axes, status="ok",
                            seconds=30.0, manifest={"device": {"name": gpu_by_key(gpu).name}},
                            figures=figures, prediction={**predicted, "layout": asdict(resolved.layout)},
                            finished=time.time()))
    finally:
        store.close()


def _fake_tests(work: Path) -> None:
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="pytest", tests="2")
    for name in ("test_smoke_recipe_in_bf16_on_one_gpu", "test_bf16_loss_follows_fp32"):
        ET.SubElement(suite, "testcase", classname="tests.gpu", name=name)
    work.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(work / "gpu-tests.xml")
    for precision, offset in (("fp32", 0.0), ("bf16", 0.01)):
        lines = [json.dumps({"step": i, "loss": 5.5 - 0.05 * i + offset}) for i in range(60)]
        path = work / "pytest" / "test_bf16_loss_follows_fp320" / f"precision-{precision}" / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
