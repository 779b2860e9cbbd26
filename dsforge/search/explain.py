"""Why one candidate beat the next: the step-time term that separates them most, in words.

The reason names the term where the winner saves the most time, says which layout choice
causes it, and mentions the term where it loses the most, if any ("despite ...").
"""

from __future__ import annotations

import dataclasses

from dsforge.estimate.bubble import bubble_fraction
from dsforge.estimate.memory import estimate_memory
from dsforge.search.cost import step_time

_NAMES = {"compute": "compute", "tp_comm": "tensor-parallel traffic", "ep_comm": "expert all-to-all",
          "bubble": "pipeline bubble", "pp_comm": "pipeline sends", "dp_comm": "data-parallel traffic",
          "optimizer": "optimizer step"}
_ZERO_TRAFFIC = {0: "all-reduces gradients once per step", 1: "all-reduces gradients once per step",
                 2: "reduce-scatters gradients every microbatch",
                 3: "gathers parameters for every microbatch's forward and backward"}


def with_reasons(ranked: list) -> list:
    return [dataclasses.replace(r, reason=reason(r, ranked[i + 1])) if i + 1 < len(ranked) else r
            for i, r in enumerate(ranked)]


# Layout choices a reason may name (the batch and schedule follow from them).
_CHOICES = ("tp", "pp", "vpp", "ep", "dp", "zero", "micro_batch", "checkpointing",
            "sequence_parallel", "grad_accum")


def _why(term: str, a, b) -> str:
    la, lb = a.layout_row(), b.layout_row()
    differs = {k for k in _CHOICES if la[k] != lb[k]}
    if term == "compute":
        if "checkpointing" in differs:
            return f"recomputes less (checkpointing {la['checkpointing']} vs {lb['checkpointing']})"
        if "tp" in differs:
            return f"wider GEMMs per GPU (tp {la['tp']} vs {lb['tp']})"
        if "micro_batch" in differs:
            return f"longer microbatches ({la['micro_batch']} vs {lb['micro_batch']} sequences)"
    if term == "tp_comm" and "tp" in differs:
        return f"fewer tensor-parallel all-reduces per GPU (tp {la['tp']} vs {lb['tp']})"
    if term == "bubble":
        fa = bubble_fraction(la["pp"], la["vpp"], la["grad_accum"])
        fb = bubble_fraction(lb["pp"], lb["vpp"], lb["grad_accum"])
        return (f"a smaller pipeline bubble, (p-1)/(v m) = {fa:.1%} vs {fb:.1%} "
                f"(pp {la['pp']}/{lb['pp']}, vpp {la['vpp']}/{lb['vpp']}, m {la['grad_accum']}/{lb['grad_accum']})")
    if term == "dp_comm":
        if "zero" in differs and _ZERO_TRAFFIC[la["zero"]] != _ZERO_TRAFFIC[lb["zero"]]:
            return f"ZeRO-{la['zero']} {_ZERO_TRAFFIC[la['zero']]}, ZeRO-{lb['zero']} {_ZERO_TRAFFIC[lb['zero']]}"
        span_a, span_b = la["tp"] * la["dp"], lb["tp"] * lb["dp"]
        per_node = a.resolved.topology.node_slots[0] if a.resolved.topology.node_slots else None
        if per_node and span_a <= per_node < span_b:
            return "data-parallel traffic stays inside the node"
        return f"less gradient traffic per GPU (tp x pp {la['tp'] * la['pp']} vs {lb['tp'] * lb['pp']})"
    if term == "pp_comm":
        if "sequence_parallel" in differs and la["sequence_parallel"]:
            return f"sequence parallelism splits each pipeline message over tp {la['tp']}"
        return f"fewer pipeline sends (m x v = {la['grad_accum'] * la['vpp']} vs {lb['grad_accum'] * lb['vpp']} per neighbour)"
    if term == "optimizer" and "zero" in differs:
        return f"a smaller optimizer partition to update (ZeRO-{la['zero']} vs ZeRO-{lb['zero']})"
    if term == "ep_comm" and "ep" in differs:
        return f"less expert all-to-all traffic (ep {la['ep']} vs {lb['ep']})"
    changed = ", ".join(f"{k} {la[k]} vs {lb[k]}" for k in sorted(differs)) or "same layout"
    return f"less {_NAMES[term]} ({changed})"


def reason(a, b) -> str:
    """Why `a` ranks above `b` (a.time.total <= b.time.total)."""
    ta, tb = a.time.to_dict(), b.time.to_dict()
    saved = {k: tb[k] - ta[k] for k in _NAMES}
    gain_term = max(saved, key=saved.get)
    if saved[gain_term] <= 1e-9 * max(tb["total"], 1e-12):
        if a.memory.total < b.memory.total:
            return f"same predicted step time, {_bytes(b.memory.total - a.memory.total)} less memory"
        return "same predicted step time and memory"
    text = (f"{_why(gain_term, a, b)}: {_NAMES[gain_term]} {format_duration(ta[gain_term])} vs "
            f"{format_duration(tb[gain_term])}")
    loss_term = min(saved, key=saved.get)
    if saved[loss_term] < -0.01 * tb["total"]:
        text += f", despite more {_NAMES[loss_term]} (+{format_duration(-saved[loss_term])})"
    return text


def zero2_pipeline_note(r, ranked: list, profile) -> str | None:
    """Why a ZeRO-2 layout with pp > 1 and dp > 1 is listed: the same layout at ZeRO-1 either
    does not fit (ZeRO-2's partitioned gradients are what make it fit) or fits and is faster
    (then it ranks above). None for any other layout."""
    recipe, lay = r.resolved.recipe, r.resolved.layout
    if recipe.zero.stage != 2 or lay.pp == 1 or lay.dp == 1:
        return None
    zero1 = dataclasses.replace(recipe, zero=dataclasses.replace(recipe.zero, stage=1))
    memory1 = estimate_memory(model=recipe.model, train=recipe.train, zero=zero1.zero, layout=lay)
    time1 = step_time(dataclasses.replace(r.resolved, recipe=zero1), profile).total
    cost = (f"its reduce-scatter after every microbatch costs {format_duration(r.time.total - time1)} "
            f"per step over ZeRO-1")
    grads = (f"gradients {_bytes(r.memory.grads)} vs {_bytes(memory1.grads)} (+ a "
             f"{_bytes(r.memory.bucket)} bucket in both)")
    if memory1.total > profile.usable_memory_bytes:
        return (f"needs ZeRO-2: at ZeRO-1 this layout takes {memory1.total / 2**30:.1f} GiB > "
                f"{profile.usable_memory_bytes / 2**30:.1f} usable ({grads}); {cost}")
    rank = next((i + 1 for i, x in enumerate(ranked) if x.resolved.recipe == zero1), None)
    where = f" (#{rank})" if rank else ""
    return f"ZeRO-1 of this layout fits and is faster{where}; {cost}"


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**29 else f"{n / 2**20:.1f} MiB"


def format_duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.001 else f"{seconds * 1e6:.0f} us"
