"""Layout-invariant parameter initialisation.

Every parameter is drawn from a generator seeded by (seed, its global name) with its full,
unsharded shape, and this rank keeps its shard. The model therefore starts from the same
weights whatever the tp/pp/vpp/ep layout, which is what lets the tests compare a sharded run
with a single-process reference step by step (Megatron's own init adds the pipeline rank to
the seed and draws shards from per-rank RNG streams, so layouts would start differently).

Global names: `decoder.layers.{i}` uses the layer's global number (Megatron's layer_number
is 1-based and includes the pipeline offset); local experts map to global expert ids.
Shards follow Megatron's attributes: `tensor_model_parallel`, `partition_dim` and
`partition_stride` (SwiGLU's fc1 holds [gate; up] shards with stride 2).
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")
# Output projections get the depth-scaled std (Megatron's output_layer_init_method).
_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def init_layout_invariant(chunks, *, seed: int, std: float, num_layers: int) -> None:
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        layer_numbers = {f"decoder.layers.{i}.": layer.layer_number - 1
                         for i, layer in enumerate(chunk.decoder.layers)}
        for name, param in chunk.named_parameters():
            full_name = _global_name(name, layer_numbers, chunk)
            expert = not getattr(param, "allreduce", True)
            tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            tp_size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
            full = _draw(full_name, _full_shape(param, tp_size), param.dtype, seed,
                         _std_for(full_name, std, num_layers))
            with torch.no_grad():
                param.copy_(_shard(full, param, tp_rank, tp_size))


def _global_name(name: str, layer_numbers: dict[str, int], chunk) -> str:
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


def _std_for(name: str, std: float, num_layers: int) -> float | None:
    if name.endswith(".bias"):
        return 0.0
    if "layernorm" in name or name.endswith("final_layernorm.weight") or "norm.weight" in name:
        return None  # norms start at one
    return std / math.sqrt(2.0 * num_layers) if name.endswith(_SCALED) else std


def _full_shape(param, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def _draw(name: str, shape: list[int], dtype, seed: int, std: float | None) -> torch.Tensor:
    if std is None:
        return torch.ones(shape, dtype=dtype)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(dtype)


def _shard(full: torch.Tensor, param, rank: int, size: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)
