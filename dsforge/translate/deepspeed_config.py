"""Recipe -> DeepSpeed config dict (pure). tests/unit/test_translate.py feeds every generated
config to DeepSpeed's own DeepSpeedConfig, which must accept it.

The config depends on the device the ranks train on ("cpu" | "cuda", translate/device.py);
the CPU-only setting is marked where it is set.
"""

from __future__ import annotations

from typing import Any

from dsforge.estimate.memory import SUB_GROUP_SIZE, reduce_bucket_elements
from dsforge.recipe.resolve import Layout
from dsforge.schema import ModelConfig, TrainConfig, ZeroConfig
from dsforge.translate.device import check_device
from dsforge.translate.optimizer import optimizer_section

# The type name of dsforge's own linear-decay schedule (not one of DeepSpeed's classes).
LINEAR_DECAY = "WarmupLinearDecayLR"

# dsforge prints its own progress; keep DeepSpeed's per-step log out of the way.
_STEPS_PER_PRINT = 1_000_000


def deepspeed_config(*, model: ModelConfig, train: TrainConfig, zero: ZeroConfig, layout: Layout,
                     device: str) -> dict[str, Any]:
    """DeepSpeed's config for ranks on `device` ("cpu" | "cuda")."""
    check_device(device)
    config: dict[str, Any] = {
        # DeepSpeed checks train_batch_size == micro x grad_accum x its data-parallel size.
        # Its data-parallel size is dp x cp (runtime/assemble/engine.py MegatronMPU): each
        # sequence counts once per context-parallel shard.
        "train_batch_size": layout.global_batch * layout.cp,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "gradient_clipping": train.grad_clip,
        "steps_per_print": _STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "zero_optimization": zero_section(zero, reduce_bucket_elements(model, layout, zero.stage)),
        "optimizer": optimizer_section(train=train, zero=zero, device=device),
    }
    schedule = scheduler_section(train)
    if schedule["type"] != LINEAR_DECAY:  # DeepSpeed builds the ones it has a class for
        config["scheduler"] = schedule
    if layout.pp > 1:
        # Megatron-Core's schedule runs the backward passes, not engine.backward(); step() is
        # then the accumulation boundary that reduces, clips and updates.
        config["managed_gradient_accumulation"] = False
    config.update(precision_section(train.precision))
    return config


def precision_section(precision: str) -> dict[str, Any]:
    """Exactly one of bf16/fp16 is enabled (rule Z3); fp32 enables neither."""
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        # Dynamic loss scaling (loss_scale 0), DeepSpeed's recommended defaults.
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                         "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    return {}


def zero_section(zero: ZeroConfig, bucket_elements: int) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": zero.stage}
    if zero.stage >= 1:
        section["reduce_bucket_size"] = bucket_elements  # estimate/memory.py says why
        section["contiguous_gradients"] = True
    if zero.stage == 3:  # the fp32 gradient of the step is made one sub-group at a time: the
        section["sub_group_size"] = SUB_GROUP_SIZE  # memory model counts one (DeepSpeed's default)
    if zero.offload_optimizer == "cpu":
        # DeepSpeed then uses its own CPU Adam for the config's AdamW (translate/optimizer.py;
        # rule Z5 holds by construction: dsforge never passes a client optimizer).
        offload: dict[str, Any] = {"device": "cpu", "pin_memory": True}
        if zero.offload_ratio < 1:
            offload["ratio"] = zero.offload_ratio
        section["offload_optimizer"] = offload
    if zero.offload_params == "cpu":
        section["offload_param"] = {"device": "cpu", "pin_memory": True}
    return section


def scheduler_section(train: TrainConfig) -> dict[str, Any]:
    """The learning-rate schedule: linear warmup, then cosine / linear / no decay.

    DeepSpeed's warmup schedulers warm up over at least 2 steps (they raise 0 and 1 to 2), so
    "no warmup" is expressed as a warmup that starts at the peak (rule R2 rejects
    warmup_steps: 1). The decay ends at train.schedule_steps; past it the rate stays at its
    end: min_lr_ratio x lr for cosine and linear. Linear decay is dsforge's own class
    (runtime/assemble/schedule.py, the type `WarmupLinearDecayLR`): DeepSpeed's WarmupDecayLR
    decays toward its warmup's start and knows no floor. `deepspeed_config` leaves it out of
    DeepSpeed's config; the rank hands it to deepspeed.initialize.
    """
    if train.lr_decay == "linear":
        return {"type": LINEAR_DECAY, "params": {
            "peak_lr": train.lr, "end_lr": train.min_lr_ratio * train.lr,
            "warmup_num_steps": train.warmup_steps, "total_num_steps": train.schedule_steps}}
    warmup = max(train.warmup_steps, 1)
    start_ratio = 0.0 if train.warmup_steps else 1.0
    if train.lr_decay == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": train.schedule_steps, "warmup_num_steps": warmup,
            "warmup_min_ratio": start_ratio, "cos_min_ratio": train.min_lr_ratio,
            "warmup_type": "linear"}}
    return {"type": "WarmupLR", "params": {
        "warmup_min_lr": start_ratio * train.lr, "warmup_max_lr": train.lr,
        "warmup_num_steps": warmup, "warmup_type": "linear"}}
