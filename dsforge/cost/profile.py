"""Cluster profiles: what the step-time model assumes about a GPU node and its network.

Bandwidths are *achieved* bus bandwidths per GPU for large collectives (what nccl-tests
reports as busbw), not link peaks: NVLink 4 is 900 GB/s bidirectional per H100, NCCL
all-reduce reaches ~360-400 GB/s busbw inside a DGX H100; one 400 Gb/s InfiniBand NIC per
GPU reaches ~40-45 GB/s across nodes. `compute_efficiency` is the share of the dense BF16
peak that large transformer GEMMs reach in practice (published MFUs of well-tuned runs reach
45-58% including everything else; a GEMM-only figure is higher).

A user's cluster differs: every field can be overridden in a small YAML file
(`dsforge plan --search ... --profile my_cluster.yaml`):

    gpu: h100
    gpus_per_node: 8
    intra_node_gbps: 300
    inter_node_gbps: 25      # e.g. 200 Gb/s RoCE per GPU

The file is read like a recipe (dsforge/recipe/loader.py): duplicate and unknown keys are
errors (with a did-you-mean), every value is type-checked, and all problems come at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dsforge.estimate.memory_fixes import HEADROOM
from dsforge.hardware import GPU, GPU_KEYS, gpu_by_key
from dsforge.problems import Checks, Problem, RecipeError, did_you_mean
from dsforge.recipe.loader import build_dataclass, read_yaml

DEFAULT_MEMORY_HEADROOM = HEADROOM
PREDICTION_ERROR = 0.108


@dataclass(frozen=True, kw_only=True)
class ClusterProfile:
    gpu: GPU
    gpus_per_node: int = 8
    intra_node_gbps: float = 360.0  # GB/s per GPU, collective bus bandwidth inside a node
    inter_node_gbps: float = 40.0  # GB/s per GPU across nodes
    compute_efficiency: float = 0.6  # achievable share of peak for the model's GEMMs
    # The share of peak the attention kernels reach on the attention's FLOPs as dsforge counts
    # them (the full s x s matrix, forward and backward: docs/flops.md), at the model's
    # sequence length. None: attention runs at the GEMMs' rate, as every default profile
    # assumes. `dsforge calibrate` measures it (an H200 at 4,096 tokens: 0.66, while its GEMMs
    # reached 0.77 there).
    attention_efficiency: float | None = None
    # The share of peak an MoE model's routed experts reach on their FLOPs as dsforge counts
    # them (the top_k experts' gate, up and down projections, forward and backward:
    # estimate/flops.py), run as the recipe runs them (model.moe.experts: the grouped GEMM or
    # the per-expert loop), each expert with its share of a microbatch's tokens: products far
    # shorter than the dense layers'. None: the experts at the GEMMs' rate, as every default
    # profile assumes. `dsforge calibrate` measures it for an MoE recipe.
    expert_efficiency: float | None = None
    # The work outside the GEMMs and attention (norms, SwiGLU, rotary, residuals, the loss's
    # share), in seconds per token, layer and hidden unit (cost.py `other`). 0: the efficiency
    # above absorbs it, as in every default profile. --measure's refit fits it where runs of
    # different widths tell it from the GEMMs: the GPU kit's 33 H200 runs (hidden 2,048 to
    # 4,096) give 1.05e-10 s beside a compute_efficiency of 0.777
    # (benchmarks/search/kit_phases.md); `dsforge calibrate` times it in one of the recipe's
    # layers (1.34e-10 s in a 7B layer on an H200).
    other_s_per_token_hidden: float = 0.0
    # Tokens of a microbatch at which its GEMMs reach half their full rate (cost.py
    # gemm_saturation): 256 for a GPU; `dsforge calibrate` measures it (a CPU's is near 0).
    gemm_knee_tokens: float = 256.0
    # Issue 40, guesses until the GPU kit measures them (benchmarks/gpu: compile-fp8). Compiled
    # layers (model.compile: layers) run the work outside their GEMMs and attention (`other`)
    # at this share of eager's: what compiling fuses (rotary, residual adds, casts) is that
    # work, its ceiling all of it. train.fp8's float8 GEMMs run the transformer layers' linear
    # layers this many times faster than bf16's (twice the peak, less the casts' and scales'
    # kernels); eager, torchao's unfused casts add this share of `other` (torchao: float8
    # gains 6-10% eager, +28% over compile compiled, Llama-3 8B on H100s). `dsforge
    # calibrate` measures the speedup: the float8 GEMMs alone (the casts are `other`'s)
    # against bf16's at the recipe's layer shapes, their three passes.
    compiled_other_share: float = 0.6
    fp8_gemm_speedup: float = 1.6
    fp8_eager_cast_share: float = 0.5
    # Headroom: the share of GPU memory the fit keeps free for what the memory model does not
    # count (allocator fragmentation, which the Ultra-Scale Playbook puts at 5-20%, the CUDA
    # context, NCCL and p2p buffers). 10%: the published comparison has 31 runs that trained
    # with dsforge's estimate inside the top 10% of the GPU, so a larger default would refuse
    # layouts known to train (docs/search.md "Fit"); `--memory-headroom` changes it.
    memory_margin: float = DEFAULT_MEMORY_HEADROOM
    # Relative error band of a predicted step time: the median of |predicted / measured - 1|
    # throughput over the published comparison's scored runs (tools/published_runs.py,
    # `Stats.median_relative_error` of "all"; tests/unit/test_published.py holds this copy to
    # it). Candidates whose bands overlap the fastest one's tie (search.py).
    prediction_error: float = PREDICTION_ERROR
    # Share of ZeRO-3's parameter gathers and gradient reduce-scatters hidden behind compute
    # (pp = 1; the only stage DeepSpeed overlaps with dsforge's config, docs/search.md).
    dp_overlap: float = 0.5
    p2p_latency_s: float = 20e-6  # per pipeline send/recv
    # The 16-bit optimizer step (DeepSpeed's wrapper around torch's fused AdamW: overflow check,
    # norms, an fp32 copy of each gradient, the step, the copy back): a fixed cost plus memory
    # traffic per parameter at the GPU's bandwidth. Fitted to the GPU kit's 14 runs on one H200
    # (2026-11-26, 1.24B and 6.74B parameters, ZeRO 0-3): 8 ms + 109 bytes, within 3% of each
    # (benchmarks/search/kit_phases.md).
    optimizer_bytes_per_param: float = 109.0
    optimizer_fixed_s: float = 0.008
    # fp32 training: Adam alone, no 16-bit wrapper: it streams fp32 master weights, momentum
    # and variance (read and write: 24 bytes) and the fp32 gradient (read: 4), a fused
    # multi-tensor Adam at about 80% of the bandwidth. Not measured on a GPU yet.
    optimizer_bytes_per_param_fp32: float = 28 / 0.8
    # A fixed cost per microbatch and layer on the busiest rank: launching a layer's kernels
    # from Python, which short kernels cannot hide (the 1B's forward on an H200: ~31 ms a
    # microbatch more at micro-batch 1 than 2). 0 until a calibration measures it
    # (cost/fit.py).
    microbatch_layer_s: float = 0.0
    # ZeRO-3's fetch of a layer's parameters, beyond the bytes dp_comm counts (DeepSpeed's
    # per-module bookkeeping, and on one GPU the copy it still makes): per layer and pass.
    # 0 until a calibration measures it.
    zero3_gather_layer_s: float = 0.0
    # A floor under each layer's grad-enabled forward (the forward, or the recompute under full
    # checkpointing), seconds per layer and microbatch: Megatron's layers launch their kernels
    # from Python, so a layer whose kernels take less than the host needs to launch them waits
    # for the host (cost.py `host`). On a GPU the host's work overlaps the device's, so the
    # larger of the two counts, not their sum. One figure for ZeRO 0-2 and one for ZeRO-3, whose
    # per-module fetches are host work too. 0: no floor (a GPU never measured, and the CPU,
    # where the host is the device and the fixed cost above adds instead).
    host_layer_s: float = 0.0
    host_layer_zero3_s: float = 0.0
    # Where the coefficients were measured ("" = nowhere: the defaults of a GPU the kit never
    # ran, and the published comparison's band) and from how many runs (calibrate.py writes
    # both; the H200's and H100's defaults name the GPU kit's runs).
    measured_on: str = ""
    measured_runs: int = 0

    @property
    def usable_memory_bytes(self) -> float:
        return self.gpu.memory_bytes * (1.0 - self.memory_margin)


# Per GPU family: (intra-node busbw, inter-node busbw per GPU, compute efficiency) for the
# node it usually comes in (SXM in 8-GPU NVLink nodes with a 400G NIC per GPU; PCIe cards
# over PCIe 4/5 switches).
_DEFAULTS: dict[str, tuple[float, float, float]] = {
    "h100": (360.0, 40.0, 0.60),
    "h200": (360.0, 40.0, 0.62),
    "gh200": (360.0, 40.0, 0.60),
    "h100-nvl": (250.0, 40.0, 0.58),
    "h100-pcie": (40.0, 25.0, 0.55),
    "a100": (230.0, 20.0, 0.60),
    "a100-40gb": (230.0, 20.0, 0.60),
    "l40s": (25.0, 12.0, 0.50),
    "b200": (720.0, 80.0, 0.55),
}


# Per GPU measured by the GPU kit: the host floors (host_layer_s, host_layer_zero3_s) and where
# they (and the optimizer's coefficients above) come from, the profile's `measured_on`. The
# floors are --measure's own refit of the kit's dense runs (`python tools/kit_phases.py
# --loo`; tests/unit/test_kit_phases.py holds them to it), fitted beside the compute's scale
# (x0.991 and x0.993, so the efficiencies above stand). No other GPU has been measured.
_KIT = ("2026-11-26 and 27, torch 2.11 + CUDA 13.0, DeepSpeed 0.19.8, Megatron-Core 0.16.1, Liger "
        "0.8.5: python tools/kit_phases.py --loo")
_MEASURED: dict[str, tuple[float, float, str]] = {
    "h200": (0.00239, 0.00851, f"the GPU kit's 33 dense runs on one NVIDIA H200 (the optimizer "
                               f"step and the host floors; {_KIT})"),
    "h100": (0.00342, 0.00695, f"the GPU kit's 10 dense runs on one NVIDIA H100 80GB HBM3 (the "
                               f"host floors; the optimizer step is the H200's; {_KIT})"),
}


def default_profile(gpu_key: str, gpus_per_node: int = 8) -> ClusterProfile:
    if gpu_key not in GPU_KEYS:
        raise RecipeError([Problem(rule="S1", fields={"--gpu": gpu_key},
                                   message=f"unknown GPU; known: {', '.join(GPU_KEYS)}",
                                   fix="pick one of the known GPUs, or describe yours in --profile."
                                       f"{did_you_mean(gpu_key, GPU_KEYS)}")])
    intra, inter, efficiency = _DEFAULTS[gpu_key]
    host, host_zero3, measured_on = _MEASURED.get(gpu_key, (0.0, 0.0, ""))
    return ClusterProfile(gpu=gpu_by_key(gpu_key), gpus_per_node=gpus_per_node,
                          intra_node_gbps=intra, inter_node_gbps=inter,
                          compute_efficiency=efficiency, host_layer_s=host,
                          host_layer_zero3_s=host_zero3, measured_on=measured_on)


@dataclass(frozen=True, kw_only=True)
class ProfileFile:
    """A --profile file as written: the fields of ClusterProfile, each optional (None keeps
    the GPU's default), `gpu` by its key."""

    gpu: str | None = None
    gpus_per_node: int | None = None
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    compute_efficiency: float | None = None
    attention_efficiency: float | None = None
    expert_efficiency: float | None = None
    other_s_per_token_hidden: float | None = None
    gemm_knee_tokens: float | None = None
    compiled_other_share: float | None = None
    fp8_gemm_speedup: float | None = None
    fp8_eager_cast_share: float | None = None
    memory_margin: float | None = None
    prediction_error: float | None = None
    dp_overlap: float | None = None
    p2p_latency_s: float | None = None
    optimizer_bytes_per_param: float | None = None
    optimizer_fixed_s: float | None = None
    optimizer_bytes_per_param_fp32: float | None = None
    microbatch_layer_s: float | None = None
    zero3_gather_layer_s: float | None = None
    host_layer_s: float | None = None
    host_layer_zero3_s: float | None = None
    measured_on: str | None = None
    measured_runs: int | None = None

    def __post_init__(self) -> None:
        checks = Checks()
        if self.gpu is not None:
            checks.require(self.gpu in GPU_KEYS, "S1", {"gpu": self.gpu}, "unknown GPU",
                           f"use one of {', '.join(GPU_KEYS)}.{did_you_mean(self.gpu, GPU_KEYS)}")
        for name, (ok, allowed) in _RANGES.items():
            value = getattr(self, name)
            checks.require(value is None or ok(value), "S1", {name: value},
                           f"out of range (must be {allowed})", f"use a value {allowed}")
        checks.raise_if_any()


_RANGES = {
    "gpus_per_node": (lambda v: v > 0, "> 0"),
    "intra_node_gbps": (lambda v: v > 0, "> 0"),
    "inter_node_gbps": (lambda v: v > 0, "> 0"),
    "compute_efficiency": (lambda v: 0 < v <= 1, "in (0, 1]"),  # a share of the peak
    "attention_efficiency": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "expert_efficiency": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "other_s_per_token_hidden": (lambda v: v >= 0, ">= 0"),
    "gemm_knee_tokens": (lambda v: v >= 0, ">= 0"),
    "compiled_other_share": (lambda v: 0 < v <= 1, "in (0, 1]"),  # compiling removes no work
    "fp8_gemm_speedup": (lambda v: v > 0, "> 0"),
    "fp8_eager_cast_share": (lambda v: v >= 0, ">= 0"),
    "memory_margin": (lambda v: 0 <= v < 1, "in [0, 1)"),  # 1 would leave no memory
    "prediction_error": (lambda v: 0 <= v < 1, "in [0, 1)"),  # a band reaching 0 s means nothing
    "dp_overlap": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "p2p_latency_s": (lambda v: v >= 0, ">= 0"),
    "optimizer_bytes_per_param": (lambda v: v > 0, "> 0"),
    "optimizer_fixed_s": (lambda v: v >= 0, ">= 0"),
    "optimizer_bytes_per_param_fp32": (lambda v: v > 0, "> 0"),
    "microbatch_layer_s": (lambda v: v >= 0, ">= 0"),
    "zero3_gather_layer_s": (lambda v: v >= 0, ">= 0"),
    "host_layer_s": (lambda v: v >= 0, ">= 0"),
    "host_layer_zero3_s": (lambda v: v >= 0, ">= 0"),
    "measured_on": (lambda v: True, "any text"),
    "measured_runs": (lambda v: v >= 0, ">= 0"),
}


def load_profile(path: Path | None, gpu_key: str | None, gpus_per_node: int | None,
                 memory_headroom: float | None = None) -> ClusterProfile:
    """The default profile of the GPU, overridden by the YAML file, then by the command line."""
    check_memory_headroom(memory_headroom)
    written = read_profile(path) if path else ProfileFile()
    per_node = gpus_per_node or written.gpus_per_node or 8
    profile = default_profile(gpu_key or written.gpu or "h100", per_node)
    overrides = {k: v for k, v in dataclasses.asdict(written).items() if v is not None and k != "gpu"}
    if memory_headroom is not None:
        overrides["memory_margin"] = memory_headroom
    return dataclasses.replace(profile, **{**overrides, "gpus_per_node": per_node})


def check_memory_headroom(value: float | None) -> None:
    """`--memory-headroom` is a fraction of the GPU's memory: 0 keeps nothing free, 1 would
    leave nothing to use. A value from 2 to 100 is most likely a percentage."""
    in_range, _ = _RANGES["memory_margin"]  # the flag sets the profile's memory_margin
    if value is None or in_range(value):
        return
    fix = (f"write it as a fraction: --memory-headroom {value / 100:g}" if 2 <= value < 100
           else f"use a fraction in [0, 1), e.g. --memory-headroom {DEFAULT_MEMORY_HEADROOM:g} (the "
                "default) or 0.2 (the top of the Playbook's 5-20% allocator fragmentation)")
    raise RecipeError([Problem(rule="S1", fields={"--memory-headroom": value},
                               message="the share of GPU memory kept free must be in [0, 1)", fix=fix)])


def profile_text(profile: ClusterProfile, comment: str) -> str:
    """`profile` as a --profile file (every field, the GPU by its key), after `comment`'s
    lines as YAML comments."""
    import yaml

    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(ProfileFile)}
    fields["gpu"] = profile.gpu.key
    header = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines())
    return header + yaml.safe_dump(fields, sort_keys=False)


