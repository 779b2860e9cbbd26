"""What a layer's attention keeps for its backward, counted with autograd's saved-tensor hooks:
`python -m tests.unit.helpers.saved_activations OVERRIDE...` builds the tiny recipe's model
with the overrides (one rank, on the CPU backend) and prints one JSON object: the bytes per
token that the first layer's self-attention saves (each storage once, parameters left out)
and the tokens of the microbatch. Its own process: building the model needs a process group
(test_saved_activations.py)."""

from __future__ import annotations

import json
import sys

import torch

from dsforge.calibrate.layer_timing import build_layers, recipe_shaped, synthetic_batch
from dsforge.calibrate.optimizer_timing import init_world
from dsforge.recipe import resolve_file
from tests.conftest import REPO

ATTENTION = "decoder.layers.0.self_attention"


def attention_saved_bytes(overrides: list[str]) -> dict:
    resolved = resolve_file(REPO / "recipes" / "tiny.yaml", ["parallel.dp=1", *overrides],
                            world_size=1)
    init_world(torch.device("cpu"))
    one = recipe_shaped(resolved, 1, 0)
    model, _ = build_layers(one, torch.device("cpu"))  # ModelChunks: forward runs its only chunk
    if resolved.recipe.train.precision == "bf16":
        model = model.to(torch.bfloat16)
    inside = []
    for name, module in model.named_modules():
        if name.endswith(ATTENTION):
            module.register_forward_pre_hook(lambda *_: inside.append(True))
            module.register_forward_hook(lambda *_: inside.pop() and None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if inside and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens, positions = synthetic_batch(one, torch.device("cpu"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, None, labels=tokens)
    n = tokens.numel()
    return {"tokens": n, "bytes_per_token": sum(saved.values()) / n}


if __name__ == "__main__":
    print(json.dumps(attention_saved_bytes(sys.argv[1:])))
