"""On a GPU: a real CUDA out-of-memory and a real DeepSpeed op build failure are recorded the
way `dsforge run` reports them (job/failure.py, runtime/guard/oom.py, launch/diagnose.py). CPU
tests cover the same paths with injected faults and DeepSpeed's CPU-side builder code; what
only a GPU has is torch's allocator message and statistics and DeepSpeed's CUDA jit_load.

Through `dsforge run` (tests/gpu/conftest.py's drill runs): a real device-side assert is
recorded as `device` and `--max-restarts 1` brings the job back to its end; a NaN loss stops
the run with its report and no checkpoint after the last good one."""

from __future__ import annotations

import json
import traceback

import pytest
import torch

from dsforge.ckpt.trust import complete_checkpoints, read_latest
from dsforge.job import failure
from dsforge.job.metrics_file import read_metrics
from dsforge.job.run_dir import RunDir
from dsforge.job.signals import EXIT_NONFINITE
from dsforge.launch.diagnose import memory_advice
from dsforge.recipe import resolve_file
from dsforge.runtime.guard.record import record_for
from tests.conftest import REPO
from tests.gpu.conftest import STEPS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _record(action) -> failure.Failure:
    try:
        action()
    except Exception as exc:
        return record_for(exc, rank=0, step=0, detail=traceback.format_exc())
    raise AssertionError("expected a failure")


def test_a_cuda_out_of_memory_records_the_allocators_figures():
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    held = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB
    record = _record(lambda: torch.empty(2 * total, dtype=torch.uint8, device=device))
    del held
    memory = record.memory
    assert record.kind == "oom" and memory["source"] == "cuda max_memory_allocated"
    assert memory["capacity"] == total and memory["allocated"] >= 2**28
    assert memory["peak"] >= 2**28 and memory["reserved"] >= memory["peak"]
    # torch's message says how much it tried to allocate (rounded to two decimals)
    assert memory["requested"] == pytest.approx(2 * total, rel=0.01)
    advice = memory_advice(memory, resolve_file(REPO / "recipes" / "7b_1gpu.yaml"))
    assert advice.startswith("the memory model predicts ")


def test_deepspeeds_cuda_fused_adam_build_on_the_h200_images_arch_list(monkeypatch, tmp_path):
    """What every rank died of on the first H200 (TORCH_CUDA_ARCH_LIST="9.0a")."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built lands elsewhere
    record = _record(lambda: FusedAdamBuilder().jit_load(verbose=False))
    assert (record.kind, record.what) == ("build", "DeepSpeed's fused_adam op"), record.detail
    assert record.cause.startswith("TORCH_CUDA_ARCH_LIST='9.0a' cannot be parsed"), record.cause
    assert "TORCH_CUDA_ARCH_LIST='9.0'" in record.fix


def test_a_device_error_is_recorded_and_a_restart_brings_the_job_back(gpu_runs):
    run = gpu_runs["drill_device"]
    assert run.returncode == 0, run.output[-4000:]
    assert "dsforge: restarting (1 of 1)" in run.output and "finished after 1 restart" in run.output
    cause = json.loads(RunDir(run.run_dir).summary.read_text())["restart_causes"][0]
    assert cause["kind"] == "device" and "device-side assert" in cause["message"], cause
    records, _ = read_metrics(run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))  # every step once


def test_a_nan_loss_stops_the_run_with_its_report_and_no_checkpoint_after_it(gpu_runs):
    run = gpu_runs["drill_nan"]
    assert run.returncode == EXIT_NONFINITE, run.output[-4000:]
    assert "dsforge: the training stopped at step 11: non-finite loss" in run.output
    root = run.run_dir / "checkpoints"
    assert list(complete_checkpoints(root)) == [5, 10] and read_latest(root) == "step00000010"
    record = failure.first(RunDir(run.run_dir))
    assert (record.kind, record.step) == ("nonfinite", 10)
    assert "the last good checkpoint: " + str(root / "step00000010") in record.detail
