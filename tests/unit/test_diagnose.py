"""What a failed job's report says (launch/diagnose.py), and H6: nothing DeepSpeed's runner
pastes into a remote shell may be shell syntax (job/word.py)."""

from __future__ import annotations

import pytest

from dsforge.job import failure
from dsforge.job.pids import write_pid
from dsforge.job.run_dir import RunDir
from dsforge.launch.commands import Placement, remote_shell_problems
from dsforge.launch.diagnose import describe_code, explain, failure_report, launcher_exit_codes


def test_exit_codes_name_their_signal():
    assert describe_code(-9) == "exit code -9: killed by SIGKILL"
    assert describe_code(1) == "exit code 1"
    log = "[ERROR] [launch.py:259:sigkill_handler] ['python', '--job', 'X'] exits with return code = -9\n"
    assert launcher_exit_codes(log) == [-9]


def test_a_silent_rank_is_named_before_the_peer_that_lost_it(tmp_path):
    run_dir = RunDir(tmp_path)
    for rank in (0, 1):
        write_pid(run_dir, rank, "node-a", 100 + rank)
    failure.write(run_dir, failure.Failure(rank=0, step=5, kind="exception",
                                           message="RuntimeError: Connection closed by peer"))
    run_dir.job_log.write_text("[...] exits with return code = -9\n")
    report = failure_report(run_dir, 1)
    silent = report.index("rank 1 (pid 101 on node-a)")
    assert "killed by SIGKILL" in report and silent < report.index("first failure: rank 0")


def test_ranks_that_finished_or_recorded_are_not_silent(tmp_path):
    run_dir = RunDir(tmp_path)
    for rank in (0, 1, 2):
        write_pid(run_dir, rank, "h", rank)
    failure.write(run_dir, failure.Failure(rank=2, step=1, kind="exception", message="boom"))
    for rank in (0, 1):  # they finished their part (job/who_failed.py)
        run_dir.rank_summary(rank).write_text("{}")
    report = failure_report(run_dir, 1)
    assert "without reporting" not in report and "first failure: rank 2 failed at step 2: boom" in report


@pytest.mark.parametrize("addr", ["127.0.0.1;touch${IFS}P;#", "$(reboot)", "a b", "-oProxyCommand=x"])
def test_master_addr_must_be_a_host(addr):
    problems = remote_shell_problems(Placement(world_size=2, master_addr=addr), cwd="/w", python="/p")
    assert [p.rule for p in problems] == ["H6"] and problems[0].fields == {"--master-addr": addr}


@pytest.mark.parametrize("addr", ["10.0.0.1", "node-1.cluster", "fe80::1", None])
def test_plain_master_addrs_pass(addr):
    assert remote_shell_problems(Placement(world_size=2, master_addr=addr), cwd="/w", python="/p") == []


def test_working_directory_and_python_must_be_plain_for_remote_shells():
    hosts = Placement(world_size=2, hostfile="hosts")
    bad = remote_shell_problems(hosts, cwd="/tmp/$(touch P)", python="/usr/bin/python3")
    assert [p.fields for p in bad] == [{"working directory": "/tmp/$(touch P)"}]
    assert remote_shell_problems(hosts, cwd="/tmp/ok", python="/opt/my env/python")[0].fields == \
        {"Python executable": "/opt/my env/python"}
    # without a hostfile nothing reaches a shell: the local launcher passes argument lists
    assert remote_shell_problems(Placement(world_size=2), cwd="/tmp/$(x)", python="/p") == []


# Failures a record explains: one line, the traceback left in the job log.

GiB = 2**30
H200_OOM = {"source": "cuda max_memory_allocated", "peak": 133 * GiB, "allocated": 131 * GiB,
            "reserved": 138 * GiB, "capacity": int(140.4 * GiB), "device": "NVIDIA H200",
            "requested": 4 * GiB}
