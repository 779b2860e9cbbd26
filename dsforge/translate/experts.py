"""model.moe.experts: how an MoE layer runs its experts.

`sequential` is Megatron-Core's SequentialMLP: a Python loop over the experts, one small GEMM
each, the token counts copied to the host to split the tokens. `grouped` runs every local
expert of a layer in two grouped GEMMs (gate and up projections together, then the down
projection) on torch's own kernel (`grouped_mm`; CUTLASS on sm90 GPUs, with the groups' offsets
on the device), and at expert parallelism 1 dsforge's own token dispatch sorts the tokens by
expert on the device, so the layer copies nothing to the host (runtime/assemble/grouped_moe.py).
Both compute the same function with the same parameters under the same names.

`auto` picks grouped where torch's grouped GEMM has its fast kernel: CUDA devices of compute
capability 9.0 or newer, in bf16. Elsewhere (a CPU, older GPUs, fp32) torch falls back to a loop
over the groups, which gains nothing over Megatron's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.schema import ModelConfig

# The compute capability from which torch's grouped GEMM runs its CUTLASS kernel.
FAST_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class ExpertsChoice:
    impl: str  # "sequential" | "grouped"
    why: str  # what decided it, for `dsforge plan` and manifest.json


def choose_experts(model: ModelConfig, *, device: str, precision: str,
                   capability: tuple[int, int] | None) -> ExpertsChoice | None:
    """How ranks on `device` ("cpu" | "cuda") of compute `capability` (None where unknown) run
    the model's experts; None for a dense model."""
    if model.moe is None:
        return None
    if model.moe.experts != "auto":
        return ExpertsChoice(model.moe.experts, "model.moe.experts")
    if model.bias:
        return ExpertsChoice("sequential", "auto: grouped experts have no biases (model.bias)")
    if device != "cuda":
        return ExpertsChoice("sequential", "auto: torch's grouped GEMM has no fast CPU kernel")
    if precision != "bf16":
        return ExpertsChoice("sequential", f"auto: torch's fast grouped GEMM takes bf16, not "
                                           f"{precision}")
    if capability is None:
        return ExpertsChoice("grouped", "auto: bf16 on GPUs; ranks on a GPU older than sm90 "
                                        "take sequential when they start")
    if tuple(capability) < FAST_CAPABILITY:
        return ExpertsChoice("sequential", f"auto: sm{capability[0]}{capability[1]} has no fast "
                                           "grouped GEMM kernel (sm90 and newer do)")
    return ExpertsChoice("grouped", f"auto: bf16 on sm{capability[0]}{capability[1]}")
