"""`dsforge plan`: everything about a resolved recipe that can be known without a process.

`build_plan` gathers the layout, rank groups, engine configs and estimates into one JSON-able
dict (the --json output, whose top-level keys scripts rely on); `render_plan` prints it for
people. The engine configs are translated for one device, by default the one a run on this
machine uses, so the plan shows exactly the settings a run here gets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsforge.estimate.bubble import bubble_fraction, bubble_share_of_step
from dsforge.estimate.context_parallel import exchange_bytes, exchange_passes, step_exchange_bytes
from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.memory import largest_stage_params, training_element_bytes
from dsforge.estimate.memory_fixes import zero_at_stage
from dsforge.estimate.params import count_params
from dsforge.estimate.save_cost import save_cost
from dsforge.launch.host_pool import host_loss
from dsforge.hardware import gpu_by_key
from dsforge.problems import errors
from dsforge.recipe.resolve import Resolved
from dsforge.recipe.validate import validate
from dsforge.schema import padded_vocab_size
from dsforge.translate.compile import compiled_with
from dsforge.translate.deepspeed_config import deepspeed_config
from dsforge.translate.device import check_device
from dsforge.translate.experts import choose_experts
from dsforge.translate.groups import rank_groups
from dsforge.translate.kernels import (choose_kernels, documents_summary, liger_installed,
                                      predicted_memory)
from dsforge.translate.megatron import (gpt_model_kwargs, parallel_state_kwargs,
                                        transformer_config_kwargs)
from dsforge.translate.optimizer import adam_impl, ops_built_at_run_time
from dsforge.units import GiB, MiB, format_bytes


def plan_device(choice: str = "auto") -> str:
    """"cpu" | "cuda"; auto = what `dsforge run --device auto` picks here: cuda when a GPU is
    visible, else cpu."""
    if choice != "auto":
        check_device(choice)
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_plan(resolved: Resolved, *, device: str = "auto") -> dict[str, Any]:
    """The plan with engine configs translated for `device` ("auto" | "cpu" | "cuda")."""
    recipe, layout = resolved.recipe, resolved.layout
    asked, device = device, plan_device(device)
    model, train, zero = recipe.model, recipe.train, recipe.zero
    params = count_params(model)
    flops = flops_per_token(model, train.seq_len, train.activation_checkpointing)
    # as the launcher's fit check asks it (the fused loss, a dense document mask)
    memory = predicted_memory(resolved, device)
    warnings = [str(p) for p in resolved.warnings]
    kernels = choose_kernels(model, device=device, liger_available=liger_installed())
    # The GPU's compute capability is read by the ranks: a plan knows the device type only.
    experts = choose_experts(model, device=device, precision=train.precision, capability=None)
    plan = {
        "name": recipe.name,
        "layout": {**dataclasses.asdict(layout), "num_microbatches": layout.num_microbatches},
        "groups": rank_groups(layout),
        "nodes": _node_summary(resolved),
        "device": device,
        "device_asked": asked,
        "deepspeed": deepspeed_config(model=model, train=train, zero=zero, layout=layout, device=device),
        "megatron": {
            "parallel_state": parallel_state_kwargs(layout),
            "transformer_config": transformer_config_kwargs(model=model, train=train, layout=layout,
                                                            device=device, kernels=kernels.impl),
            "gpt_model": gpt_model_kwargs(model=model, layout=layout),
        },
        "implementations": {
            "adam": adam_impl(train=train, zero=zero, device=device),
            "built_at_run_time": list(ops_built_at_run_time(train=train, zero=zero, device=device)),
            "kernels": kernels.impl, "kernels_why": kernels.why, "sdpa_backend": model.sdpa_backend,
            "compile": compiled_with(model.compile), "fp8": train.fp8,
            **({"experts": experts.impl, "experts_why": experts.why} if experts else {}),
            **documents_summary(recipe.data, device=device,
                                 sdpa_backend=recipe.model.sdpa_backend)},
        "params": {"total": params.total, "active": params.active,
                   "padded_vocab_size": padded_vocab_size(model.vocab_size, layout.tp)},
        "flops_per_token": flops.model,
        "hardware_flops_per_token": flops.hardware,
        "memory_bytes": memory.to_dict(),
        "memory_worst_pipeline_rank": memory.pipeline_rank,
        "memory_by_zero_stage": _memory_by_stage(resolved, device),
        "gpu": _gpu_fit(resolved, memory.total, warnings),
        "bubble_fraction": bubble_fraction(layout.pp, layout.vpp, layout.num_microbatches),
        "bubble_share_of_step": bubble_share_of_step(layout.pp, layout.vpp, layout.num_microbatches),
        "data_parallel_traffic": _data_parallel_traffic(resolved),
        "context_parallel_traffic": _context_parallel_traffic(resolved),
        "checkpoint_every": train.checkpoint_every,
        "checkpoint": save_cost(resolved, device=device,
                                step_s=_predicted_step_s(resolved, device)).to_dict(),
        "host_loss": host_loss(resolved),
        "warnings": warnings,
    }
    return plan


def _predicted_step_s(resolved: Resolved, device: str) -> float | None:
    """The step-time model's seconds a step on the recipe's GPU (cluster.gpu), else None: the
    model knows GPUs only."""
    from dsforge.cost.step_time import predicted_step_time

    cluster = resolved.recipe.cluster
    if device != "cuda" or cluster is None or cluster.gpu is None:
        return None
    return predicted_step_time(resolved, cluster.gpu, cluster.gpus_per_node)["total"]


def _context_parallel_traffic(resolved: Resolved) -> dict[str, Any]:
    """Ulysses' all-to-alls (estimate/context_parallel.py): the bytes one rank sends in one
    layer's forward for one microbatch, and per step over its pipeline rank's layers."""
    m, lay, train = resolved.recipe.model, resolved.layout, resolved.recipe.train
    element_bytes = training_element_bytes(train.precision)
    tokens = lay.micro_batch * train.seq_len // lay.cp
    return {"bytes_per_layer_forward": exchange_bytes(m, lay, tokens, element_bytes),
            "passes": exchange_passes(train.activation_checkpointing),
            "bytes_per_step": step_exchange_bytes(m, lay, train.seq_len, element_bytes,
                                                  train.activation_checkpointing)}


def _data_parallel_traffic(resolved: Resolved) -> dict[str, Any]:
    """Gradient and parameter bytes one GPU of the worst pipeline rank sends over its
    data-parallel group per step (ring volume, cost/step_time.py `dp_traffic`), against ZeRO-1's
    for the same layout; whether it happens after every microbatch's backward."""
    from dsforge.cost.step_time import dp_traffic

    recipe, lay = resolved.recipe, resolved.layout
    grad_bytes = training_element_bytes(recipe.train.precision)
    worst = largest_stage_params(recipe.model, lay)
    ring = lambda d: (d - 1) / d  # noqa: E731
    unit = grad_bytes * (worst.dense * ring(lay.dp_cp) + worst.expert * ring(lay.edp))
    per_microbatch, per_step = dp_traffic(recipe.zero.stage, lay.grad_accum)
    zero1 = sum(dp_traffic(1, lay.grad_accum))
    return {"bytes_per_step": (per_microbatch + per_step) * unit,
            "vs_zero1": (per_microbatch + per_step) / zero1,
            "every_microbatch": per_microbatch > 0}


