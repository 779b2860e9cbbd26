"""Invented inputs for the kit's dry run: files shaped like a GPU command's (run directories,
a bench results.db, pytest's JUnit XML, the calibrated profile, the loop's search), with
invented figures, so kit_results.py reads them and kit_table.py renders them on a CPU exactly
as a GPU command's (kit.py --dry-run, tests/unit/test_gpu_kit.py)."""

from __future__ import annotations

import dataclasses
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from dsforge.hardware import gpu_by_key
from dsforge.job.metrics_file import PHASES
from dsforge.job.run_dir import RunDir
from dsforge.units import GiB
from kit_plan import RunSpec, StudySpec
from kit_steps import CALIBRATED, CALIBRATED_MOE, Step, prediction, resolve_run, write_study
from kit_results import GPU_RUNS, shape

FAKE_MFU = 0.40  # the invented runs' MFU
FAKE_ALLOCATED_SHARE = 0.9  # invented allocated / predicted
# An invented split of each step over the phases (shares of the step; the rest is "other").
FAKE_PHASE_SHARES = {"forward": 0.3, "backward": 0.45, "recompute": 0.1, "optimizer": 0.05}
FAKE_STARTUP_S = {"launch": 4.0, "setup": 3.0, "data": 0.0, "distributed": 8.0, "model": 2.0,
                  "weights": 1.0, "engine": 5.0}  # invented start-up phases, seconds


def write_fake_inputs(steps: list[Step], work: Path, gpu: str) -> dict[str, dict]:
    """Files shaped like a GPU command's, with invented figures; returns the step records."""
    records = {}
    for step in steps:
        if step.kind == "plan":
            _write(work / "plans" / f"{step.spec.label}.json", _fake_plan(step.spec, gpu))
        elif step.kind == "run":
            records[step.name] = {**_fake_run(step.spec, work, gpu), "seconds": step.expected_s}
        elif step.kind == "bench":
            _fake_study(step.spec, work, gpu)
        elif step.kind == "pytest":
            _fake_tests(work)
        elif step.kind == "adam":
            _fake_adam(work, gpu)
        elif step.kind in ("calibrate", "calibrate-moe"):
            _fake_profile(work / (CALIBRATED if step.kind == "calibrate" else CALIBRATED_MOE), gpu)
        elif step.kind == "search":
            _fake_loop(step, work)
        elif step.kind == "peer":
            _fake_peer(step, work, gpu)
        if step.kind != "skip":
            records.setdefault(step.name, {"status": "fake", "seconds": step.expected_s})
    return records


def _fake_loop(step: Step, work: Path) -> None:
    """The search the step names, run here without --measure (its layouts and predictions, and
    a check of its arguments), with invented trials 5% slower than predicted and a refit."""
    from click.testing import CliRunner

    from dsforge.cli import main

    argv = list(step.argv[step.argv.index("plan"):])
    at = argv.index("--measure-out")
    del argv[at:at + 2]
    argv.remove("--measure")
    if "--profile" in argv:  # the fake calibrate step's, in this dry run's work folder
        argv[argv.index("--profile") + 1] = str(work / CALIBRATED)
    done = CliRunner().invoke(main, argv)
    if done.exit_code != 0:
        raise RuntimeError(f"the loop's search failed here: {done.output[-2000:]}")
    data = json.loads(done.stdout)
    trials = [{"predicted_rank": i, "layout": c["layout"],
               "predicted_step_s": c["step_time_s"]["total"],
               "measured_step_s": 1.05 * c["step_time_s"]["total"], "status": "ok", "reason": None}
              for i, c in enumerate(data["candidates"], start=1)]
    data["measured"] = trials
    data["measured_verdict"] = "FAKE: the measurement keeps the search's answer"
    data["refit"] = {"coefficients": {"compute": 0.95}, "prediction_error": 0.02,
                     "trials": [{"label": shape(t["layout"]), "measured_s": t["measured_step_s"],
                                 "left_out_s": t["measured_step_s"] * 1.01} for t in trials]}
    path = work / "logs" / "loop.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("measuring the top layouts on this machine (FAKE)\n" + json.dumps(data, indent=2))


# The peer's command run on this CPU at a tiny shape (its arguments, the shape file, the corpus
# and the loop checked), then given invented throughput: FAKE_PEER_SHARE of dsforge's.
FAKE_PEER_SHARE = 0.8
TINY_PEER = {"hidden_size": 64, "ffn_hidden_size": 128, "num_layers": 2, "num_attention_heads": 4,
             "num_kv_heads": 2, "head_dim": 16}


