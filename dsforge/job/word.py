"""The job word: everything a rank needs, as one shell-safe word.

DeepSpeed's pdsh runner pastes its arguments and `export NAME=value` lines into a remote shell
without quoting (rules H2-H4). dsforge therefore hands each rank one argument, `--job`, that
holds the resolved recipe, the run directory, the options and the environment to forward, as
URL-safe base64 (letters, digits, '-', '_', '='): nothing from the hostfile, recipe, arguments
or environment reaches a remote shell as shell syntax. The launcher's command lines around the
word are launch/commands.py's.

Names of forwarded variables must still be valid identifiers (rule H4): the rank puts them into
its environment, and DeepSpeed's runner would paste them into a remote command line.
"""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Mapping

from dsforge.job.run_dir import RunDir
from dsforge.problems import Problem, RecipeError

# Variables forwarded to every rank (inside the job word, never through a shell).
FORWARD_PREFIXES = ("DSFORGE_", "NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "TRITON_",
                    "CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS", "PYTHONPATH")

@dataclass(frozen=True, kw_only=True)
class JobSpec:
    recipe_yaml: str
    run_dir: str
    device: str = "auto"
    backend: str = "auto"
    step_timeout_s: float = 300.0
    resume: bool = False
    # The live-tensor census after training and inside one step (dsforge bench's cells; every
    # run measures its bubble and step breakdown anyway).
    census: bool = False
    # Lines for the user marked for `dsforge run`'s reader (job/console.py); False when a plain
    # `deepspeed ... -m dsforge run` starts the ranks and they print to the terminal themselves.
    marked_output: bool = True
    # "host:pid:start" of the dsforge that started the job: ranks on that host end the job
    # when it is gone (job/owner.py); "" = nobody to watch (a plain `deepspeed` start).
    owner: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # Unix time the job started (made by `dsforge run`; a rank started by a plain `deepspeed`
    # makes its own): train.time_limit counts from it.
    started_at: float = field(default_factory=time.time)
    # Unix time this attempt was launched, when it is a restart (launch/restart.py): start-up's
    # "launch" phase counts from it. None: from started_at.
    launched_at: float | None = None
    # Started by srun (launch/slurm.py): each rank sets RANK, WORLD_SIZE, LOCAL_RANK and
    # LOCAL_SIZE from its SLURM_* variables.
    slurm: bool = False
    # The restarts before this attempt (`dsforge run --max-restarts`, launch/restart.py), each
    # as restart.restart_record makes it: rank 0 counts them in summary.json.
    restarts: list[dict] = field(default_factory=list)

    @property
    def directory(self) -> RunDir:
        """The run directory (`run_dir` is its absolute path, as the word carries it)."""
        return RunDir(self.run_dir)

    def encode(self) -> str:
        return base64.urlsafe_b64encode(json.dumps(asdict(self)).encode()).decode()

    @staticmethod
    def decode(word: str) -> "JobSpec":
        return JobSpec(**json.loads(base64.urlsafe_b64decode(word.encode())))


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k.startswith(FORWARD_PREFIXES)}
    check_names(env)
    return env


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_names(env: Mapping[str, str]) -> None:
    """Raise RecipeError (rule H4) naming every variable name a shell would misread."""
    problems = [Problem(rule="H4", fields={"variable": name},
                        message="not a valid environment variable name",
                        fix="use letters, digits and underscores, not starting with a digit")
                for name in env if not _NAME.match(name)]
    if problems:
        raise RecipeError(problems)
