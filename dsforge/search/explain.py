"""Why one candidate beat the next: the step-time term that separates them most, in words.

The reason names the term where the winner saves the most time, says which layout choice
causes it, and mentions the term where it loses the most, if any ("despite ..."). A layout
that is predicted slower but ranks above because it won a tie (search.rank) says so, and on
what: fewer model-parallel dimensions, a shallower pipeline, or more memory headroom.
"""

from __future__ import annotations

import dataclasses

from dsforge.cost.step_time import step_time
from dsforge.estimate.bubble import bubble_fraction
from dsforge.translate.kernels import predicted_memory
from dsforge.units import GiB, format_bytes

_NAMES = {"compute": "compute", "tp_comm": "tensor-parallel traffic", "ep_comm": "expert all-to-all",
          "cp_comm": "context-parallel all-to-all",
          "bubble": "pipeline bubble", "pp_comm": "pipeline sends", "dp_comm": "data-parallel traffic",
          "optimizer": "optimizer step"}
_ZERO_TRAFFIC = {0: "all-reduces gradients once per step", 1: "all-reduces gradients once per step",
                 2: "reduce-scatters gradients every microbatch",
                 3: "gathers parameters for every microbatch's forward and backward"}


def with_reasons(ranked: list) -> list:
    return [dataclasses.replace(r, reason=reason(r, ranked[i + 1])) if i + 1 < len(ranked) else r
            for i, r in enumerate(ranked)]