# recipes/7b_1gpu.yaml in its 2026-11-26 layout (ZeRO-3, full checkpointing), then without
# checkpointing at micro-batch 2, the layout that does not fit an H200.
ZERO3_FULL = ["zero.stage=3", "train.activation_checkpointing=full", "train.global_batch=8"]
NO_CHECKPOINTING = ["zero.stage=3", "train.activation_checkpointing=none", "train.micro_batch=2",
                    "train.grad_accum=4", "train.global_batch=8"]  # the batch of 2026-11-26
TRACE = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: boom\n'


def _run_dir_of(tmp_path, recipe: str, overrides=()):
    """A run directory with the resolved recipe the ranks write (runtime/rank.py)."""
    from dsforge.recipe import resolve_file
    from dsforge.recipe.loader import dump_recipe
    from tests.conftest import REPO

    resolved = resolve_file(REPO / "recipes" / recipe, overrides)
    run_dir = RunDir(tmp_path)
    run_dir.recipe.write_text(dump_recipe(resolved.recipe))
    return run_dir


def test_a_build_failure_is_one_line_without_its_traceback(tmp_path):
    run_dir = RunDir(tmp_path)
    failure.write(run_dir, failure.Failure(
        rank=0, step=-1, kind="build", message="ValueError: invalid literal", detail=TRACE,
        what="DeepSpeed's fused_adam op", cause="TORCH_CUDA_ARCH_LIST='9.0a' cannot be parsed",
        fix="export TORCH_CUDA_ARCH_LIST='9.0' before dsforge run"))
    report = failure_report(run_dir, 1)
    assert ("  first failure: rank 0 failed building DeepSpeed's fused_adam op before its first "
            "step: TORCH_CUDA_ARCH_LIST='9.0a' cannot be parsed. Fix: export "
            f"TORCH_CUDA_ARCH_LIST='9.0' before dsforge run; traceback in {tmp_path / 'job.log'}") \
        in report.splitlines()
    assert "Traceback" not in report and "x.py" not in report


def test_an_exception_still_shows_the_end_of_its_traceback(tmp_path):
    run_dir = RunDir(tmp_path)
    failure.write(run_dir, failure.Failure(rank=0, step=2, kind="exception",
                                           message="ValueError: boom", detail=TRACE))
    assert 'File "x.py", line 1, in f' in failure_report(run_dir, 1)


def test_an_out_of_memory_against_the_prediction_with_the_fixes_that_fit(tmp_path):
    """The H200 7B without checkpointing at micro-batch 2: predicted 135.7 GiB of 140.4."""
    run_dir = _run_dir_of(tmp_path, "7b_1gpu.yaml", NO_CHECKPOINTING)
    failure.write(run_dir, failure.Failure(rank=0, step=3, kind="oom", detail=TRACE,
                                           message="torch.OutOfMemoryError: CUDA out of memory.",
                                           memory=H200_OOM))
    report = failure_report(run_dir, 1)
    line = next(line for line in report.splitlines() if "first failure" in line)
    assert line == (
        "  first failure: rank 0 ran out of memory at step 4: measured peak 133.0 GiB (cuda "
        "max_memory_allocated, 138.0 GiB reserved) of 140.4 GiB (NVIDIA H200); 4.0 GiB more "
        "requested; the memory model predicts 135.7 GiB (at the backward). Fix, each predicted "
        "under 126.4 GiB (90% of 140.4 GiB): --set train.micro_batch=1 --set train.grad_accum=8 "
        "(118.9 GiB); or --set train.activation_checkpointing=full (106.9 GiB); traceback in "
        f"{run_dir.job_log}")
    assert "Traceback" not in report


