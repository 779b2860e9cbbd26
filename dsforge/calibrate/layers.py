"""`dsforge calibrate`'s figures from the recipe's own layers (calibrate/layer_timing.py): the host
floors and the work outside the GEMMs and attention, as profile fields and report lines.

On a GPU the host launches kernels beside the device, so a layer's forward at a handful of
tokens is the host's floor (`host_layer_s`, `host_layer_zero3_s`), and a layer's forward and
backward at the recipe's shapes, less its GEMMs and attention (and an MoE layer's experts),
is the `other` row's work (`other_s_per_token_hidden`). On a CPU the host is the device: both
are reported, and the profile keeps neither (the refit's additive costs stand for them there).
"""

from __future__ import annotations

from dsforge.cost.profile import ClusterProfile
from dsforge.recipe.resolve import Resolved

# A layer whose forward at the recipe's shapes takes less than this many times the host's
# floor is launched as fast as the host can: its time is the host's, not the device's work.
HOST_BOUND = 1.5
# A ZeRO-3 forward at the recipe's shapes this many times its ZeRO-0 forward or more is paced
# by the host (the per-module fetches), not by the device's work.
ZERO3_PACED = 1.1
# A slope whose larger layer count took no longer (`rises`) measured noise.
NOT_RESOLVED = "not resolved: 3 layers took no longer than 1 (a busy machine?)"


def measure_layers(resolved: Resolved, on, reps: int, experts: dict | None = None) -> dict | str:
    """{"floors": per ZeRO stage, "work": the layer at the recipe's shapes}, or why they could
    not be measured: the figures before them still make a profile. `experts`: the experts
    already timed at the recipe's layout (expert_timing.time_experts), reused where the timed
    layer runs the same products. Megatron's import warnings (no Transformer Engine, no Apex)
    are not this command's lines."""
    import warnings

    from dsforge.calibrate.layer_timing import host_floors, layer_work, zero3_forward

    warnings.filterwarnings("ignore", module=r"megatron\.")
    try:
        return {"floors": host_floors(resolved, on, reps), "work": layer_work(resolved, on, reps),
                "zero3": zero3_forward(resolved, on, reps),
                "experts": _layer_experts(resolved, on, reps, experts)}
    except Exception as exc:  # reported, and the profile keeps the GPU's defaults
        return f"{type(exc).__name__}: {exc}"


def _layer_experts(resolved: Resolved, on, reps: int, experts: dict | None) -> dict | None:
    """An MoE layer's experts as the timed layer runs them (one device: every expert, the
    recipe's microbatch), to take out of its time with its GEMMs; None for a dense model.
    At a layout that already runs them so (ep, etp, tp and cp 1) `experts` is that timing."""
    from dsforge.calibrate.expert_timing import expert_shape, time_experts
    from dsforge.calibrate.kernel_timing import recipe_dtype
    from dsforge.calibrate.layer_timing import recipe_shaped

    if resolved.recipe.model.moe is None:
        return None
    timed = recipe_shaped(resolved, 1, 0)
    if experts is not None and experts["shape"] == expert_shape(timed):
        return experts
    return time_experts(timed, on, recipe_dtype(timed), reps)


def layer_fields(layers: dict | str, device_type: str, resolved: Resolved, gemm_rate: float,
                 attention: dict) -> dict:
    """The profile's floors and `other`: measured on a GPU (the GPU's defaults where they could
    not be); on a CPU no floors and no `other` (0: the compute row and the refit's additive
    costs stand for them)."""
    if device_type != "cuda":
        return {"host_layer_s": 0.0, "host_layer_zero3_s": 0.0, "other_s_per_token_hidden": 0.0}
    if isinstance(layers, str):
        return {}
    # A floor whose layers did not time longer than one is noise: the GPU's default stays.
    floors = layers["floors"]
    fields = {name: value for name, value, stage in (
        ("host_layer_s", floors[0]["per_layer_s"], 0),
        ("host_layer_zero3_s", zero3_floor(layers), 3)) if rises(floors[stage]["forward_s"])}
    other = other_work(resolved, layers, gemm_rate, attention)
    if isinstance(other, dict):
        fields["other_s_per_token_hidden"] = other["per_token_hidden_s"]
    return fields


