"""What a rank started by srun reads from Slurm: the variables DeepSpeed's launcher would set.

`dsforge run --launcher slurm` starts one task a rank (launch/slurm.py); each task maps its own
SLURM_* variables to RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_SIZE before torch.distributed starts.
"""

from __future__ import annotations

import re
from typing import Mapping

_COUNTS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_counts(text: str) -> tuple[int, ...]:
    """Slurm's per-node counts, "2(x3),1" -> (2, 2, 2, 1); ValueError when not that form."""
    counts: list[int] = []
    for item in text.split(","):
        match = _COUNTS.match(item.strip())
        if not match:
            raise ValueError(f"{text!r} is not a Slurm count list such as 8(x2),4")
        counts += [int(match[1])] * int(match[2] or 1)
    return tuple(counts)


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a rank started by srun adds to its environment: the variables DeepSpeed's
    launcher would have set, from Slurm's. LOCAL_SIZE is this node's task count."""
    node = int(environ.get("SLURM_NODEID", 0))
    per_node = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE")
                             or environ.get("SLURM_TASKS_PER_NODE", "1"))
    return {"RANK": environ["SLURM_PROCID"],
            "WORLD_SIZE": environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"],
            "LOCAL_RANK": environ["SLURM_LOCALID"],
            "LOCAL_SIZE": str(per_node[min(node, len(per_node) - 1)])}