def test_an_out_of_memory_the_model_does_not_explain(tmp_path):
    """Predicted to fit: the memory went to another process or the allocator's fragments."""
    run_dir = _run_dir_of(tmp_path, "7b_1gpu.yaml", ZERO3_FULL)  # 106.9 GiB
    memory = {**H200_OOM, "peak": 100 * GiB, "allocated": 100 * GiB, "requested": 2 * GiB}
    advice = explain(failure.Failure(rank=0, step=3, kind="oom", message="m", memory=memory), run_dir)
    assert advice.endswith("the memory model predicts 106.9 GiB (at the optimizer step), which fits: "
                           "the rest went outside it (another process on the GPU, or "
                           "fragmentation: 138.0 GiB reserved). Fix: check nvidia-smi, or set "
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def test_an_out_of_memory_nothing_simple_fixes_or_without_a_recipe(tmp_path):
    record = failure.Failure(rank=0, step=3, kind="oom", message="m",
                             memory={**H200_OOM, "capacity": 40 * GiB})
    assert explain(record, RunDir(tmp_path)).endswith(f"no prediction: {tmp_path / 'recipe.yaml'} "
                                              "cannot be resolved")
    run_dir = _run_dir_of(tmp_path, "7b_1gpu.yaml", NO_CHECKPOINTING)
    assert explain(record, run_dir).endswith(
        "the memory model predicts 135.7 GiB (at the backward); no change of activation "
        "checkpointing, micro-batch or ZeRO stage is predicted under 36.0 GiB (90% of 40.0 GiB): "
        "`dsforge plan --search` finds layouts that fit (tp, pp, more GPUs)")


def test_bench_reasons_carry_the_cause_and_the_prediction(tmp_path):
    from dsforge.bench.run import classify

    run_dir = _run_dir_of(tmp_path, "7b_1gpu.yaml", NO_CHECKPOINTING)
    failure.write(run_dir, failure.Failure(rank=0, step=3, kind="oom", message="m", memory=H200_OOM))
    status, reason = classify(1, run_dir)
    assert status == "oom" and "the memory model predicts 135.7 GiB" in reason
    build = RunDir(tmp_path / "build")
    failure.write(build, failure.Failure(rank=0, step=-1, kind="build", message="ValueError: x",
                                         what="DeepSpeed's fused_adam op", cause="c", fix="f"))
    assert classify(1, build) == ("crashed", "rank 0 failed building DeepSpeed's fused_adam op "
                                             "before its first step: c. Fix: f")


def test_one_allocation_larger_than_the_device(tmp_path):
    run_dir = _run_dir_of(tmp_path, "7b_1gpu.yaml", ZERO3_FULL)
    memory = {**H200_OOM, "peak": GiB, "allocated": GiB, "requested": 280 * GiB}
    advice = explain(failure.Failure(rank=0, step=0, kind="oom", message="m", memory=memory), run_dir)
    assert advice.endswith("the memory model predicts 106.9 GiB (at the optimizer step), but the "
                           "rank needed 281.0 GiB, 174.1 GiB beyond it and more than the device "
                           "holds: look at the allocation in the traceback")


def test_a_job_whose_ranks_never_started_shows_the_end_of_its_log(tmp_path):
    """Ranks that fail before their supervisor runs (Python cannot import dsforge) record
    nothing: the report quotes the job log instead of only "no rank reported progress"."""
    run_dir = RunDir(tmp_path)
    run_dir.job_log.write_text("noise\n" + "Traceback (most recent call last):\n"
                               "ModuleNotFoundError: No module named 'dsforge.data.tokenizers'\n")
    report = failure_report(run_dir, 1)
    assert "no rank got as far as recording a failure; the job log ends:" in report
    assert "    ModuleNotFoundError: No module named 'dsforge.data.tokenizers'" in report


def test_a_clones_top_folder_in_the_way_of_the_ranks_imports_is_refused(tmp_path):
    """`python -m` puts the current folder first: from the folder holding a clone, ./dsforge
    (no __init__.py) would be the ranks' dsforge."""
    from dsforge.launch.checks import check_rank_imports
    from dsforge.launch.refusal import BadOptions
    from tests.conftest import REPO

    check_rank_imports(REPO)  # the package itself: fine
    check_rank_imports(tmp_path)  # no dsforge here: fine
    (tmp_path / "dsforge" / "data").mkdir(parents=True)
    with pytest.raises(BadOptions, match="a folder without __init__.py .a clone's top folder"):
        check_rank_imports(tmp_path)