def _node_summary(resolved: Resolved) -> dict[str, Any]:
    top, tp = resolved.topology, resolved.layout.tp
    if top.node_slots is None:
        return {"node_slots": None, "tp_within_node": None}
    within = all(top.node_of(g * tp) == top.node_of(g * tp + tp - 1)
                 for g in range(top.world_size // tp))
    return {"node_slots": list(top.node_slots), "tp_within_node": within}


def _memory_by_stage(resolved: Resolved, device: str) -> dict[str, dict[str, Any]]:
    """Estimated peak bytes per GPU at ZeRO 0-3, all else unchanged, or the rules that reject it."""
    recipe = resolved.recipe
    result: dict[str, dict[str, Any]] = {}
    for stage in range(4):
        candidate = dataclasses.replace(recipe, zero=zero_at_stage(recipe.zero, stage))
        rejected = sorted({p.rule for p in errors(validate(candidate, resolved.topology))})
        total = None
        if not rejected:
            total = int(predicted_memory(dataclasses.replace(resolved, recipe=candidate),
                                         device).total)
        result[str(stage)] = {"total": total, "rejected_by": rejected}
    return result


def _gpu_fit(resolved: Resolved, total: float, warnings: list[str]) -> dict[str, Any] | None:
    cluster = resolved.recipe.cluster
    if cluster is None or cluster.gpu is None:
        return None
    gpu = gpu_by_key(cluster.gpu)
    fits = total <= gpu.memory_bytes
    if not fits:
        warnings.append(f"[FIT] estimated {total / GiB:.1f} GiB per GPU exceeds the "
                        f"{gpu.name}'s {gpu.memory_bytes / GiB:.0f} GiB. Fix: raise the ZeRO "
                        "stage, tp or pp, enable activation checkpointing, or lower micro_batch")
    return {"key": gpu.key, "name": gpu.name, "memory_bytes": gpu.memory_bytes, "fits": fits}


def render_plan(plan: dict[str, Any]) -> str:
    sections = [_render_layout(plan), _render_groups(plan), _render_model(plan),
                _render_memory(plan), _render_checkpoint(plan), _render_pipeline(plan),
                _render_data_parallel(plan), _render_deepspeed(plan)]
    if plan["warnings"]:
        sections.append("Warnings\n" + "\n".join(f"  {w}" for w in plan["warnings"]))
    return "\n\n".join(sections) + "\n"


def _render_layout(plan: dict[str, Any]) -> str:
    lay, megatron = plan["layout"], plan["megatron"]["transformer_config"]
    return (f"Plan: {plan['name']}\n"
            f"  device: {plan['device']} (the configs are translated for it: Megatron CPU "
            f"initialization {_on_off(megatron['use_cpu_initialization'])}, batched p2p "
            f"{_on_off(megatron['batch_p2p_comm'])})\n"
            + (f"  (no GPU here: --device cuda plans the recipe's {plan['gpu']['name']} ranks)\n"
               if plan["device_asked"] == "auto" and plan["device"] == "cpu" and plan["gpu"] else "")
            + f"  world {lay['world_size']} = dp {lay['dp']} x tp {lay['tp']} x pp {lay['pp']}"
            f" (x cp {lay['cp']}); vpp {lay['vpp']}; ep {lay['ep']} (etp {lay['etp']}, expert-dp {lay['edp']})\n"
            f"  sequence parallel: {'on' if lay['sequence_parallel'] else 'off'}; schedule: {lay['schedule']}\n"
            f"  batch: global {lay['global_batch']} = micro {lay['micro_batch']} x grad_accum "
            f"{lay['grad_accum']} x dp {lay['dp']}; {lay['num_microbatches']} microbatches per step\n"
            + _render_context_parallel(lay, plan["context_parallel_traffic"])
            + _render_implementations(plan["implementations"]))


def _render_context_parallel(lay: dict, traffic: dict) -> str:
    if lay["cp"] == 1:
        return ""
    again = " and recompute" if traffic["passes"] == 3 else ""
    return (f"  context parallel: each sequence split over cp {lay['cp']} ranks (Ulysses), "
            f"{lay['cp']} x fewer activations a rank; DeepSpeed's data-parallel group is dp x cp "
            f"= {lay['dp'] * lay['cp']} (its train_batch_size counts each sequence once a cp rank)\n"
            f"  context-parallel exchange: {format_bytes(traffic['bytes_per_layer_forward'])} sent "
            f"a rank per layer and microbatch in the forward, as much in the backward{again}: "
            f"{format_bytes(traffic['bytes_per_step'])} a step\n")


_ADAM = {"fused": "torch's fused AdamW", "foreach": "torch's foreach AdamW",
         "for-loop": "torch's for-loop AdamW", "deepspeed": "DeepSpeed's own Adam op"}


def _render_implementations(impl: dict[str, Any]) -> str:
    built = ", ".join(impl["built_at_run_time"])
    builds = f"builds {built} when the ranks start" if built else "builds nothing at run time"
    experts = f"; MoE experts: {impl['experts']} ({impl['experts_why']})" if "experts" in impl else ""
    compiled = f"; compiled: {impl['compile']}" if impl.get("compile", "none") != "none" else ""
    compiled += f"; float8 GEMMs: {impl['fp8']} (torchao)" if impl.get("fp8", "none") != "none" else ""
    return (f"  optimizer: {_ADAM[impl['adam']]} ({builds}); kernels: {impl['kernels']} "
            f"({impl['kernels_why']}); attention: SDPA {impl['sdpa_backend']}{experts}{compiled}"
            + _render_documents(impl.get("documents")))


def _render_documents(documents: dict | None) -> str:
    if not documents:
        return ""
    said = [what for key, what in (("reset_position_ids", "positions restart at each"),
                                   ("eod_mask_loss", "no loss where the input is the EOD"))
            if documents[key]]
    if documents["masking"]:
        said.insert(0, f"attention within each, {documents['kernel']} ({documents['kernel_why']}); "
                       f"attention FLOPs count {documents['attention_flops']}")
    return "\n  packed documents: " + "; ".join(said)


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _render_groups(plan: dict[str, Any]) -> str:
    nodes = plan["nodes"]
    if nodes["tp_within_node"] is None:
        where = "node size unknown (pass --hostfile or add a cluster: section)"
    else:
        where = "TP groups stay inside a node" if nodes["tp_within_node"] else "TP groups SPAN nodes"
    lines = [f"Rank groups (Megatron-Core RankGenerator, order tp-cp-ep-dp-pp); {where}"]
    for name, groups in plan["groups"].items():
        shown = " ".join(str(g) for g in groups[:4]).replace(" ", "").replace("][", "] [")
        more = f" ... ({len(groups)} groups)" if len(groups) > 4 else ""
        lines.append(f"  {name:>4}: {shown}{more}")
    return "\n".join(lines)


def _render_model(plan: dict[str, Any]) -> str:
    p = plan["params"]
    billions = p["total"] >= 1e8  # a tiny model's count in millions, not "0.001 B"
    scale, unit = (1e9, "B") if billions else (1e6, "M")
    return (f"Model\n  parameters: {p['total'] / scale:.3f} {unit} total, "
            f"{p['active'] / scale:.3f} {unit} active per token; vocabulary padded to "
            f"{p['padded_vocab_size']}\n"
            f"  FLOPs per token: {_flops(plan['flops_per_token'])} model (MFU), "
            f"{_flops(plan['hardware_flops_per_token'])} with recomputation (HFU)")


def _flops(n: float) -> str:
    return f"{n / 1e9:.2f} GFLOP" if n >= 1e8 else f"{n / 1e6:.2f} MFLOP"


def _render_memory(plan: dict[str, Any]) -> str:
    m = plan["memory_bytes"]
    stage = plan["deepspeed"]["zero_optimization"]["stage"]
    # GiB, or MiB where the whole peak is under one GiB (a tiny model would read 0.00 throughout)
    size, unit = (GiB, "GiB") if m["total"] >= GiB else (MiB, "MiB")
    backward = ", ".join(f"{k} {m[k] / size:.2f}"
                         for k in ("params", "grads", "bucket", "optimizer", "activations", "buffers"))
    step = (f"params {m['params'] / size:.2f}, grads {m['step_grads'] / size:.2f}, "
            + (f"bucket {m['step_bucket'] / size:.2f}, " if m["step_bucket"] else "")
            + f"optimizer {m['optimizer'] / size:.2f}, fp32 gradient and its sources {m['step_buffers'] / size:.2f}")
    lines = [f"Memory per GPU (estimate, {unit}, worst pipeline rank {plan['memory_worst_pipeline_rank']}, ZeRO {stage})",
             f"  last backward: {backward} = {m['backward_total'] / size:.2f}",
             f"  optimizer step: {step} = {m['step_total'] / size:.2f}",
             f"  peak (the {m['peak']}) {m['total'] / size:.2f}"]
    gpu = plan["gpu"]
    if gpu:
        verdict = "fits" if gpu["fits"] else "DOES NOT FIT"
        lines[-1] += f" of {gpu['memory_bytes'] / size:.0f} on {gpu['name']}: {verdict}"
    stages = " | ".join(
        f"ZeRO {s}: " + (f"{v['total'] / size:.1f}" if v["total"] is not None
                         else f"rejected ({', '.join(v['rejected_by'])})")
        for s, v in plan["memory_by_zero_stage"].items())
    lines.append(f"  by stage: {stages}")
    return "\n".join(lines)


def _render_checkpoint(plan: dict[str, Any]) -> str:
    c, every = plan["checkpoint"], plan["checkpoint_every"]
    how = "written in the background" if c["asynchronous"] else "written in the training loop"
    interval = (f"every {c['interval_steps']:,} steps ({_duration(c['interval_s'])} at "
                f"{c['step_s']:.2f} s a step)" if c["interval_steps"] else
                f"every {_duration(c['interval_s'])} (a step's time is predicted on a GPU named "
                "in cluster.gpu)")
    lines = [f"Checkpoints (estimate; {how}; now train.checkpoint_every {every or 'off'})",
             f"  a save: {format_bytes(c['total_bytes'])}, {format_bytes(c['rank_bytes'])} from the "
             f"busiest rank, {format_bytes(c['host_bytes'])} from the busiest host (held in its "
             "host memory until written" + (f", in parts of {format_bytes(c['part_bytes'])} a "
                                             "rank: train.checkpoint_staging_gb)" if c["part_bytes"]
                                             else ")"),
             f"  training stops {'at most ' if c['asynchronous'] else ''}"
             f"{_duration(c['stall_s'])} a save; the files take "
             f"{_duration(c['write_s'])} at {c['write_gbps']:g} GB/s a node",
             f"  best interval (Young/Daly, node MTBF {c['node_mtbf_hours']:,.0f} h: "
             f"{c['job_mtbf_s'] / 3600:,.0f} h for the job): "
             f"{interval}; loses {c['lost_to_saves']:.2%} to saves and {c['lost_to_failures']:.2%}"
             " to the work redone after failures"]
    loss = plan["host_loss"]
    if loss is not None:
        lines.append("  a host lost without a spare (dsforge run --max-restarts): " + (
            f"goes on with {loss['change']}" if loss["continues"] else
            f"cannot go on: {loss['why']}"))
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _render_pipeline(plan: dict[str, Any]) -> str:
    lay = plan["layout"]
    if lay["pp"] == 1:
        return "Pipeline\n  none (pp = 1): no bubble"
    formula = "(p-1)/(v*m)" if lay["vpp"] > 1 else "(p-1)/m"
    return (f"Pipeline ({lay['schedule']})\n  bubble {formula} = {plan['bubble_fraction']:.2%} of ideal "
            f"compute time; {plan['bubble_share_of_step']:.2%} of the step")


def _render_data_parallel(plan: dict[str, Any]) -> str:
    traffic, lay = plan["data_parallel_traffic"], plan["layout"]
    if not traffic["bytes_per_step"]:
        return "Data-parallel traffic\n  none (nothing is replicated over data-parallel ranks)"
    stage = plan["deepspeed"]["zero_optimization"]["stage"]
    when = {2: "a reduce-scatter after every microbatch's backward",
            3: "the parameters gathered for every microbatch's forward and backward, and a "
               "reduce-scatter after every backward"}.get(stage, "one reduction per step")
    overlap = (", not overlapped (the schedule calls the chunks)" if traffic["every_microbatch"] and lay["pp"] > 1
               else "")
    return (f"Data-parallel traffic (ZeRO {stage})\n"
            f"  {format_bytes(traffic['bytes_per_step'], 2)} per GPU per step, {traffic['vs_zero1']:.1f}x "
            f"ZeRO-1's: {when}{overlap} (docs/runtime.md)")


def _render_deepspeed(plan: dict[str, Any]) -> str:
    import json

    return f"DeepSpeed config (for {plan['device']} ranks)\n" + "\n".join(
        "  " + line for line in json.dumps(plan["deepspeed"], indent=2).splitlines())
