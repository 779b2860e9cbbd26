"""Every parameter of a rank under its global name, with how its tensor-parallel shard joins.

A rank holds chunk-local parameters: `decoder.layers.{i}` counts the chunk's own layers and
`local_experts.{j}` the rank's own experts. The global name uses the layer's global number
(Megatron's `layer_number` is 1-based and includes the pipeline and virtual-stage offset) and
the global expert id (expert-parallel rank x experts per rank + j, as Megatron's
SequentialMLP.sharded_state_dict numbers them), so a global name means the same tensor on
every layout. That is what lets init.py draw identical weights on every layout and
checkpoints be read back on another one (dsforge/ckpt).

Shards follow Megatron's attributes: `tensor_model_parallel`, `partition_dim` and
`partition_stride`. SwiGLU's fc1 has stride 2: its full tensor is [gate; up] and rank r holds
[gate_r; up_r], so a shard is every size-th of size x stride equal pieces. Expert parameters
are split over the expert tensor-parallel group, everything else over the tensor-parallel one;
replicated parameters (norms, the router, row-parallel biases) are the same on every TP rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


def is_expert(param: torch.nn.Parameter) -> bool:
    """Megatron marks expert parameters `allreduce=False`: they are not reduced over the whole
    data-parallel group and are named by their global expert id."""
    return not getattr(param, "allreduce", True)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


@dataclass(frozen=True)
class ParamSpec:
    """Where one local parameter sits in the global model."""

    global_name: str
    full_shape: tuple[int, ...]
    tp_dim: int | None  # None: replicated over the (expert) tensor-parallel group
    stride: int
    tp_rank: int
    tp_size: int
    expert: bool

    @property
    def split(self) -> bool:
        return self.tp_dim is not None and self.tp_size > 1


def param_specs(chunks) -> list[tuple[torch.nn.Parameter, ParamSpec]]:
    """(parameter, spec) for every parameter of this rank's chunks, chunk by chunk, in
    named_parameters order (needs Megatron's parallel state)."""
    specs = []
    for chunk in chunks:
        layer_numbers = {f"decoder.layers.{i}.": layer.layer_number - 1
                         for i, layer in enumerate(chunk.decoder.layers)}
        for name, param in chunk.named_parameters():
            specs.append((param, spec_for(param, global_name(name, layer_numbers, chunk))))
    return specs


def spec_for(param, name: str) -> ParamSpec:
    from megatron.core import parallel_state as ps

    expert = is_expert(param)
    if expert:
        rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    else:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    split = getattr(param, "tensor_model_parallel", False)
    shape = list(_local_shape(param))
    if split:
        shape[param.partition_dim] *= size
    return ParamSpec(global_name=name, full_shape=tuple(shape),
                     tp_dim=param.partition_dim if split else None,
                     stride=getattr(param, "partition_stride", 1) if split else 1,
                     tp_rank=rank, tp_size=size, expert=expert)


def _local_shape(param) -> tuple[int, ...]:
    """The rank's (tensor-parallel) shape; ZeRO-3 keeps it in ds_shape and empties .shape."""
    return tuple(getattr(param, "ds_shape", param.shape))


def global_name(name: str, layer_numbers: dict[str, int], chunk) -> str:
    match = _LAYER.search(name)
    if match:
        prefix = match.group(0)
        name = name.replace(prefix, f"decoder.layers.{layer_numbers[prefix]}.", 1)
    expert = _EXPERT.search(name)
    if expert:
        from megatron.core import parallel_state as ps

        num_local = len(_experts_module(chunk).local_experts)
        global_id = ps.get_expert_model_parallel_rank() * num_local + int(expert.group(1))
        name = name.replace(expert.group(0), f"local_experts.{global_id}.", 1)
    return name


def _experts_module(chunk):
    for module in chunk.modules():
        if hasattr(module, "local_experts"):
            return module
    raise ValueError("no experts module in a chunk that has expert parameters")


def shard(full: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    """This rank's piece of the full tensor."""
    if not spec.split:
        return full
    pieces = torch.chunk(full, spec.tp_size * spec.stride, dim=spec.tp_dim)
    return torch.cat(pieces[spec.tp_rank::spec.tp_size], dim=spec.tp_dim)


def unshard(shards: list[torch.Tensor], *, dim: int | None, stride: int) -> torch.Tensor:
    """The full tensor from every rank's shard (shards[r] from tp rank r): the inverse of
    `shard`. Rank r holds pieces r, r + size, ... of the size x stride pieces."""
    if dim is None or len(shards) == 1:
        return shards[0]
    size = len(shards)
    split = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([split[i % size][i // size] for i in range(size * stride)], dim=dim)
