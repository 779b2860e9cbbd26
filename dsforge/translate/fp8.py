"""train.fp8 where the ranks run (torch-free): what their devices can run (FP6, X1), checked
where the devices are known, as for Liger's kernels (the fit check, preflight, the rank). What
the recipe may ask (FP1-FP5) is recipe/fp8.py's; the float8 layers runtime/assemble/fp8.py's.

- tensorwise: one scale per tensor, cuBLAS's float8 GEMM (sm 8.9: Ada, Hopper and later);
- rowwise: one scale per row, CUTLASS's rowwise kernel, built for sm 9.0 (Hopper).
"""

from __future__ import annotations

import importlib.util

from dsforge.problems import Problem

MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def fp8_device_problems(fp8: str, *, device: str, capability: tuple[int, int] | None,
                        torchao_available: bool) -> list[Problem]:
    """FP6: the ranks' device runs train.fp8's float8 GEMMs (`capability` None: not known
    here, not checked); X1: torchao installed where the ranks run."""
    if fp8 == "none":
        return []
    if device != "cuda":
        return [Problem(rule="FP6", fields={"train.fp8": fp8},
                        message="float8 GEMMs need GPU ranks; these ranks run on the CPU, where "
                                "torch emulates them slower than bf16",
                        fix="use train.fp8: none on CPU ranks")]
    problems = []
    need = MIN_CAPABILITY[fp8]
    if capability is not None and tuple(capability) < need:
        problems.append(Problem(
            rule="FP6", fields={"train.fp8": fp8, "GPU compute capability": tuple(capability)},
            message=f"{fp8} float8 GEMMs need compute capability {need[0]}.{need[1]} or later",
            fix="use train.fp8: tensorwise (sm 8.9+, Ada and Hopper) or none"
            if fp8 == "rowwise" and tuple(capability) >= MIN_CAPABILITY["tensorwise"]
            else "use train.fp8: none on this GPU"))
    if not torchao_available:
        problems.append(Problem(rule="X1", fields={"train.fp8": fp8},
                                message="needs the torchao package on the machines the ranks "
                                        "run on, which is not installed here",
                                fix="pip install 'dsforge[gpu]', or set train.fp8: none"))
    return problems
