"""Measured model-state memory: every live tensor of the rank, by what it holds.

Peak memory alone (the CUDA allocator's peak, or the process's RSS on CPU) cannot say whether
the memory model's split is right. After training, activations are gone and what is alive is
the model states and DeepSpeed's buffers, so a census of live tensors (deduplicated by
storage: views and flat buffers count once) measures them on any device:

  params     the model's parameters (their ZeRO-3 partitions, `ds_tensor`, included)
  grads      the model parameters' .grad, and the gradients ZeRO 2/3 keep between backward
             passes: stage 2 accumulates the reduced gradients of the parameters in its
             partition (`all_grad_tensors`; in bf16 a compact fp32 partition inside
             `averaged_gradients`), stage 3 its flat `grad_partitions_flat_buffer`
  bucket     ZeRO's reduce bucket (`ipg_buckets`: the gradients of one backward gathered for
             a reduce-scatter, `reduce_bucket_size` elements)
  optimizer  the optimizer's own parameters (ZeRO's fp32 master partitions) and its state
             (Adam's m and v), through DeepSpeed's wrapper to the torch optimizer
  step_grads the gradients of the optimizer's own parameters: the fp32 gradient DeepSpeed
             makes for the optimizer step (its partition, or one ZeRO-3 sub-group of it)
  other      everything else still alive: communication buffers, RNG states, ...
A storage that backs both a parameter and the optimizer (fp32 ZeRO-0: the optimizer steps
the model's own tensors) counts as params.
"""

from __future__ import annotations

import gc
import warnings
from typing import Iterator

import torch


def _optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """DeepSpeed wraps the torch optimizer (`.optimizer`), sometimes twice."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)


def innermost_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that DeepSpeed's wrappers step."""
    return list(_optimizers(optimizer))[-1]


def _key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr()) if storage.nbytes() else None


def _add(owner: dict, tensors, kind: str) -> None:
    for t in tensors:
        if torch.is_tensor(t):
            key = _key(t)
            if key is not None:
                owner.setdefault(key, kind)


def _tensors(held) -> Iterator:
    """The tensors in an attribute that holds a tensor, a list or a dict of them (or None), or
    DeepSpeed's GradPartitionBufferGroup (its `flat_partition`)."""
    if isinstance(held, dict):
        held = list(held.values())
    if isinstance(held, (list, tuple)):
        for item in held:
            yield from _tensors(item)
    elif torch.is_tensor(held):
        yield held
    elif getattr(held, "flat_partition", None) is not None:
        yield held.flat_partition


_ZERO_GRADIENTS = ("grads_in_partition", "all_grad_tensors", "averaged_gradients",
                   "grad_partitions_flat_buffer")


def _zero_gradients(zero) -> Iterator:
    for name in _ZERO_GRADIENTS:
        yield from _tensors(getattr(zero, name, None))


def _zero_buckets(zero) -> Iterator:
    for bucket in (getattr(zero, "ipg_buckets", None) or {}).values():
        yield from _tensors(getattr(bucket, "buffer", None))


def _owners(engine) -> dict:
    owner: dict = {}
    params = list(engine.module.parameters())
    _add(owner, params, "params")
    _add(owner, [getattr(p, "ds_tensor", None) for p in params], "params")
    zero = getattr(engine, "optimizer", None)
    # The bucket first: during a backward ZeRO points .grad into it (contiguous_gradients).
    _add(owner, _zero_buckets(zero), "bucket")
    _add(owner, [p.grad for p in params], "grads")
    _add(owner, _zero_gradients(zero), "grads")
    for optimizer in _optimizers(getattr(engine, "optimizer", None)):
        for group in optimizer.param_groups:
            _add(owner, group["params"], "optimizer")
            _add(owner, [p.grad for p in group["params"]], "step_grads")
        for state in optimizer.state.values():
            _add(owner, state.values(), "optimizer")
    return owner


def live_tensor_bytes(engine, device: torch.device) -> dict[str, int]:
    """Bytes of live tensor storage on `device`, by params / grads / bucket / optimizer /
    step_grads / other."""
    owner = _owners(engine)
    sizes: dict = {}
    with warnings.catch_warnings():  # touching every object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not torch.is_tensor(obj) or obj.device.type != device.type:
                    continue
                key = _key(obj)
            except Exception:  # objects that only look like tensors (meta, fakes)
                continue
            if key is not None:
                sizes[key] = obj.untyped_storage().nbytes()
    totals = {"params": 0, "grads": 0, "bucket": 0, "optimizer": 0, "step_grads": 0, "other": 0}
    for key, nbytes in sizes.items():
        totals[owner.get(key, "other")] += nbytes
    totals["total"] = sum(totals.values())
    return totals
