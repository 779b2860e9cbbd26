"""Which AdamW steps the optimizer, and which DeepSpeed ops a job builds at run time (pure).

`train.adam_impl` picks the implementation; `auto` resolves per device:
  - optimizer offload (zero.offload_optimizer: cpu): DeepSpeed's CPU Adam, the only optimizer
    its offload accepts (a torch optimizer raises unless zero_force_ds_cpu_optimizer is off,
    and would then step ~100x slower on the host). It is a C++ op DeepSpeed compiles on first
    use.
  - GPU ranks: torch's fused AdamW (`torch.optim.AdamW(fused=True)`): one kernel for all
    parameters, shipped with torch, so nothing is compiled at run time. DeepSpeed's FusedAdam
    computes the same update but is JIT-built on the first step, which fails on images whose
    TORCH_CUDA_ARCH_LIST DeepSpeed cannot parse ("9.0a", translate/build_env.py).
  - CPU ranks: torch's for-loop AdamW (torch's own default on CPU; bit-for-bit what every CPU
    test, study and checkpoint so far was made with).
Every torch implementation goes to DeepSpeed through its config (`torch_adam`), not as a client
optimizer, so DeepSpeed wraps it exactly as it wraps its own: ZeRO 1-3 step it on their fp32
partitions; without ZeRO in bf16/fp16 it gets DeepSpeed's FP16_UnfusedOptimizer (a fp32 copy
of each gradient; FusedAdam would get FP16_Optimizer, one flat fp32 copy); in fp32 none.
`deepspeed` asks for DeepSpeed's own op on every device (FusedAdam, or CPU Adam with offload).
"""

from __future__ import annotations

from typing import Any

from dsforge.schema import TORCH_ADAM_IMPLS, TrainConfig, ZeroConfig

# DeepSpeed op builder names (deepspeed/ops/op_builder/*.py NAME).
FUSED_ADAM = "fused_adam"
CPU_ADAM = "cpu_adam"


def adam_impl(*, train: TrainConfig, zero: ZeroConfig, device: str) -> str:
    """The implementation the ranks on `device` ("cpu" | "cuda") use: one of TORCH_ADAM_IMPLS
    or "deepspeed"."""
    if train.adam_impl != "auto":
        return train.adam_impl
    if zero.offload_optimizer == "cpu":
        return "deepspeed"
    return "fused" if device == "cuda" else "for-loop"


def optimizer_section(*, train: TrainConfig, zero: ZeroConfig, device: str) -> dict[str, Any]:
    """DeepSpeed's `optimizer` section: AdamW with the recipe's hyperparameters."""
    params: dict[str, Any] = {"lr": train.lr, "betas": [train.adam_beta1, train.adam_beta2],
                              "eps": train.adam_eps, "weight_decay": train.weight_decay}
    impl = adam_impl(train=train, zero=zero, device=device)
    if impl in TORCH_ADAM_IMPLS:
        # DeepSpeed pops torch_adam and foreach and passes the rest to torch.optim.AdamW.
        params["torch_adam"] = True
        params["foreach"] = impl == "foreach"
        if impl == "fused":
            params["fused"] = True
    return {"type": "AdamW", "params": params}


def ops_built_at_run_time(*, train: TrainConfig, zero: ZeroConfig, device: str) -> tuple[str, ...]:
    """The DeepSpeed ops the ranks compile on first use (unless DeepSpeed was installed with
    them prebuilt): what translate/build_env.py checks the machines for before any rank starts."""
    if adam_impl(train=train, zero=zero, device=device) != "deepspeed":
        return ()
    return (CPU_ADAM,) if zero.offload_optimizer == "cpu" else (FUSED_ADAM,)

