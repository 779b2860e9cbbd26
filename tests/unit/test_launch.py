"""Launch plumbing without processes: the job word, environment safety, commands, filters."""

from __future__ import annotations

import re
import shlex

import pytest

from dsforge.job.run_dir import RunDir
from dsforge.job.word import JobSpec, forwarded_env
from dsforge.launch.commands import Placement, launch_command, plain_deepspeed_command, runner_env
from dsforge.launch.preflight import ssh_command, version_problems
from dsforge.problems import RecipeError
from dsforge.recipe.hostfile import active_hosts, parse_hostfile

NASTY = "$(touch /tmp/pwned) `id` 'single' \"double\" ; | & \\ \n newline"


def test_job_word_is_shell_safe_and_round_trips():
    job = JobSpec(recipe_yaml="name: x\n", run_dir="/runs/a b$c", env={"DSFORGE_X": NASTY},
                  resume=True, step_timeout_s=12.5)
    word = job.encode()
    assert re.fullmatch(r"[A-Za-z0-9_=-]+", word)
    assert shlex.split(word) == [word]  # a shell sees one plain word
    assert JobSpec.decode(word) == job


def test_forwarded_environment_is_an_allow_list():
    env = forwarded_env({"DSFORGE_A": "1", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "HOME": "/root",
                         "SECRET_TOKEN": "s", "OMP_NUM_THREADS": "2"})
    assert env == {"DSFORGE_A": "1", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "OMP_NUM_THREADS": "2"}


def test_runner_env_drops_unsafe_values_deepspeed_would_export_unquoted():
    env, dropped = runner_env({"PYTHONPATH": "/a b/$(id)", "PYTHONHASHSEED": "0", "PATH": "/bin",
                               "NCCL_SOCKET_IFNAME": "eth0"})
    assert dropped == ["PYTHONPATH"]
    assert env["PYTHONHASHSEED"] == "0" and env["NCCL_SOCKET_IFNAME"] == "eth0" and env["PATH"] == "/bin"
    assert env["DS_ENV_FILE"].startswith("/nonexistent/")  # no .deepspeed_env exports either


def test_launch_commands():
    job = JobSpec(recipe_yaml="x", run_dir="/r")
    local = launch_command(Placement(world_size=4, master_port=1234), job)
    assert local[3:11] == ["dsforge.launch.node", "--nproc", "4", "--master_port", "1234",
                           "--module", "dsforge.runtime.rank", "--job"]
    multi = launch_command(Placement(world_size=16, hostfile="h", include="a@b", master_addr="10.0.0.1",
                                     master_port=5), job)
    assert ["--hostfile", "h", "--launcher", "pdsh", "--include", "a@b", "--no_ssh_check",
            "--force_multi"] == multi[4:12]  # an --include leaving one host still runs there
    no_ssh = launch_command(Placement(world_size=2, hostfile="h", node_rank=1, master_port=5), job)
    assert "--no_ssh" in no_ssh and no_ssh[no_ssh.index("--node_rank") + 1] == "1"
    assert "--force_multi" not in no_ssh  # this node's ranks, here
    assert no_ssh[-2:] == ["--job", job.encode()]


def test_the_plain_deepspeed_command_is_the_same_job():
    """What reaches the ranks: node 0's address, a --no-ssh node's place (not a pdsh launch),
    and the dsforge run options the ranks read."""
    text = plain_deepspeed_command(
        Placement(world_size=2, hostfile="h", master_addr="10.0.0.1", master_port=7, node_rank=1),
        recipe="r.yaml", run_dir=RunDir("runs/x"), overrides=(), run_options=("--device", "cpu"))
    assert shlex.split(text) == ["deepspeed", "--hostfile", "h", "--launcher", "pdsh", "--no_ssh",
                                 "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port",
                                 "7", "--module", "dsforge", "run", "r.yaml", "--run-dir", "runs/x",
                                 "--device", "cpu"]


def test_plain_deepspeed_command_quotes_everything():
    text = plain_deepspeed_command(Placement(world_size=2, hostfile="my hosts", master_port=7),
                                   recipe="r.yaml", run_dir=RunDir("runs/x"),
                                   overrides=("train.lr=1e-3",))
    assert shlex.split(text) == ["deepspeed", "--hostfile", "my hosts", "--launcher", "pdsh",
                                 "--force_multi", "--master_port", "7", "--module", "dsforge", "run", "r.yaml",
                                 "--run-dir", "runs/x", "--set", "train.lr=1e-3"]


def test_include_exclude_use_deepspeeds_parser():
    hostfile = parse_hostfile(["a slots=4", "b slots=4"])
    assert active_hosts(hostfile, include="a:0,1@b").hosts == (("a", 2), ("b", 4))
    assert active_hosts(hostfile, exclude="b").hosts == (("a", 4),)
    with pytest.raises(RecipeError, match=r"\[H5\].*not found in hostfile"):
        active_hosts(hostfile, include="c")


def test_preflight_ssh_uses_pdsh_options(monkeypatch):
    monkeypatch.setenv("PDSH_SSH_ARGS", "-F /cfg -x -l%u %h")
    command = ssh_command("node-a", ["python", "-c", "print(1)"], timeout_s=5)
    assert command[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    assert command[5:8] == ["-F", "/cfg", "-x"] and command[-2] == "node-a"
    assert command[-1] == "python -c 'print(1)'"
    monkeypatch.delenv("PDSH_SSH_ARGS")
    assert ssh_command("h", ["true"], 3)[-2:] == ["h", "true"]


def test_version_mismatch_names_host_and_package():
    local = {"torch": "2.13.0", "deepspeed": "0.19.8", "megatron-core": "0.16.1", "dsforge": "0.1.0",
             "liger-kernel": None}
    here = {name: (version, "here") for name, version in local.items()}
    problems = version_problems("node-b", {**local, "deepspeed": "0.18.0"}, here)
    assert [str(p) for p in problems] == [
        "[F3] host='node-b', package='deepspeed': deepspeed 0.18.0 there, 0.19.8 here. Fix: install "
        "the same versions on every host (pip install -e . with the same pins), or exclude the host"]
    # kernels auto picks Liger where it is installed: a host that has it and one that has not
    # would train different kernels; it is compared with the first host, not the launcher
    among_hosts = {**here, "liger-kernel": ("0.8.5", "on node-a")}
    (liger,) = version_problems("node-b", local, among_hosts)
    assert str(liger).startswith("[F3] host='node-b', package='liger-kernel': liger-kernel None "
                                 "there, 0.8.5 on node-a.")
    assert version_problems("node-b", {**local, "liger-kernel": "0.8.5"}, among_hosts) == []
