"""Gradient bookkeeping that Megatron-Core's finalize_model_grads would do and DeepSpeed does not.

- Sequence-parallel parameters (norm weights, MoE routers: Megatron marks them
  `sequence_parallel`; and whole experts copied on every tensor-parallel rank at ep 1 and
  etp 1, which runtime/assemble/megatron_fixes.py marks so) see only this tensor-parallel
  rank's slice of the sequence, so their
  gradients are summed over the tensor-parallel group. A tensor hook does it inside autograd,
  before the gradient is accumulated, so DeepSpeed's ZeRO hooks (which fire after
  accumulation) always see the complete gradient.
- The global gradient norm for ZeRO 0 in fp32, where DeepSpeed's clip_grad_norm_ counts
  replicated parameters on model-parallel rank 0 only (one pipeline stage) and does not sum
  expert gradients over the expert-parallel ranks (runtime/assemble/engine.py clips with it and
  skips an update whose norm is not finite).
"""

from __future__ import annotations

import torch

from dsforge.ckpt.names import is_expert


def sum_sequence_parallel_grads(module: torch.nn.Module) -> int:
    """Register the tensor-parallel gradient sum on every sequence-parallel parameter."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return 0
    group = ps.get_tensor_model_parallel_group()

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    params = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    for param in params:
        param.register_hook(all_reduce)
    return len(params)


def global_grad_norm(params, has_experts: bool) -> torch.Tensor:
    """2-norm of all gradients of the model, counting each parameter element exactly once."""
    from megatron.core import parallel_state as ps

    sums = {False: torch.zeros(()), True: torch.zeros(())}
    for p in params:
        if p.grad is None:
            continue
        expert = is_expert(p)
        tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            sums[expert] = sums[expert] + p.grad.detach().float().pow(2).sum().cpu()
    dense, expert = sums[False].to(_device(params)), sums[True].to(_device(params))
    torch.distributed.all_reduce(dense, group=ps.get_model_parallel_group())
    if has_experts:
        torch.distributed.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return (dense + expert).sqrt()


def _device(params) -> torch.device:
    return next(iter(params)).device


def clip_to_norm_(params, max_norm: float, norm: float) -> None:
    """Scale the gradients of `params`, whose global norm is `norm`, down to `max_norm`."""
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coefficient)
