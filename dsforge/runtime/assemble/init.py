"""Layout-invariant parameter initialisation.

Every parameter is drawn from a generator seeded by (seed, its global name) with its full,
unsharded shape, and this rank keeps its shard. The model therefore starts from the same
weights whatever the tp/pp/vpp/ep layout, which is what lets the tests compare a sharded run
with a single-process reference step by step (Megatron's own init adds the pipeline rank to
the seed and draws shards from per-rank RNG streams, so layouts would start differently).

The draw runs on the parameter's device. On a GPU a CPU draw was most of a rank's start-up
(~4.5 s per billion parameters on the H200 machine's host, ~30 s of the 7B's ~55 s); the
GPU's generator makes it milliseconds. The same seed gives other numbers on a GPU than on the
CPU, and torch promises one sequence only on one kind of GPU (its kernels size their grids by
the device), so layouts start equal on one kind of device, as the equivalence tests need.

`init_from_hugging_face` takes the same path with the weights of a Hugging Face folder
(model.init_from) instead of drawn ones: each rank reads the global tensor of each of its
parameters (dsforge/hf/load.py) and keeps its shard, so every layout starts from the folder.

Global names, full shapes and shards: ckpt/names.py.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from dsforge.ckpt.names import param_specs, shard
from dsforge.hf.load import HFWeights
from dsforge.runtime.assemble.vocab import VOCAB_TENSORS, pad_rows

# Output projections get the depth-scaled std (Megatron's output_layer_init_method).
_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def init_layout_invariant(chunks, *, seed: int, std: float, num_layers: int,
                          vocab_size: int) -> None:
    """`vocab_size`: the recipe's. The vocabulary tensors are drawn with that many rows and
    their padding rows are zero (vocab.py), so every tp draws the same numbers."""
    for param, spec in param_specs(chunks):
        shape = list(spec.full_shape)
        if spec.global_name in VOCAB_TENSORS:
            shape[0] = vocab_size
        full = _draw(spec.global_name, shape, param.dtype, seed,
                     _std_for(spec.global_name, std, num_layers), param.device)
        with torch.no_grad():
            param.copy_(shard(pad_rows(full, spec.full_shape[0]), spec))


def init_from_hugging_face(chunks, *, folder: str | Path, model, padded_vocab: int) -> None:
    """Every parameter from the Hugging Face folder `folder` (checked by rules I1-I5)."""
    with HFWeights(Path(folder), model, padded_vocab) as weights:
        for param, spec in param_specs(chunks):
            full = weights.full(spec.global_name)
            if tuple(full.shape) != spec.full_shape:
                raise ValueError(f"{folder}: {spec.global_name} reads as {tuple(full.shape)}, "
                                 f"the model's parameter is {spec.full_shape}")
            with torch.no_grad():
                param.copy_(shard(full, spec))


def _std_for(name: str, std: float, num_layers: int) -> float | None:
    if name.endswith(".bias"):
        return 0.0
    if "layernorm" in name or name.endswith("final_layernorm.weight") or "norm.weight" in name:
        return None  # norms start at one
    return std / math.sqrt(2.0 * num_layers) if name.endswith(_SCALED) else std


def _draw(name: str, shape: list[int], dtype, seed: int, std: float | None,
          device: torch.device = torch.device("cpu")) -> torch.Tensor:
    if std is None:
        return torch.ones(shape, dtype=dtype, device=device)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))
    drawn = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    return (drawn * std).to(dtype)
