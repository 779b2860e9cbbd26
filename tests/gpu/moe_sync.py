"""One MoE layer of recipes/tiny_moe.yaml at ep 1 on the GPU, its forward and backward run under
torch.cuda.set_sync_debug_mode("error") (tests/gpu/test_gpu_moe.py runs this as its child: a
world of one over NCCL, so the tests' own process keeps no process group).

    python -m tests.gpu.moe_sync grouped|sequential

Prints one JSON line: the experts module, whether a synchronising call was made, and which.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

from tests.conftest import REPO

SYNC_ERROR = "synchroniz"  # torch: "called a synchronizing CUDA operation"


def _moe_layer(experts: str):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from dsforge.recipe import resolve_file
    from dsforge.runtime.assemble import megatron_fixes
    from dsforge.runtime.assemble.model import build_model_chunks
    from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                            transformer_config_kwargs)

    megatron_fixes.apply()
    torch.cuda.set_device(0)
    store = tempfile.NamedTemporaryFile(delete=False).name
    torch.distributed.init_process_group("nccl", init_method=f"file://{store}", rank=0,
                                         world_size=1)
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)
    resolved = resolve_file(REPO / "recipes" / "tiny_moe.yaml",
                            ["parallel.ep=1", "parallel.dp=1", "train.precision=bf16",
                             f"model.moe.experts={experts}"], world_size=1)
    r = resolved.recipe
    config = build_transformer_config(transformer_config_kwargs(
        model=r.model, train=r.train, layout=resolved.layout, device="cuda"))
    (chunk,) = build_model_chunks(config, gpt_model_kwargs(model=r.model, layout=resolved.layout),
                                  torch.device("cuda"), vocab_size=r.model.vocab_size,
                                  experts=experts)
    chunk = chunk.to(torch.bfloat16).train()
    return next(m for m in chunk.modules() if isinstance(m, MoELayer)), r


def _forward_and_backward(layer, x: torch.Tensor) -> None:
    out, _ = layer(x)
    out.float().sum().backward()


def main(experts: str) -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    layer, recipe = _moe_layer(experts)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device="cuda"))
    x = torch.randn(recipe.train.seq_len, 2, recipe.model.hidden_size, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)
    _forward_and_backward(layer, x)  # first calls: lazy set-up, allocator, kernel selection
    torch.cuda.synchronize()
    synchronised, what = False, ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_and_backward(layer, x)
    except RuntimeError as exc:
        if SYNC_ERROR not in str(exc):
            raise
        synchronised, what = True, str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(json.dumps({"experts_module": type(layer.experts).__name__,
                      "synchronised": synchronised, "what": what}))


if __name__ == "__main__":
    main(sys.argv[1])
