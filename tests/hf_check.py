"""Shared by the export tests: dsforge's own model in one child interpreter, and the logits of an
exported folder loaded by transformers.

dsforge's model is built with Megatron-Core in a child (the CPU backend patches the whole
process, and Megatron's import is seconds a test process does not need):
- tests/unit/test_hf_export.py builds models from recipes (its own child, using
  `single_process` and `build_chunk`);
- `python -m tests.hf_check CHECKPOINT_DIR OUT.pt` builds the model a checkpoint's recipe
  describes as one process (tp1, pp1, ep1: its parameter names are the global names), loads
  every parameter from the checkpoint's layout-free state (dsforge.ckpt.reader: the fp32
  master weights joined from whatever layout saved them; the vocabulary tensors' padding rows
  dropped or added for tp 1, as a resume does) and saves the logits on TOKENS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# Two 12-token sequences, every id below 250 (the smallest vocabulary the tests export).
TOKENS = [[3, 17, 250 - 1, 42, 0, 99, 128, 7, 64, 200, 31, 5],
          [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 249, 100]]
TOLERANCE = 1e-4  # max |logit difference|, fp32


def single_process(store: Path) -> None:
    """This process as a world of one with Megatron's parallel state (tp1, pp1, ep1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dsforge.runtime.assemble import cpu_backend, megatron_fixes

    megatron_fixes.apply()
    cpu_backend.activate()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                         world_size=1)
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)


def build_chunk(resolved):
    """dsforge's model (one chunk) for a resolved one-process recipe, and its padded vocabulary."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from dsforge.runtime.assemble.model import build_model_chunks
    from dsforge.translate.experts import choose_experts
    from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                            transformer_config_kwargs)

    get_moe_layer_wise_logging_tracker().clear()
    r = resolved.recipe
    config = build_transformer_config(transformer_config_kwargs(
        model=r.model, train=r.train, layout=resolved.layout, device="cpu"))
    gpt_kwargs = gpt_model_kwargs(model=r.model, layout=resolved.layout)
    experts = choose_experts(r.model, device="cpu", precision=r.train.precision, capability=None)
    (chunk,) = build_model_chunks(config, gpt_kwargs, torch.device("cpu"),
                                  vocab_size=r.model.vocab_size,
                                  experts=experts.impl if experts else "sequential")
    return chunk, gpt_kwargs["vocab_size"]


def logits(chunk, tokens=TOKENS) -> torch.Tensor:
    chunk.eval()
    tokens = torch.tensor(tokens)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return chunk(tokens, positions, None).float()


def one_process_recipe(recipe: dict):
    """A saved recipe (dataclasses.asdict form) resolved as one process: the same model, data
    and training settings, every parallel size 1."""
    from dsforge.recipe import Topology, resolve
    from dsforge.recipe.loader import build_recipe

    raw = {**recipe, "parallel": {"tp": 1, "pp": 1, "dp": 1}, "zero": {"stage": 1},
           "train": {**recipe["train"], "grad_accum": None}}  # derived again for dp 1
    return resolve(build_recipe(raw), Topology(world_size=1))


def transformers_logits(folder: Path, tokens=TOKENS):
    """(model, logits) of the folder loaded by transformers in fp32; every tensor must load:
    no missing, unexpected or mismatched keys."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    with torch.no_grad():
        return model, model(torch.tensor(tokens)).logits


def _checkpoint_logits(checkpoint: Path, out: Path) -> None:
    from dsforge.ckpt.reader import open_state

    from dsforge.runtime.assemble.vocab import pad_rows

    reader = open_state(checkpoint)
    single_process(out.with_suffix(".store"))
    chunk, _ = build_chunk(one_process_recipe(reader.recipe))
    loaded = []
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            rows = param.shape[0]
            param.copy_(pad_rows(reader.full(name, "fp32")[:rows], rows))
            loaded.append(name)
    assert sorted(loaded) == sorted(reader.names()), "the checkpoint holds other tensors"
    torch.save({"logits": logits(chunk), "recipe": reader.recipe}, out)
    print(json.dumps({"parameters": len(loaded)}))


if __name__ == "__main__":
    _checkpoint_logits(Path(sys.argv[1]), Path(sys.argv[2]))