def provenance_lines(made_by: str, measured_on: str) -> list[str]:
    """The first comment lines of a measured profile: what made it where, the command, the
    versions of the packages that measured it."""
    import sys

    from dsforge.versions import package_versions

    versions = ", ".join(f"{k} {v}" for k, v in package_versions().items() if v)
    return [f"{made_by} on {measured_on}.", f"Command: dsforge {' '.join(sys.argv[1:])}",
            f"Versions: {versions}"]


def read_profile(path: Path) -> ProfileFile:
    """The file strictly read (RecipeError with every problem, each naming the file)."""
    if not path.is_file():
        raise RecipeError([Problem(rule="S1", fields={"--profile": str(path)}, message="file not found",
                                   fix="check the path (docs/search.md shows a profile)")])
    try:
        raw = read_yaml(path, what="profile")
    except RecipeError as exc:
        raise _in_file(exc, path) from None
    if isinstance(raw, dict) and {"model", "train"} & raw.keys():  # one problem, not one a key
        raise RecipeError([Problem(
            rule="S1", fields={"--profile": str(path)}, message="a recipe, not a cluster profile",
            fix="give the recipe as the search's target (dsforge plan --search RECIPE); a "
                "profile is what dsforge calibrate or dsforge refit writes (docs/search.md)")])
    try:
        return build_dataclass(ProfileFile, raw)
    except RecipeError as exc:
        raise _in_file(exc, path) from None


def _in_file(exc: RecipeError, path: Path) -> RecipeError:
    """`exc`'s problems, each field named with the file it is in."""
    return RecipeError(dataclasses.replace(p, fields={f"{path}: {k}": v for k, v in p.fields.items()})
                       for p in exc.problems)
