"""What `dsforge run` says when a rank dies building an op or runs out of memory, end to end
through its launcher: one line with the cause and the fix, the traceback only in the
job log (job/failure.py, runtime/guard/build_failure.py, launch/diagnose.py)."""

from __future__ import annotations

import json
import time

from dsforge.job import failure
from dsforge.job.run_dir import RunDir
from tests.distributed.test_run import QUICK, TINY, _job_processes, dsforge

TRACEBACK = "Traceback (most recent call last)"


def _failed_run(tmp_path, env: dict) -> tuple[str, str, failure.Failure]:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = dsforge("run", TINY, *QUICK, "--run-dir", str(run_dir), env=env)
    assert result.returncode != 0 and time.monotonic() - start < 120
    assert not _job_processes(run_dir)
    log = (run_dir / "job.log").read_text()
    assert TRACEBACK in log and TRACEBACK not in result.stderr
    return result.stderr, str(run_dir / "job.log"), failure.first(RunDir(run_dir))


def _report_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "first failure:" in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_an_op_build_failure_names_the_op_the_variable_and_the_fix(tmp_path):
    """The H200's first-day failure, by DeepSpeed's own op builder code: TORCH_CUDA_ARCH_LIST
    "9.0a", which torch accepts, read with int() by DeepSpeed's FusedAdam build."""
    stderr, log, record = _failed_run(
        tmp_path, {"DSFORGE_INJECT_FAULT": "build:0:1", "TORCH_CUDA_ARCH_LIST": "9.0a"})
    assert (record.kind, record.rank, record.step, record.what) == ("build", 0, 1, "DeepSpeed's fused_adam op")
    assert "'0a'" in record.message and "builder.py" in record.detail
    line = _report_line(stderr)
    assert "rank 0 failed building DeepSpeed's fused_adam op at step 2: " \
           "TORCH_CUDA_ARCH_LIST='9.0a' cannot be parsed" in line
    assert "Fix: export TORCH_CUDA_ARCH_LIST='9.0'" in line and line.endswith(f"traceback in {log}")


def test_an_out_of_memory_is_one_line_with_the_prediction_and_the_measurement(tmp_path):
    stderr, log, record = _failed_run(tmp_path, {"DSFORGE_INJECT_FAULT": "oom:1:2"})
    assert (record.kind, record.rank, record.step) == ("oom", 1, 2)
    memory = record.memory
    assert memory["source"] == "process peak RSS" and 0 < memory["peak"] < memory["capacity"]
    line = _report_line(stderr)
    assert "rank 1 ran out of memory at step 3: measured peak " in line
    # the tiny model is predicted far inside a CPU rank's share of the host: the report says
    # the memory went elsewhere rather than suggesting changes
    assert "the memory model predicts " in line and "which fits" in line
    assert line.endswith(f"traceback in {log}")
    saved = json.loads((tmp_path / "run" / "failures" / "rank00001.json").read_text())
    assert saved["memory"] == memory
