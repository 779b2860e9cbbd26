"""What DeepSpeed needs to build an op at run time, checked before any rank starts (pure).

DeepSpeed compiles an op the first time a rank uses it, unless it was installed with the op
prebuilt (translate/optimizer.py `ops_built_at_run_time`: FusedAdam for `train.adam_impl:
deepspeed` on GPUs, CPU Adam for optimizer offload). The build goes through
torch.utils.cpp_extension.load and needs, for every op, ninja and the C++ compiler on PATH
(BLD5, BLD6). A CUDA op on GPU ranks (FusedAdam) also needs:
  - a TORCH_CUDA_ARCH_LIST DeepSpeed 0.19.8 can read (BLD1). Its op builder
    (builder.py `compute_capability_args`) splits the list at ';' and spaces and reads every
    entry as MAJOR.MINOR[+PTX] with int(), so spellings torch itself accepts - Hopper's
    arch-specific "9.0a", which GPU images set, torch's names ("Hopper") and "native" - kill
    every rank with ValueError as its build starts. `map_arch_list` maps them to the base
    architectures, which the ops need nothing beyond; `rank_env` hands the ranks the mapped list.
  - nvcc where torch looks for it (CUDA_HOME, else the nvcc on PATH, else /usr/local/cuda;
    BLD2), of torch's CUDA major version (BLD3: torch refuses other majors for its own
    extensions; a minor mismatch only warns, BLD4). DeepSpeed's own toolkit-versus-torch check
    (`assert_no_cuda_mismatch`, with its table of tolerated minor versions that lists no CUDA
    13, and DS_SKIP_CUDA_CHECK) runs only when ops are prebuilt at install time, never in the
    run-time build, so dsforge sets no DS_SKIP_CUDA_CHECK.
The facts come from launch/probe.py `build_facts` (standard library only): on this machine in
the fit check (launch/fit.py), on every host in preflight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from dsforge.problems import Problem
from dsforge.recipe import Resolved
from dsforge.translate.optimizer import CPU_ADAM, FUSED_ADAM, ops_built_at_run_time

ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
BUILD_RULES = ("BLD1", "BLD2", "BLD3", "BLD4", "BLD5", "BLD6")
# Op builders that compile .cu sources with nvcc on GPU ranks (CUDAOpBuilder subclasses).
# CPU Adam comes from DeepSpeed's CPU builders on every accelerator: C++ only.
CUDA_OPS = frozenset({FUSED_ADAM})
# How a recipe avoids building each op, for the fixes.
AVOID = {FUSED_ADAM: "train.adam_impl: auto (torch's fused AdamW, nothing to build)",
         CPU_ADAM: "zero.offload_optimizer: none (CPU Adam is built only for optimizer offload)"}
# torch.utils.cpp_extension `_get_cuda_arch_flags`'s names, expanded as torch expands them.
TORCH_ARCH_NAMES = {
    "Kepler+Tesla": "3.7", "Kepler": "3.5+PTX", "Maxwell+Tegra": "5.3", "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX", "Volta+Tegra": "7.2", "Volta": "7.0+PTX", "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7", "Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX", "Hopper": "9.0+PTX",
    "Blackwell+Tegra": "11.0", "Blackwell": "10.0;10.3;12.0;12.1+PTX"}

_READABLE = re.compile(r"^[0-9]+\.[0-9]+(\+PTX)?$")  # what DeepSpeed's int() parsing takes
# 9.0a (arch-specific) and 12.0f (family-specific) targets, with or without +PTX.
_SUFFIXED = re.compile(r"^([0-9]+)\.([0-9]+)[af]?(\+PTX)?$", re.IGNORECASE)  # "+ptx" too
# nvcc's own spellings: sm_90a (machine code), compute_90 (PTX); the last digit is the minor.
_NVCC_NAME = re.compile(r"^(sm|compute)_([0-9]+)([0-9])[af]?$")

Arch = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class ArchMapping:
    value: str  # TORCH_CUDA_ARCH_LIST as set
    mapped: str  # what DeepSpeed reads; "" builds for the GPUs a rank sees
    unreadable: tuple[str, ...] = ()  # entries nothing maps

    @property
    def changed(self) -> bool:
        return not self.unreadable and self.mapped != self.value


def deepspeed_reads(value: str) -> bool:
    """Whether DeepSpeed's run-time build parses this TORCH_CUDA_ARCH_LIST as it is (an empty
    one means: build for the visible GPUs)."""
    entries = [e.strip() for e in value.replace(" ", ";").split(";") if e.strip()]
    return all(_READABLE.match(e) for e in entries)


def map_arch_list(value: str) -> ArchMapping:
    """`value` as a list DeepSpeed reads: arch- and family-specific targets and nvcc's names
    at their base architecture, torch's names expanded, ';' between entries (also in place of
    ',' and whitespace), each architecture once (with +PTX when any of its entries had it),
    in ascending order. "native" becomes "" (both torch and DeepSpeed then build for the
    visible GPUs). A list DeepSpeed reads already is kept as it is."""
    if deepspeed_reads(value):
        return ArchMapping(value=value, mapped=value)
    if value.strip() == "native":
        return ArchMapping(value=value, mapped="")
    archs: dict[Arch, bool] = {}
    unreadable = []
    for entry in (e for e in re.split(r"[;,\s]+", value.strip()) if e):
        found = _entry_archs(entry)
        if found is None:
            unreadable.append(entry)
        for arch, ptx in found or ():
            archs[arch] = archs.get(arch, False) or ptx
    mapped = ";".join(f"{major}.{minor}{'+PTX' if ptx else ''}"
                      for (major, minor), ptx in sorted(archs.items()))
    return ArchMapping(value=value, mapped=mapped, unreadable=tuple(unreadable))


def _entry_archs(entry: str) -> list[tuple[Arch, bool]] | None:
    """(architecture, +PTX) pairs one entry stands for; None when it names none."""
    if entry in TORCH_ARCH_NAMES:
        return [pair for part in TORCH_ARCH_NAMES[entry].split(";") for pair in _entry_archs(part)]
    if match := _SUFFIXED.match(entry):
        return [((int(match[1]), int(match[2])), match[3] is not None)]
    if match := _NVCC_NAME.match(entry):
        return [((int(match[2]), int(match[3])), match[1] == "compute")]
    return None


@dataclass(frozen=True, kw_only=True)
class BuildFacts:
    """What a host offers an op build (launch/probe.py `build_facts`)."""

    arch_list: str | None = None  # TORCH_CUDA_ARCH_LIST as the ranks get it; None: unset
    cuda_home: str | None = None  # the CUDA toolkit torch builds with; None: none found
    nvcc: str | None = None  # CUDA_HOME/bin/nvcc, the compiler the build runs
    nvcc_release: str | None = None  # "13.0", from `nvcc --version`
    nvcc_error: str | None = None  # why nvcc_release is unknown
    torch_cuda: str | None = None  # torch.version.cuda; None for a CPU build of torch
    ninja: str | None = None  # its path on PATH
    cxx: str = "c++"  # CXX, or torch's default
    cxx_path: str | None = None
    path: str = ""  # PATH
    prebuilt_ops: frozenset[str] = field(default_factory=frozenset)
    prebuilt_for: str | None = None  # the accelerator DeepSpeed prebuilt them for

    @classmethod
    def from_probe(cls, found: Mapping) -> "BuildFacts":
        return cls(**{**found, "prebuilt_ops": frozenset(found.get("prebuilt_ops", ()))})

    def forwarded(self, environ: Mapping[str, str]) -> "BuildFacts":
        """The facts as ranks started from `environ` see them: its TORCH_CUDA_ARCH_LIST, when
        set, is forwarded to every rank (job/word.py `forwarded_env`) over the host's own."""
        return replace(self, arch_list=environ[ARCH_LIST]) if ARCH_LIST in environ else self


