"""The dsforge command: exit codes, problem lists, plan output (text and JSON), the command
lines `run --dry-run` prints for each launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dsforge.cli import main
from dsforge.job.word import JobSpec
from dsforge.launch.entry import RunOptions, deepspeed_argv
from tests.conftest import REPO

EXAMPLE = str(REPO / "recipes" / "70b_pp4.yaml")


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_validate_exits_0_for_a_valid_recipe():
    result = run("validate", EXAMPLE)
    assert result.exit_code == 0, result.output
    assert "valid for world size 32 (dp 2 x tp 4 x pp 4, grad_accum 128)" in result.output


def test_validate_exits_2_with_every_problem():
    result = run("validate", EXAMPLE, "--set", "parallel.vpp=6", "--set", "parallel.tp=3",
                 "--set", "train.precision=fp16")
    assert result.exit_code == 2
    out = result.output
    assert "errors" in out
    for rule in ("[P2]", "[L2]", "[T1]", "[Z2]"):
        assert rule in out
    assert "use parallel.vpp in {1, 2, 4, 5, 10, 20}" in out


def test_validate_with_a_hostfile_uses_its_slots():
    ok = run("validate", EXAMPLE, "--hostfile", str(REPO / "hostfiles" / "8nodes_4gpu.txt"))
    assert ok.exit_code == 0, ok.output
    wrong = run("validate", EXAMPLE, "--hostfile", str(REPO / "hostfiles" / "2nodes.txt"))
    assert wrong.exit_code == 2 and "[Y4]" in wrong.output and "total slots" in wrong.output


def test_missing_hostfile_and_both_world_options():
    assert "[H3]" in run("validate", EXAMPLE, "--hostfile", "nope.txt").output
    both_bad = run("validate", EXAMPLE, "--hostfile", "nope.txt", "--set", "train.stepz=1")
    assert "[H3]" in both_bad.output and "[Z6]" in both_bad.output
    both = run("validate", EXAMPLE, "--world-size", "32", "--hostfile", "x")
    assert both.exit_code == 2 and "not both" in both.output


def test_warnings_print_but_do_not_fail():
    result = run("validate", EXAMPLE, "--set", "cluster.nodes=16", "--set", "cluster.gpus_per_node=2")
    assert result.exit_code == 0 and "warning: [P4]" in result.output


def test_plan_json_has_the_documented_keys():
    result = run("plan", EXAMPLE, "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    for key in ("layout", "deepspeed", "megatron", "params", "flops_per_token", "memory_bytes",
                "bubble_fraction", "warnings"):
        assert key in plan
    assert set(plan["layout"]) >= {"world_size", "dp", "tp", "pp", "vpp", "ep", "grad_accum",
                                   "num_microbatches"}
    assert set(plan["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert set(plan["params"]) >= {"total", "active"}
    assert plan["megatron"]["parallel_state"]["virtual_pipeline_model_parallel_size"] == 5
    assert plan["deepspeed"]["gradient_accumulation_steps"] == 128
    assert plan["bubble_fraction"] == pytest.approx(3 / (5 * 128))
    assert plan["nodes"]["tp_within_node"] is True
    assert plan["data_parallel_traffic"]["vs_zero1"] == 1.0  # ZeRO-1: one reduction per step
    by_stage = [plan["memory_by_zero_stage"][str(s)]["total"] for s in range(4)]
    assert by_stage == sorted(by_stage, reverse=True) and by_stage[3] < by_stage[2]
    assert plan["memory_by_zero_stage"]["1"]["total"] == plan["memory_bytes"]["total"]


def test_stage_comparison_keeps_the_recipes_offload():
    args = ("plan", str(REPO / "recipes" / "7b_4gpu_zero3.yaml"), "--json")
    plain = json.loads(run(*args).output)
    offload = json.loads(run(*args, "--set", "zero.offload_optimizer=cpu").output)
    assert offload["memory_by_zero_stage"]["3"]["total"] == offload["memory_bytes"]["total"]
    assert offload["memory_bytes"]["total"] < plain["memory_bytes"]["total"]
    assert offload["memory_by_zero_stage"]["0"] == plain["memory_by_zero_stage"]["0"]


def test_plan_text_shows_layout_groups_memory_and_bubble():
    result = run("plan", EXAMPLE)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "world 32 = dp 2 x tp 4 x pp 4" in out
    assert "tp: [0,1,2,3] [4,5,6,7]" in out and "TP groups stay inside a node" in out
    assert "by stage: ZeRO 0:" in out and "ZeRO 3: rejected" not in out
    assert "Data-parallel traffic (ZeRO 1)\n  8.46 GiB per GPU per step, 1.0x ZeRO-1's" in out
    assert "bubble (p-1)/(v*m)" in out and "70.554 B total" in out
    assert '"stage": 1' in out


def test_plan_shows_the_data_parallel_traffic_of_zero_under_a_pipeline():
    """128 microbatches: ZeRO-2 moves (m+1)/2 = 64.5x ZeRO-1's bytes, ZeRO-3 3m/2 = 192x."""
    for stage, ratio in ((2, 64.5), (3, 192.0)):
        out = run("plan", EXAMPLE, "--set", f"zero.stage={stage}").output
        assert f"{ratio:.1f}x ZeRO-1's" in out and "not overlapped" in out
        plan = json.loads(run("plan", EXAMPLE, "--set", f"zero.stage={stage}", "--json").output)
        assert plan["data_parallel_traffic"]["vs_zero1"] == ratio
        assert plan["data_parallel_traffic"]["every_microbatch"] is True


