"""Versions of the packages a dsforge job depends on (recorded in manifests, compared by preflight)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# liger-kernel: model.kernels auto picks it where installed; torchao: train.fp8's float8 GEMMs.
# Every host must agree (the machine that launches the job need not have them: RANKS_ONLY,
# compared among the hosts).
PACKAGES = ("torch", "deepspeed", "megatron-core", "dsforge", "liger-kernel", "torchao")
RANKS_ONLY = ("liger-kernel", "torchao")


def package_versions() -> dict[str, str | None]:
    return {name: package_version(name) for name in PACKAGES}


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None
