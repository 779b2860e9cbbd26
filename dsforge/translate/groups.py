"""Which global ranks form each parallel group, from Megatron-Core's own RankGenerator.

RankGenerator is pure Python (no process group is created), so `dsforge plan` shows exactly
the groups `initialize_model_parallel` will build for the same layout.
"""

from __future__ import annotations

import warnings

from dsforge.recipe.resolve import Layout
from dsforge.translate.megatron import RANK_ORDER


def rank_groups(layout: Layout) -> dict[str, list[list[int]]]:
    with warnings.catch_warnings():  # Megatron warns at import that TE/Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp,
                          order=RANK_ORDER)
    groups = {name: dense.get_ranks(name) for name in ("tp", "pp", "dp")}
    if layout.cp > 1:
        groups["cp"] = dense.get_ranks("cp")
    if layout.ep > 1 or layout.etp != layout.tp:
        expert = RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1,
                               order=RANK_ORDER)
        groups["ep"] = expert.get_ranks("ep")
        groups["etp"] = expert.get_ranks("tp")
        groups["edp"] = expert.get_ranks("dp")
    return groups