def _fake_peer(step: Step, work: Path, gpu: str) -> None:
    import kit_peers
    import peer_loop
    from kit_plan import MEASUREMENTS
    from kit_steps import peer_paths

    spec = next(r for r in MEASUREMENTS[step.measurement].runs if r.label == step.spec.matches)
    shape_path = kit_peers.write_shape(step.spec, spec, gpu, work)
    tiny = shape_path.with_name(shape_path.stem + ".tiny.json")
    tiny.write_text(json.dumps({**json.loads(shape_path.read_text()), **TINY_PEER}))
    out = peer_paths(step.spec, work)[1]
    argv = list(step.argv[2:])
    for flag, value in (("--model", str(tiny)), ("--seq-len", "32"), ("--micro-batch", "1"),
                        ("--global-batch", "2"), ("--compile", "none"), ("--out", str(out))):
        argv[argv.index(flag) + 1] = value
    if peer_loop.main([*argv, "--device", "cpu"]) != 0:
        raise RuntimeError(f"the peer's command failed here: {step.argv}")
    data = json.loads(out.read_text())
    resolved = resolve_run(spec, gpu)
    ours = FAKE_MFU * gpu_by_key(gpu).peak_bf16_flops / prediction(resolved)["flops_per_token"]
    data["tokens_per_s"] = FAKE_PEER_SHARE * ours
    data["framework"] += " (FAKE: run on CPU at a tiny shape)"
    data["settings"]["compile"] = step.spec.compile
    out.write_text(json.dumps(data))


def _fake_profile(path: Path, gpu: str) -> None:
    import dataclasses

    from dsforge.cost.profile import default_profile, profile_text

    fake = dataclasses.replace(default_profile(gpu), measured_on="FAKE (dry run)")
    path.write_text(profile_text(fake, "invented by the dry run"))


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _fake_breakdown(step_s: float) -> dict[str, float]:
    phases = {p: FAKE_PHASE_SHARES.get(p, 0.0) * step_s for p in PHASES}
    phases["other"] = step_s - sum(phases.values())
    return phases


def _fake_plan(spec: RunSpec, gpu: str) -> dict:
    """The plan the kit writes before a run, with the planner's step time (kit.run_plan)."""
    from dsforge.cost.step_time import predicted_step_time

    resolved = resolve_run(spec, gpu)
    return {**prediction(resolved), "step_time": predicted_step_time(resolved, gpu, gpus_per_node=1)}


# An invented manifest's source and machine (kit_results.provenance reads them).
FAKE_MANIFEST = {"git_commit": "0" * 40, "git_dirty": False, "git_diff_sha256": None,
                 "machine_id": "FAKE"}


def _fake_manifest(gpu: str) -> dict:
    return {**FAKE_MANIFEST, "device": {"type": "cuda", "name": gpu_by_key(gpu).name,
                                        "uuid": "GPU-FAKE", "driver": "FAKE"}}


def _fake_records(predicted: dict, tokens_per_step: int, peak: float, allocated: int,
                  train) -> list:
    from dsforge.runtime.loop.metrics import StepRecord

    per_gpu = FAKE_MFU * peak / predicted["flops_per_token"]
    hfu = FAKE_MFU * predicted["hardware_flops_per_token"] / predicted["flops_per_token"]
    step_s = tokens_per_step / per_gpu
    return [StepRecord(step=i, warmup=i < train.timing_warmup, loss=10.4 * 0.97 ** i, grad_norm=1.0, lr=3e-4,
                       step_time_s=step_s, tokens_per_s=per_gpu, tokens_per_s_per_gpu=per_gpu,
                       tflops_per_gpu=per_gpu * predicted["flops_per_token"] / 1e12, mfu=FAKE_MFU, hfu=hfu,
                       peak_memory_bytes=allocated, memory_source="FAKE",
                       breakdown_s=_fake_breakdown(step_s)) for i in range(train.steps)]


