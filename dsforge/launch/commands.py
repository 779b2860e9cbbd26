"""The job word's one constructor (`job_spec`, every job dsforge starts is made by it) and the
launcher's command lines around the word (job/word.py).

DeepSpeed's pdsh runner pastes its arguments and `export NAME=value` lines into a remote shell
without quoting (rules H2-H4). dsforge therefore hands each rank one argument, `--job`, that
holds the resolved recipe, the run directory, the options and the environment to forward, as
URL-safe base64 (letters, digits, '-', '_', '='): nothing from the hostfile, recipe, arguments
or environment reaches a remote shell as shell syntax. The DeepSpeed runner itself is started
without the environment variables it would export unquoted, unless their values are plain.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dsforge.job.owner import current_owner
from dsforge.job.run_dir import RunDir
from dsforge.job.word import JobSpec
from dsforge.problems import Problem
from dsforge.recipe import Resolved
from dsforge.recipe.loader import dump_recipe

DEEPSPEED_RUNNER = "deepspeed.launcher.runner"  # the module over a hostfile's hosts
# Prefixes DeepSpeed's runner exports itself (runner.EXPORT_ENVS + the CUDA accelerator's).
DEEPSPEED_EXPORTS = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
_PLAIN = re.compile(r"^[A-Za-z0-9_./:=,+@%-]*$")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the ranks go: this machine (world_size) or a hostfile (DeepSpeed's runner)."""

    world_size: int
    hostfile: str | None = None
    launcher: str = "pdsh"
    include: str = ""
    exclude: str = ""
    master_addr: str | None = None
    master_port: int = 29500
    node_rank: int | None = None  # with --no-ssh: which node this process starts


def job_spec(resolved: Resolved, run_dir: RunDir, *, owned: bool = True, **options) -> JobSpec:
    """The job word for `resolved` trained in `run_dir`, with JobSpec's `options` (device,
    backend, step_timeout_s, resume, env, ...). `owned`: its ranks end themselves when this
    process is gone (job/owner.py); not for ranks a plain `deepspeed` command started."""
    return JobSpec(recipe_yaml=dump_recipe(resolved.recipe),
                   run_dir=str(run_dir.absolute()),
                   owner=current_owner() if owned else "", **options)


def runner_env(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The DeepSpeed runner's environment: without variables it would export unquoted whose
    values are not plain (they reach the ranks through the job word instead), and with its
    .deepspeed_env file lookup pointed at nothing."""
    dropped = [k for k, v in environ.items() if k.startswith(DEEPSPEED_EXPORTS) and not _PLAIN.match(v)]
    env = {k: v for k, v in environ.items() if k not in dropped}
    env["DS_ENV_FILE"] = "/nonexistent/dsforge-forwards-env-in-the-job-word"
    return env, dropped


# A host name or an IPv4/IPv6 address, nothing a shell would read as syntax.
_ADDRESS = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|[0-9A-Fa-f:.]+)$")


def remote_shell_problems(placement: Placement, *, cwd: str, python: str) -> list[Problem]:
    """H6: what DeepSpeed's multi-node runners paste into a remote shell unquoted, beyond the
    job word: the working directory (`cd CWD;`, and PYTHONPATH), the Python executable and
    --master-addr. Each must be plain, or dsforge refuses to launch."""
    problems = []
    if placement.master_addr is not None and not _ADDRESS.match(placement.master_addr):
        problems.append(Problem(rule="H6", fields={"--master-addr": placement.master_addr},
                                message="not a host name or IP address",
                                fix="give the first node's host name or address, e.g. 10.0.0.1"))
    if placement.hostfile is None:
        return problems  # no remote shell: the local launcher passes arguments as a list
    for name, value in (("working directory", cwd), ("Python executable", python)):
        if not _PLAIN.match(value):
            problems.append(Problem(
                rule="H6", fields={name: value},
                message="DeepSpeed's runner pastes it unquoted into every node's shell, where "
                        "characters outside letters, digits and _./:=,+@%- would run as commands",
                fix="start dsforge from a directory and with a Python whose paths are plain"))
    return problems


def launch_command(placement: Placement, job: JobSpec) -> list[str]:
    """The command that starts the job's ranks: on this machine dsforge's own launcher
    (`python -m dsforge.launch.node --nproc N ...`, launch/node.py); over a hostfile DeepSpeed's
    runner (`python -m deepspeed.launcher.runner --hostfile H ...`); each then runs
    `-m dsforge.runtime.rank --job WORD` as every rank."""
    if placement.hostfile is None:  # the ranks meet on 127.0.0.1, as DeepSpeed's runner has them
        return [sys.executable, "-u", "-m", "dsforge.launch.node", "--nproc",
                str(placement.world_size), "--master_port", str(placement.master_port),
                "--module", "dsforge.runtime.rank", "--job", job.encode()]
    # dsforge's preflight has checked every host; DeepSpeed's own check tries only the first
    # one, with plain ssh options.
    checked = ["--no_ssh_check"] if placement.node_rank is None else []
    return [sys.executable, "-u", "-m", DEEPSPEED_RUNNER, *placement_flags(placement, checked),
            "--module", "dsforge.runtime.rank", "--job", job.encode()]


def placement_flags(placement: Placement, extra: list[str] | None = None) -> list[str]:
    """DeepSpeed launcher's options for where the ranks run, one place for both command lines:
    the GPUs of this machine, or a hostfile's hosts (with --include/--exclude, `--no_ssh` for
    one node's part, else `--force_multi`: a hostfile or --include that leaves one host still
    runs there, not on this machine, as DeepSpeed would do); `extra` joins the multi-host
    options; the master's address and port."""
    if placement.hostfile is None:
        words = ["--num_gpus", str(placement.world_size)]
    else:
        words = ["--hostfile", placement.hostfile, "--launcher", placement.launcher]
        words += ["--include", placement.include] if placement.include else []
        words += ["--exclude", placement.exclude] if placement.exclude else []
        if placement.node_rank is not None:
            words += ["--no_ssh", "--node_rank", str(placement.node_rank)]
        else:
            words += [*(extra or []), "--force_multi"]
    words += ["--master_addr", placement.master_addr] if placement.master_addr else []
    return words + ["--master_port", str(placement.master_port)]


def plain_deepspeed_command(placement: Placement, recipe: Path, run_dir: RunDir,
                            overrides: tuple[str, ...], run_options: tuple[str, ...] = ()) -> str:
    """The same job as a `deepspeed` command a user can paste: DeepSpeed starts `dsforge run`
    on every rank, which then acts as the rank program; `run_options`: the `dsforge run`
    options the ranks read (device, backend, step timeout)."""
    words = ["deepspeed", *placement_flags(placement), "--module", "dsforge", "run",
             str(recipe), "--run-dir", str(run_dir), *run_options]
    for item in overrides:
        words += ["--set", item]
    return shlex.join(words)