def rises(seconds: dict[int, float]) -> bool:
    """Whether the larger layer count took longer: if not, the slope between them
    (layer_timing) is noise, a busy machine or a layer too small to time here, not a cost."""
    (_, few_s), (_, many_s) = seconds.items()
    return many_s > few_s


def zero3_floor(layers: dict) -> float:
    """`host_layer_zero3_s`: where the recipe's own ZeRO-3 forward is paced by the host
    (ZERO3_PACED), its time a layer, the floor at the recipe's shapes; else the bare layer's
    at a handful of tokens, which the recipe's forward then only bounds from above. A layer
    at the recipe's shapes can ask more of the host than a bare one: on one H200 the 7B's bare
    layer took 5.26 ms at ZeRO-3, while the GPU kit's 7B runs at ZeRO-3 and micro-batch 1 spent
    ~8 ms a layer in the forward and their refit puts the floor at 8.5 ms."""
    bare = layers["floors"][3]["per_layer_s"]
    return max(bare, layers["zero3"]["per_layer_s"]) if zero3_paced(layers) else bare


def zero3_paced(layers: dict) -> bool:
    """Whether the recipe's ZeRO-3 forward takes ZERO3_PACED times its ZeRO-0 forward or more."""
    return layers["zero3"]["per_layer_s"] >= ZERO3_PACED * layers["work"]["forward_per_layer_s"]


def other_work(resolved: Resolved, layers: dict, gemm_rate: float, attention: dict) -> dict | str:
    """One layer's forward and backward at the recipe's shapes less its GEMMs (their FLOPs at
    the measured rate) and its attention (timed alone), per token and hidden unit; or why it
    is not measured: a model that mixes dense and MoE layers (the slope between 1 and 3 layers
    is neither kind), an attention or experts without a kernel here, or a layer the host's
    launching paces. An MoE layer's experts (timed alone) and router are taken out in place of
    the dense MLP: what is left is the same work plus the tokens' dispatch and SwiGLU over
    their top_k copies."""
    m, work = resolved.recipe.model, layers["work"]
    if not rises(work["forward_backward_s"]):
        return NOT_RESOLVED
    if m.moe is not None and m.moe.frequency != 1:
        return (f"model.moe.frequency {m.moe.frequency}: the slope between 1 and 3 layers mixes "
                "dense and MoE layers")
    [timed] = attention["backends"].values()
    if "seconds" not in timed:
        return "the attention had no kernel at these shapes"
    experts = layers.get("experts") or {"seconds": 0.0}
    if "seconds" not in experts:
        return "the experts had no kernel at these shapes"
    floor = layers["floors"][0]["per_layer_s"]
    if work["forward_per_layer_s"] < HOST_BOUND * floor:
        return (f"the layer's forward ({work['forward_per_layer_s'] * 1e3:.3g} ms) is within "
                f"{HOST_BOUND}x the host's floor ({floor * 1e3:.3g} ms): host-bound at these shapes")
    gemm_s = 3 * sum(g.flops for g in _layer_gemms(m, work["tokens"])) / gemm_rate
    rest = max(0.0, work["per_layer_s"] - gemm_s - timed["seconds"] - experts["seconds"])
    return {"gemm_s": gemm_s, "attention_s": timed["seconds"], "experts_s": experts["seconds"],
            "rest_s": rest, "per_token_hidden_s": rest / (work["tokens"] * m.hidden_size)}