def _fake_run(spec: RunSpec, work: Path, gpu: str) -> dict:
    from dsforge.runtime.loop.metrics import MetricsWriter

    resolved = resolve_run(spec, gpu)
    predicted = prediction(resolved)
    allocated = int(FAKE_ALLOCATED_SHARE * predicted["memory_bytes"]["total"])
    run_dir = RunDir(work / "runs" / spec.label)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(run_dir.metrics)
    tokens = resolved.layout.global_batch * resolved.recipe.train.seq_len
    for record in _fake_records(predicted, tokens, gpu_by_key(gpu).peak_bf16_flops, allocated,
                                resolved.recipe.train):
        writer.write(record)
    _write(run_dir.summary, {**writer.summary(), "startup_s": dict(FAKE_STARTUP_S)})
    _write(run_dir.rank_summary(0), {"rank": 0, "peak_memory_bytes": allocated,
                                     "memory_source": "FAKE"})
    _write(run_dir.manifest, _fake_manifest(gpu))
    return {"status": "fake", "smi_peak_bytes": allocated + GiB}


def _fake_study(spec: StudySpec, work: Path, gpu: str) -> None:
    from dataclasses import asdict

    from dsforge.bench.store import Row, Store
    from dsforge.bench.study import expand, load_study, study_identity
    from dsforge.recipe import resolve_file

    study, recipe_path = load_study(write_study(spec, work))
    path = work / "bench" / spec.label / "results.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    store = Store(path)
    try:
        for cell in expand(study, base=study_identity(study, recipe_path)):
            resolved = resolve_file(recipe_path, cell.overrides, world_size=study.world_size)
            store.write(_fake_row(study.name, cell, resolved, gpu, Row, asdict,
                                  study.measure.warmup_steps, study.measure.steps))
    finally:
        store.close()


def _fake_row(study: str, cell, resolved, gpu: str, Row, asdict, warmup: int, steps: int):
    from dsforge.cost.step_time import predicted_step_time

    predicted = prediction(resolved)
    step_s = predicted_step_time(resolved, gpu, gpus_per_node=1)["total"]
    allocated = int(FAKE_ALLOCATED_SHARE * predicted["memory_bytes"]["total"])
    train = dataclasses.replace(resolved.recipe.train, steps=warmup + steps, timing_warmup=warmup)
    records = _fake_records(predicted, resolved.layout.global_batch * resolved.recipe.train.seq_len,
                            gpu_by_key(gpu).peak_bf16_flops, allocated, train)
    figures = {"step_times_s": [r.step_time_s for r in records if not r.warmup],
               "tokens_per_s": records[-1].tokens_per_s,
               "tokens_per_s_per_gpu": records[-1].tokens_per_s_per_gpu, "mfu": FAKE_MFU,
               "hfu": records[-1].hfu, "first_loss": records[0].loss, "final_loss": records[-1].loss,
               "peak_memory_bytes": allocated,
               "memory_source": "FAKE", "bubble_share_by_stage": {}, "tensor_bytes": None,
               "breakdown_s": records[-1].breakdown_s}
    return Row(study=study, cell=cell.key, repeat=0, axes=cell.axes, status="ok", seconds=30.0,
               manifest=_fake_manifest(gpu), figures=figures,
               prediction={**predicted, "layout": asdict(resolved.layout), "step_time_s": step_s},
               finished=time.time())


FAKE_TESTS = ("test_default_run_trains_in_bf16_on_one_gpu", "test_default_run_builds_nothing",
              "test_bf16_loss_follows_fp32", "test_fused_kernels_loss_equals_the_plain_path_over_30_steps")


def _fake_tests(work: Path) -> None:
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="pytest", tests=str(len(FAKE_TESTS)))
    for name in FAKE_TESTS:
        ET.SubElement(suite, "testcase", classname="tests.gpu", name=name)
    work.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(work / "gpu-tests.xml")
    for name, offset in (("fp32", 0.0), ("torch", 0.01), ("default", 0.012)):
        lines = [json.dumps({"step": i, "loss": 6.0 - 0.04 * i + offset}) for i in range(30)]
        path = RunDir(work / GPU_RUNS / name).metrics
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")


def _fake_adam(work: Path, gpu: str) -> None:
    results = [{"stage": stage, "impl": impl, "optimizer": "FAKE", "step_s": 0.05 * (1 + stage / 10),
                "peak_memory_bytes": 20 * GiB} for stage in range(4) for impl in ("fused", "deepspeed")]
    _write(work / "adam_step.json", {"device": gpu_by_key(gpu).name, "recipe": "fake.yaml",
                                     "parameters": 1.24e9, "dtype": "bfloat16", "reps": 5,
                                     "results": results})
