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

from dsforge.recipe import resolve_file
from dsforge.runtime.build.engine import build_model
from dsforge.runtime.startup import StartupClock
from dsforge.search.layer_timing import small_recipe
from dsforge.search.optimizer_timing import init_world
from tests.conftest import REPO

ATTENTION = "decoder.layers.0.self_attention"


def attention_saved_bytes(overrides: list[str]) -> dict:
    resolved = resolve_file(REPO / "recipes" / "tiny.yaml", ["parallel.dp=1", *overrides],
                            world_size=1)
    init_world(torch.device("cpu"))
    r, lay = resolved.recipe, resolved.layout
    one = small_recipe(resolved, 1, 0, micro_batch=lay.micro_batch, seq_len=r.train.seq_len)
    container, _, _ = build_model(one, device=torch.device("cpu"), backend="gloo", timeout_s=120,
                                  startup=StartupClock())
    model = container  # ModelChunks: forward runs its only chunk
    if r.train.precision == "bf16":
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

    shape = (lay.micro_batch, r.train.seq_len)
    tokens = torch.randint(0, r.model.vocab_size, shape)
    positions = torch.arange(r.train.seq_len).expand(shape)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, None, labels=tokens)
    n = shape[0] * shape[1]
    return {"tokens": n, "bytes_per_token": sum(saved.values()) / n}


if __name__ == "__main__":
    print(json.dumps(attention_saved_bytes(sys.argv[1:])))