def _layer_gemms(m, tokens: int) -> list:
    """The dense products of one layer at one device's widths: attention's, and the MLP's or,
    in an MoE layer, the router's (the experts are timed on their own)."""
    from dsforge.calibrate.kernel_timing import Gemm, model_gemms

    gemms = [g for g in model_gemms(m, tokens) if g.name != "logits"]
    if m.moe is None:
        return gemms
    return [g for g in gemms if g.name in ("qkv", "proj")] + [
        Gemm("router", tokens, m.hidden_size, m.moe.num_experts, 1)]


def layer_lines(layers: dict | str, profile: ClusterProfile, resolved: Resolved, gemm_rate: float,
                attention: dict, on_gpu: bool) -> list[str]:
    """What was measured of the layers, for the terminal and the profile's comments."""
    from dsforge.calibrate.layer_timing import HOST_SEQ_LEN

    if isinstance(layers, str):
        return [f"the recipe's layers: not measured ({layers}); kept: host floors "
                f"{profile.host_layer_s * 1e3:.3g} ms and {profile.host_layer_zero3_s * 1e3:.3g} "
                f"ms at ZeRO-3, other_s_per_token_hidden {profile.other_s_per_token_hidden:.3g}"]
    floors = layers["floors"]
    lines = [f"the forward at {HOST_SEQ_LEN} tokens: " + ", ".join(
        f"ZeRO-{stage} {floors[stage]['per_layer_s'] * 1e3:.3g} ms a layer ("
        + ", ".join(f"{n} layer{'s' if n > 1 else ''} {t * 1e3:.3g} ms"
                    for n, t in floors[stage]["forward_s"].items())
        + ("" if rises(floors[stage]["forward_s"]) else f"; {NOT_RESOLVED}, the default kept") + ")"
        for stage in (0, 3))
        + (": host_layer_s and host_layer_zero3_s, the floors under each layer's forward" if on_gpu
           else ": on a CPU the host is the device, so these add to the compute (no floors)")]
    work = layers["work"]
    other = other_work(resolved, layers, gemm_rate, attention)
    text = (f"{other['rest_s'] * 1e3:.3g} ms beyond its GEMMs ({other['gemm_s'] * 1e3:.3g} ms at "
            f"the rate above), attention ({other['attention_s'] * 1e3:.3g} ms)"
            + (f" and experts ({other['experts_s'] * 1e3:.3g} ms)"
               if resolved.recipe.model.moe is not None else "")
            + f": {other['per_token_hidden_s']:.3g} s a token and hidden unit"
            if isinstance(other, dict) else f"the rest not measured: {other}")
    kept = ("other_s_per_token_hidden" if on_gpu and isinstance(other, dict)
            else "not in the profile" if not on_gpu else "other_s_per_token_hidden kept")
    unresolved = "" if rises(work["forward_s"]) else f" ({NOT_RESOLVED})"
    lines.append(f"a layer at {work['tokens']:,} tokens (ZeRO-0): forward "
                 f"{work['forward_per_layer_s'] * 1e3:.3g} ms{unresolved}, with the backward "
                 f"{work['per_layer_s'] * 1e3:.3g} ms; {text} ({kept})")
    return lines + [_zero3_line(layers, on_gpu)]


def _zero3_line(layers: dict, on_gpu: bool) -> str:
    zero3, zero0 = layers["zero3"]["per_layer_s"], layers["work"]["forward_per_layer_s"]
    head = (f"a layer at {layers['zero3']['tokens']:,} tokens at ZeRO-3: forward "
            f"{zero3 * 1e3:.3g} ms against {zero0 * 1e3:.3g} ms at ZeRO-0")
    if not on_gpu:
        return head + ": not in a CPU's profile (--measure's gathers term stands for it)"
    if zero3_paced(layers):
        return (head + f", paced by the host's fetches: host_layer_zero3_s "
                f"{zero3_floor(layers) * 1e3:.3g} ms, the larger of it and the bare layer's")
    return head + ", paced by the device's work: host_layer_zero3_s is the bare layer's"