# Layout choices a reason may name (the batch and schedule follow from them).
_CHOICES = ("tp", "cp", "pp", "vpp", "ep", "dp", "zero", "micro_batch", "checkpointing",
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
    if term == "cp_comm" and "cp" in differs:
        return f"less context-parallel all-to-all traffic (cp {la['cp']} vs {lb['cp']})"
    if term == "ep_comm" and "ep" in differs:
        return f"less expert all-to-all traffic (ep {la['ep']} vs {lb['ep']})"
    changed = ", ".join(f"{k} {la[k]} vs {lb[k]}" for k in sorted(differs)) or "same layout"
    return f"less {_NAMES[term]} ({changed})"


def reason(a, b) -> str:
    """Why `a` ranks above `b`: a won tie (both tied: search.tie_key orders them, whichever is
    predicted faster), or faster predicted."""
    if a.tied and b.tied:
        return tie_reason(a, b)
    if a.tied and a.time.total > b.time.total:
        return (f"ties with the fastest within the model's +-{a.error:.1%}; the next is a slower variant "
                f"of a tied layout, whose fastest variant is listed above")
    return time_reason(a, b)


def _dimensions(r) -> str:
    used = r.parallel_dimensions()
    return f"{len(used)}: {', '.join(used)}" if used else "0"


def tie_reason(a, b) -> str:
    """Why tied `a` ranks above tied `b`: the first tie_key criterion that separates them, and
    what it costs or gains in predicted time."""
    la, lb = a.resolved.layout, b.resolved.layout
    if len(a.parallel_dimensions()) != len(b.parallel_dimensions()):
        won = f"fewer model-parallel dimensions ({_dimensions(a)} vs {_dimensions(b)})"
    elif la.pp != lb.pp:
        won = f"a shallower pipeline (pp {la.pp} vs {lb.pp})"
    elif la.vpp != lb.vpp:
        won = f"fewer virtual stages (vpp {la.vpp} vs {lb.vpp})"
    elif la.tp * la.cp * la.ep != lb.tp * lb.cp * lb.ep:
        won = (f"a smaller tensor x context x expert degree ({la.tp * la.cp * la.ep} vs "
               f"{lb.tp * lb.cp * lb.ep})")
    elif a.memory.total != b.memory.total:
        won = f"more memory headroom ({format_bytes(a.memory.total)} vs {format_bytes(b.memory.total)} per GPU)"
    else:
        won = "the same layout complexity and memory"
    change = a.time.total / b.time.total - 1
    if change > 0:
        return (f"won a tie on {won}: predicted {change:.1%} slower, but their bands of "
                f"+-{a.error:.1%} each overlap")
    return f"won a tie on {won}, and predicted {-change:.1%} faster"


def time_reason(a, b) -> str:
    """Why `a` is predicted faster than `b` (a.time.total <= b.time.total)."""
    ta, tb = a.time.to_dict(), b.time.to_dict()
    saved = {k: tb[k] - ta[k] for k in _NAMES}
    gain_term = max(saved, key=saved.get)
    if saved[gain_term] <= 1e-9 * max(tb["total"], 1e-12):
        if a.memory.total < b.memory.total:
            return f"same predicted step time, {format_bytes(b.memory.total - a.memory.total)} less memory"
        return "same predicted step time and memory"
    text = (f"{_why(gain_term, a, b)}: {_NAMES[gain_term]} {format_duration(ta[gain_term])} vs "
            f"{format_duration(tb[gain_term])}")
    loss_term = min(saved, key=saved.get)
    if saved[loss_term] < -0.01 * tb["total"]:
        text += f", despite more {_NAMES[loss_term]} (+{format_duration(-saved[loss_term])})"
    return text


_PIPELINE_TRAFFIC = {2: "reduce-scatter after every microbatch",
                     3: "parameter gathers and reduce-scatters every microbatch"}


def _at_stage(r, stage: int, profile) -> tuple:
    """(recipe, memory, step seconds) of r's layout at another ZeRO stage."""
    recipe = r.resolved.recipe
    other = dataclasses.replace(recipe, zero=dataclasses.replace(recipe.zero, stage=stage))
    at_stage = dataclasses.replace(r.resolved, recipe=other)
    return other, predicted_memory(at_stage, device="cuda"), step_time(at_stage, profile).total


def zero_pipeline_note(r, ranked: list, profile) -> str | None:
    """Why a ZeRO-2 or ZeRO-3 layout with pp > 1 and dp > 1 is listed: at a lower stage the same
    layout either does not fit (the partitioning is what makes it fit) or fits and is faster
    (then it ranks above). Lower stages are ZeRO-1 for ZeRO-2, ZeRO-1 and ZeRO-2 for ZeRO-3;
    the note names the fastest that fits, else the largest that does not. None for any other
    layout."""
    stage, lay = r.resolved.recipe.zero.stage, r.resolved.layout
    if stage not in _PIPELINE_TRAFFIC or lay.pp == 1 or lay.dp == 1:
        return None
    lower = {s: _at_stage(r, s, profile) for s in range(1, stage)}
    fitting = [s for s, (_, memory, _) in lower.items() if memory.total <= profile.usable_memory_bytes]
    other = min(fitting, key=lambda s: lower[s][2]) if fitting else stage - 1
    recipe, memory, seconds = lower[other]
    cost = (f"its {_PIPELINE_TRAFFIC[stage]} costs {format_duration(r.time.total - seconds)} per step "
            f"over ZeRO-{other}")
    if not fitting:
        split = (f"parameters {format_bytes(r.memory.params)} vs {format_bytes(memory.params)}, " if stage == 3 else "")
        return (f"needs ZeRO-{stage}: at ZeRO-{other} this layout takes {memory.total / GiB:.1f} GiB > "
                f"{profile.usable_memory_bytes / GiB:.1f} usable ({split}gradients {format_bytes(r.memory.grads)} "
                f"vs {format_bytes(memory.grads)}, bucket {format_bytes(r.memory.bucket)} vs {format_bytes(memory.bucket)}); {cost}")
    rank = next((i + 1 for i, x in enumerate(ranked) if x.resolved.recipe == recipe), None)
    where = f" (#{rank})" if rank else ""
    faster = "is faster" if seconds < r.time.total else "is predicted no faster"
    return f"ZeRO-{other} of this layout fits and {faster}{where}; {cost}"


def format_duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.001 else f"{seconds * 1e6:.0f} us"