def test_plan_with_overrides_and_world_size():
    result = run("plan", str(REPO / "recipes" / "tiny.yaml"), "--set", "parallel.dp=-1",
                 "--world-size", "4", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["layout"]["dp"] == 4


def test_console_script_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "dsforge", "validate", EXAMPLE],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("start", [["--hostfile", "HOSTFILE", "--no-ssh", "0", "--master-addr",
                                     "127.0.0.1"], []])
def test_ranks_started_here_are_refused_kernels_this_machine_cannot_run(tmp_path, start):
    """A local run and a --no-ssh node (and Slurm's, by the same check) refuse before any rank
    starts what their ranks could not run: here a GPU-only attention kernel on CPU ranks (K1)."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    words = [str(hostfile) if word == "HOSTFILE" else word for word in start]
    result = run("run", str(REPO / "recipes" / "tiny.yaml"), "--device", "cpu", *words,
                 "--set", "model.sdpa_backend=cudnn", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert "[K1] model.sdpa_backend='cudnn'" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("skip", [[], ["--skip-fit-check"]])
def test_a_compile_backend_torch_does_not_know_is_refused_by_name(tmp_path, monkeypatch, skip):
    """CM6 (issue 48, item 9): found before any rank starts, with the variable named (the ranks
    failed building their model, exit 1, with torch's words only); not a machine's fit, so
    --skip-fit-check does not let it through."""
    monkeypatch.setenv("DSFORGE_COMPILE_BACKEND", "indcutor")
    result = run("run", str(REPO / "recipes" / "tiny.yaml"), "--device", "cpu", *skip,
                 "--set", "model.compile=layers", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert "[CM6] DSFORGE_COMPILE_BACKEND='indcutor'" in result.output
    assert "Fix: unset DSFORGE_COMPILE_BACKEND (inductor), or set it to one of" in result.output
    assert not (tmp_path / "run").exists()


def test_a_compile_backend_is_checked_only_where_it_is_used(monkeypatch):
    from dsforge.launch.checks import compile_backend_problems
    from dsforge.recipe import resolve_file

    compiled = resolve_file(REPO / "recipes" / "tiny.yaml", ("model.compile=layers",))
    eager = resolve_file(REPO / "recipes" / "tiny.yaml")
    monkeypatch.setenv("DSFORGE_COMPILE_BACKEND", "aot_eager")  # the CPU tests' own
    assert compile_backend_problems(compiled) == []
    monkeypatch.setenv("DSFORGE_COMPILE_BACKEND", "indcutor")
    assert compile_backend_problems(eager) == []  # model.compile: none reads no backend
    assert [p.rule for p in compile_backend_problems(compiled)] == ["CM6"]


@pytest.mark.parametrize("words, expected", [
    (["--no-ssh", "0", "--master-addr", "127.0.0.1"], "--no-ssh needs --hostfile"),
    (["--hostfile", "HOSTFILE", "--no-ssh", "1"], "--no-ssh needs --master-addr"),
    (["--hostfile", "HOSTFILE", "--no-ssh", "2", "--master-addr", "127.0.0.1"],
     "--no-ssh 2: HOSTFILE names 2 host(s), so the node ranks are 0 to 1"),
    (["--no-ssh", "-1"], "Invalid value for '--no-ssh'"),
    (["--timeout", "-5"], "Invalid value for '--timeout'"),
    (["--step-timeout", "0"], "Invalid value for '--step-timeout'"),
    (["--master-port", "99999"], "Invalid value for '--master-port'"),
    (["--max-restarts", "-1"], "Invalid value for '--max-restarts'"),
    (["--hostfile", "HOSTFILE", "--no-ssh", "0", "--master-addr", "127.0.0.1", "--max-restarts",
      "2"], "--max-restarts cannot restart a --no-ssh job"),
])
def test_launch_options_that_cannot_work_are_refused_before_anything_starts(tmp_path, words, expected):
    """Each node of a --no-ssh job must name the hostfile, node 0's address and a node rank the
    hostfile has (a traceback, or ranks waiting out their timeout, before); times and ports
    are checked for range."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    words = [str(hostfile) if word == "HOSTFILE" else word for word in words]
    world = [] if "--hostfile" in words else ["--world-size", "2"]
    result = run("run", str(REPO / "recipes" / "tiny.yaml"), *world, *words,
                 "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert expected.replace("HOSTFILE", str(hostfile)) in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


def test_no_ssh_nodes_agree_on_the_port_without_being_told():
    from dsforge.launch.starts import NO_SSH_PORT, RunOptions, default_port

    assert default_port(RunOptions(recipe="r.yaml", node_rank=1)) == NO_SSH_PORT == 29500


def test_deepspeeds_local_rank_moves_behind_run():
    assert deepspeed_argv(["--local_rank=3", "run", "r.yaml", "--set", "a.b=1"]) == [
        "run", "--local_rank=3", "r.yaml", "--set", "a.b=1"]
    assert deepspeed_argv(["validate", "r.yaml"]) == ["validate", "r.yaml"]


def test_run_options_fold_the_profile_into_the_overrides():
    options = RunOptions.gather(recipe="r.yaml", overrides=("train.steps=9",), profile_steps="3:5")
    assert options.overrides == ("train.steps=9", 'tracking.profile="3:5"')
    assert RunOptions.gather(recipe="r.yaml").overrides == ()


def _job_word(output: str) -> JobSpec:
    words = output.split()
    return JobSpec.decode(words[words.index("--job") + 1])


def test_dry_run_prints_the_launchers_command_and_the_plain_deepspeed_one(tmp_path):
    run_dir = tmp_path / "run"
    result = run("run", str(REPO / "recipes" / "tiny.yaml"), "--dry-run", "--run-dir", str(run_dir),
                 "--master-port", "29555", "--step-timeout", "7", "--set", "train.steps=3")
    assert result.exit_code == 0, result.output
    launcher, comment, plain = result.output.splitlines()
    assert "-m dsforge.launch.node --nproc 2 --master_port 29555" in launcher
    assert comment == "# the same job as a plain deepspeed command:"
    assert plain.startswith("deepspeed --num_gpus 2 --master_port 29555 --module dsforge run")
    job = _job_word(launcher)
    assert (job.run_dir, job.step_timeout_s, job.slurm) == (str(run_dir.resolve()), 7.0, False)
    # Runnable by hand once this process is gone: no owner to watch, no reader for marks.
    assert not job.owner and not job.marked_output and "steps: 3" in job.recipe_yaml
    assert plain.endswith("--step-timeout 7 --set train.steps=3")  # what the ranks read
    assert not run_dir.exists()
    tiny = run("run", str(REPO / "recipes" / "70b_pp4.yaml"), "--tiny", "--dry-run",
               "--run-dir", str(run_dir))
    assert tiny.exit_code == 0, tiny.output
    assert "--tiny has no plain deepspeed form" in tiny.output  # it would train the 70B


def test_slurm_dry_run_prints_one_srun_for_every_rank(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in {"SLURM_JOB_ID": "123", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2",
                        "SLURM_JOB_NODELIST": "localhost"}.items():
        monkeypatch.setenv(name, value)
    result = run("run", str(REPO / "recipes" / "tiny.yaml"), "--launcher", "slurm", "--dry-run",
                 "--device", "cpu", "--master-addr", "node-a", "--master-port", "29555",
                 "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    srun = result.output.splitlines()[-1]
    assert srun.startswith(f"MASTER_ADDR=node-a MASTER_PORT=29555 SLURM_HOSTFILE={tmp_path}/run/"
                           "hostfiles/slurm-attempt0 srun --nodes=1 --ntasks=2 ")
    assert "a line a rank: localhost x2" in result.output
    assert _job_word(srun).slurm and _job_word(srun).device == "cpu"
    assert "Slurm job 123: 1 node, 2 tasks: 1 x 2 ranks with srun" in result.output


def test_slurm_takes_its_nodes_from_the_allocation():
    result = run("run", str(REPO / "recipes" / "tiny.yaml"), "--launcher", "slurm",
                 "--include", "node-a")
    assert result.exit_code == 2
    assert "--launcher slurm takes its nodes from the Slurm allocation; leave out --include" \
        in result.output


def test_max_restarts_is_one_option_for_run_and_sbatch():
    """Declared once (launch/run_options.py): the same range, default and help in both."""
    def option(command):
        return next(p for p in main.commands[command].params if p.name == "max_restarts")

    run_option, sbatch_option = option("run"), option("sbatch")
    assert run_option is not sbatch_option
    for field in ("help", "default", "metavar", "show_default"):
        assert getattr(run_option, field) == getattr(sbatch_option, field), field
    assert run_option.type.min == sbatch_option.type.min == 0
    assert run("sbatch", str(REPO / "recipes" / "tiny.yaml"), "--max-restarts", "-1").exit_code == 2