def job_ops(resolved: Resolved, device: str) -> tuple[str, ...]:
    """The DeepSpeed ops the job's ranks on `device` ("cpu" | "cuda") build at run time."""
    r = resolved.recipe
    return ops_built_at_run_time(train=r.train, zero=r.zero, device=device)


def arch_list_for_rank(resolved: Resolved, device: str,
                       environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """What a rank on `device` ("cpu" | "cuda") sets in its own environment before DeepSpeed
    builds anything, and the line that says so: a rank applies it itself, so the list it
    reads is mapped however it got there (forwarded from `dsforge run`, a host's own
    environment, Slurm, a plain `deepspeed` command)."""
    return rank_env(job_ops(resolved, "cuda") if device == "cuda" else (), environ)


def rank_env(gpu_ops: Iterable[str], environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """What to set on ranks that build `gpu_ops` on GPUs from `environ`, and the dsforge line
    that says so ("" when nothing). Only a TORCH_CUDA_ARCH_LIST DeepSpeed cannot read and
    dsforge can map is replaced; the user's variable otherwise stays as set."""
    cuda_ops = [op for op in gpu_ops if op in CUDA_OPS]
    if not cuda_ops or ARCH_LIST not in environ:
        return {}, ""
    mapping = map_arch_list(environ[ARCH_LIST])
    if not mapping.changed:
        return {}, ""
    shown = repr(mapping.mapped) if mapping.mapped else "'' (the GPUs each rank sees)"
    return {ARCH_LIST: mapping.mapped}, (
        f"dsforge: {ARCH_LIST}={mapping.value!r} is {shown} on the ranks: DeepSpeed builds "
        f"{', '.join(cuda_ops)} when the ranks start and reads only MAJOR.MINOR[+PTX] entries; "
        "the op needs nothing beyond the base architecture")


def build_problems(ops: Iterable[str], facts: BuildFacts, *, device: str,
                   host: str) -> list[Problem]:
    """Why the `ops` the job's ranks on `device` build could not be built on `host`."""
    built = [op for op in ops if not _prebuilt(op, facts, device)]
    if not built:
        return []
    problems = []
    if device == "cuda" and (cuda_ops := [op for op in built if op in CUDA_OPS]):
        problems = _arch_problems(cuda_ops, facts, host) + _nvcc_problems(cuda_ops, facts, host)
    return problems + _tool_problems(built, facts, host)


def _prebuilt(op: str, facts: BuildFacts, device: str) -> bool:
    # DeepSpeed loads a prebuilt op only for the accelerator it was built for; ranks on GPUs
    # run DeepSpeed's cuda accelerator, CPU ranks (on machines without GPUs) its cpu one.
    accelerator = "cuda" if device == "cuda" else "cpu"
    return op in facts.prebuilt_ops and facts.prebuilt_for == accelerator


def _fields(host: str, named: dict) -> dict:
    return named if host == "this machine" else {"host": host} | named


def _avoid(ops: list[str]) -> str:
    return "; or build nothing: " + ", ".join(AVOID[op] for op in ops if op in AVOID)


def _tool_problems(ops: list[str], facts: BuildFacts, host: str) -> list[Problem]:
    names = ", ".join(ops)
    problems = []
    if facts.ninja is None:
        problems.append(Problem(
            rule="BLD5", fields=_fields(host, {"PATH": facts.path}),
            message=f"torch builds DeepSpeed's {names} with ninja when the ranks start, and no "
                    "ninja is on PATH",
            fix="pip install ninja into the Python the ranks run (its bin directory on PATH), "
                "or install your distribution's ninja-build" + _avoid(ops)))
    if facts.cxx_path is None:
        problems.append(Problem(
            rule="BLD6", fields=_fields(host, {"CXX": facts.cxx, "PATH": facts.path}),
            message=f"torch compiles DeepSpeed's {names} with the C++ compiler CXX names (c++ "
                    "when unset) when the ranks start, and it is not on PATH",
            fix="install one (e.g. apt-get install g++) or set CXX to a C++ compiler"
                + _avoid(ops)))
    return problems


def _arch_problems(ops: list[str], facts: BuildFacts, host: str) -> list[Problem]:
    if facts.arch_list is None:
        return []  # DeepSpeed builds for the GPUs each rank sees
    mapping = map_arch_list(facts.arch_list)
    if not mapping.unreadable:
        return []
    return [Problem(
        rule="BLD1", fields=_fields(host, {ARCH_LIST: facts.arch_list}),
        message=f"DeepSpeed builds {', '.join(ops)} for the GPUs when the ranks start and cannot "
                f"read {', '.join(map(repr, mapping.unreadable))}: it takes MAJOR.MINOR[+PTX] "
                "entries, and dsforge maps only 9.0a-style targets, sm_90a/compute_90 and "
                "torch's names",
        fix="set TORCH_CUDA_ARCH_LIST to the GPUs' compute capabilities, e.g. 9.0 for H100/H200, "
            "8.0 for A100, '8.0;9.0' for both, or unset it to build for the GPUs each rank sees"
            + _avoid(ops))]


def _nvcc_problems(ops: list[str], facts: BuildFacts, host: str) -> list[Problem]:
    if facts.nvcc_release is None:
        return [_no_nvcc(ops, facts, host)]
    if facts.torch_cuda is None:
        return []  # a CPU build of torch: torch itself refuses GPU ranks
    nvcc, torch = _major_minor(facts.nvcc_release), _major_minor(facts.torch_cuda)
    fields = _fields(host, {"CUDA_HOME": facts.cuda_home, "nvcc release": facts.nvcc_release,
                            "torch.version.cuda": facts.torch_cuda})
    if nvcc[0] != torch[0]:
        return [Problem(
            rule="BLD3", fields=fields,
            message=f"DeepSpeed builds {', '.join(ops)} with this nvcc when the ranks start, and "
                    f"an op built with CUDA {nvcc[0]} does not load into torch built with CUDA "
                    f"{torch[0]} (torch refuses the pair for its own extensions)",
            fix=f"point CUDA_HOME at a CUDA {torch[0]}.x toolkit (best {facts.torch_cuda}), or "
                f"install torch built for CUDA {nvcc[0]}" + _avoid(ops))]
    if nvcc != torch:
        return [Problem(
            rule="BLD4", severity="warning", fields=fields,
            message=f"nvcc and torch differ in CUDA's minor version; the run-time build of "
                    f"{', '.join(ops)} accepts that (CUDA's minor-version compatibility), as "
                    "torch does",
            fix=f"nothing needed; for an exact match point CUDA_HOME at CUDA {facts.torch_cuda}")]
    return []


def _no_nvcc(ops: list[str], facts: BuildFacts, host: str) -> Problem:
    if facts.cuda_home:
        fields, found = {"CUDA_HOME": facts.cuda_home}, f"{facts.nvcc}: {facts.nvcc_error}"
    else:
        fields, found = {"PATH": facts.path}, ("CUDA_HOME and CUDA_PATH are unset, no nvcc is on "
                                               "PATH and /usr/local/cuda does not exist")
    toolkit = f"CUDA {facts.torch_cuda}" if facts.torch_cuda else "torch's CUDA version"
    return Problem(
        rule="BLD2", fields=_fields(host, fields),
        message=f"DeepSpeed builds {', '.join(ops)} with nvcc when the ranks start and torch "
                f"finds no CUDA compiler: {found}",
        fix=f"install the CUDA toolkit (nvcc) of {toolkit} and set CUDA_HOME to its directory "
            "(the one holding bin/nvcc)" + _avoid(ops))


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = ([int(p) for p in re.findall(r"[0-9]+", version)[:2]] + [0, 0])[:2]
    return major, minor
