"""Versions of the packages a dsforge job depends on (recorded in manifests, compared by preflight)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("torch", "deepspeed", "megatron-core", "dsforge")


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions
