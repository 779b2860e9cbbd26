"""train.fp8: the transformer layers' linear layers multiply in float8 through torchao.

torchao's `convert_to_float8_training` swaps `nn.Linear` modules only; Megatron-Core's
`ColumnParallelLinear` and `RowParallelLinear` are not `nn.Linear`, so converting the model
would silently change nothing. Instead each linear layer of each transformer layer (attention's
QKV and output projection, the MLP's two) has its product function (`_forward_impl`, which
Megatron-Core calls with the input, the weight and its tensor-parallel options) replaced by
torchao's `matmul_with_hp_or_float8_args`, the function torchao's own `Float8Linear` calls:
inputs, weights and output gradients cast to float8 with dynamic scaling (`tensorwise`: one
scale per tensor; `rowwise`: per row), the product in float8, the output in bf16. At tp 1
(rule FP2) Megatron's function is nothing more than that product and the bias, so nothing
else changes; the embedding and the output layer stay bf16, as torchao's own filters keep
the output layer. The weights themselves stay bf16 parameters: checkpoints, resharding,
export and resuming between bf16 and fp8 are unchanged (dynamic scaling keeps no state).

Applied before model.compile, so compiled layers fuse the casts (torchtitan measured the
gain of float8 to depend on it).
"""

from __future__ import annotations

import functools

import torch

from dsforge.runtime.assemble.compile import transformer_layers

LINEARS = (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
           ("mlp", "linear_fc1"), ("mlp", "linear_fc2"))


def float8_linears(chunks, scaling: str) -> int:
    """Each transformer layer's linear layers to float8 products; returns how many."""
    from torchao.float8.config import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(scaling)
    mm_config = _mm_config(config)
    count = 0
    for layer in transformer_layers(chunks):
        for block, name in LINEARS:
            linear = getattr(getattr(layer, block), name)
            linear._forward_impl = functools.partial(_float8_product, config=config,
                                                     mm_config=mm_config)
            count += 1
    return count


def _mm_config(config):
    """The GEMM settings torchao's Float8Linear makes from its config (output, grad_input,
    grad_weight)."""
    from torchao.float8.float8_linear import LinearMMConfig, ScaledMMConfig

    def gemm(settings):
        return ScaledMMConfig(config.emulate, settings.use_fast_accum, False, config.pad_inner_dim)

    return LinearMMConfig(gemm(config.gemm_config_output), gemm(config.gemm_config_grad_input),
                          gemm(config.gemm_config_grad_weight))


def _float8_product(input, weight, bias=None, *, config, mm_config, **megatron_options):
    """Megatron-Core's linear product at tp 1 (`linear_with_grad_accumulation_and_async_allreduce`
    without gradient-accumulation fusion), in float8."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if megatron_options.get("gradient_accumulation_fusion"):
        raise RuntimeError("float8 linear layers do not fuse gradient accumulation "
                           "(dsforge never turns it on)")
    output = matmul_with_hp_or_float8_args.apply(input, weight.t(), mm_config, config)
    return output if bias is None else output + bias.to(output.dtype)


def device_check(scaling: str, device: torch.device, capability: tuple[int, int] | None) -> None:
    """The rank's own GPU (its compute `capability`) runs float8 GEMMs (the fit check and
    preflight checked the GPUs they know by name; this is the last word, before any step)."""
    from dsforge.problems import RecipeError
    from dsforge.translate.fp8 import fp8_device_problems, torchao_installed

    problems = fp8_device_problems(scaling, device=device.type, capability=capability,
                                   torchao_available=torchao_installed())
    if problems:
        raise RecipeError(problems)
