"""model.kernels and model.sdpa_backend: which kernels do the work outside the matrix products.

`torch` is the plain path: torch's RMSNorm, Megatron-Core's unfused SwiGLU (silu, multiply),
the output layer's whole [tokens, vocab] logits and Megatron's vocab-parallel cross-entropy,
which keeps an fp32 copy of them. `liger` runs Liger Kernel's Triton kernels
(runtime/assemble/kernels.py): RMSNorm, the gate-and-up SwiGLU read straight from fc1's output, and at
tp 1 the output layer fused with the cross-entropy, the logits made a chunk of tokens at a
time (at tp > 1 its vocab-parallel cross-entropy). Rotary embeddings stay Megatron's.
Triton compiles each kernel on its first call (seconds, cached under ~/.triton, with the
compiler Triton ships: no toolchain to set up; a failure is one line, runtime/guard/build_failure.py);
Triton needs a GPU. `auto` picks liger on GPU ranks when liger-kernel is installed and loads
(`pip install 'dsforge[gpu]'`; runtime/kernels.loadable), else torch.

A recipe that asks for what its ranks cannot run is refused before any rank starts, on the
machines the ranks run on (`device_problems`, from the fit check and every host's preflight;
`dsforge plan` on a laptop may plan a GPU job): liger or a GPU-only attention backend on CPU
ranks, flash or cuDNN attention with fp32 on GPU ranks (K1), liger where liger-kernel is not
installed (X1). Every host runs the same
liger-kernel version (preflight F3), so auto picks the same kernels on every rank.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from dsforge.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.problems import Problem
from dsforge.recipe import Resolved
from dsforge.schema import DataConfig, ModelConfig

LIGER_PACKAGE = "liger_kernel"
# Attention backends torch's CPU SDPA has (flash: its own CPU flash kernel).
CPU_SDPA_BACKENDS = ("auto", "flash", "math")
# CUDA attention kernels for 16-bit inputs only (flash-attention 2, cuDNN's fused attention).
HALF_ONLY_SDPA_BACKENDS = ("flash", "cudnn")


@dataclass(frozen=True)
class KernelChoice:
    impl: str  # "torch" | "liger"
    why: str  # what decided it, for `dsforge plan`


def liger_installed() -> bool:
    """Looked up, not imported: importing liger_kernel imports Triton."""
    return importlib.util.find_spec(LIGER_PACKAGE) is not None


def choose_kernels(model: ModelConfig, *, device: str, liger_available: bool) -> KernelChoice:
    """The kernels ranks on `device` ("cpu" | "cuda") run for `model.kernels`."""
    if model.kernels != "auto":
        return KernelChoice(model.kernels, "model.kernels")
    if device != "cuda":
        return KernelChoice("torch", "auto: Liger's Triton kernels need a GPU")
    if not liger_available:
        return KernelChoice("torch", "auto: liger-kernel is not installed; "
                                     "pip install 'dsforge[gpu]' for its fused kernels")
    return KernelChoice("liger", "auto: GPU ranks and liger-kernel installed")


@dataclass(frozen=True)
class Documents:
    """How packed documents change the model (runtime/assemble/documents.py)."""

    kernel: str = "sdpa-mask"  # the attention's kernel when documents are masked
    position_ids: bool = False  # rotary by position ids (data.reset_position_ids)
    per_token_loss: bool = False  # data.eod_mask_loss: no fused (mean) loss head


NO_DOCUMENTS = Documents()


def document_attention(data: DataConfig, *, device: str, sdpa_backend: str) -> KernelChoice | None:
    """The kernel of attention within documents (data.document_masking), and why; None when
    the documents are not masked. `sdpa_backend` (model.sdpa_backend) other than auto asks
    for torch's SDPA, which then takes the dense mask (rule D17 refuses the kernels that take
    none)."""
    if not data.document_masking:
        return None
    if device == "cuda" and sdpa_backend == "auto":
        return KernelChoice("flex", "a GPU: flex attention's block mask skips the blocks no "
                                    "document reaches, its cost follows the documents' lengths")
    why = (f"model.sdpa_backend: {sdpa_backend} asks for torch's SDPA" if device == "cuda" else
           "CPU ranks: flex attention has no backward on the CPU")
    return KernelChoice("sdpa-mask", f"{why}: the dense document mask through SDPA, the whole "
                                     "causal attention's cost")


# How the plan's FLOPs count attention with documents masked: as without (the convention of
# estimate/flops.py; the plan reads no documents), which overstates the work by the share of
# the score matrix no document reaches. A run counts both (runtime/loop/meter.py).
DOCUMENT_FLOPS = ("the full seq x seq score matrix of each sequence, as without masking (the "
                  "plan reads no documents); a run's metrics count it so in `mfu` and each "
                  "document's own square, from the step's documents, in `mfu_documents` "
                  "(docs/flops.md)")


def documents_summary(data: DataConfig, *, device: str, sdpa_backend: str) -> dict:
    """What plan and manifest say of packed documents ({} when none of the options is on)."""
    if not data.documents:
        return {}
    said = {"masking": data.document_masking, "reset_position_ids": data.reset_position_ids,
            "eod_mask_loss": data.eod_mask_loss}
    choice = document_attention(data, device=device, sdpa_backend=sdpa_backend)
    if choice is not None:
        said |= {"kernel": choice.impl, "kernel_why": choice.why, "attention_flops": DOCUMENT_FLOPS}
    return {"documents": said}


def documents_for(data: DataConfig, *, device: str, sdpa_backend: str) -> Documents:
    choice = document_attention(data, device=device, sdpa_backend=sdpa_backend)
    return Documents(kernel=choice.impl if choice else "sdpa-mask",
                     position_ids=data.reset_position_ids, per_token_loss=data.eod_mask_loss)


def fused_loss(model: ModelConfig, *, tp: int, device: str, per_token_loss: bool = False) -> bool:
    """Whether ranks on `device` started from this machine run the output layer fused with
    its loss (Liger, tp 1): the memory model then keeps no logits (estimate/memory.py
    logits_bytes). For `auto` that is liger-kernel installed here, as the fit check and
    preflight require of every host; a plan made where it is not counts the logits. Never
    for a loss masked per token (`per_token_loss`, data.eod_mask_loss)."""
    if tp != 1 or device != "cuda" or model.kernels == "torch" or per_token_loss:
        return False  # decided without looking for liger-kernel (a search asks thousands of times)
    return choose_kernels(model, device=device, liger_available=liger_installed()).impl == "liger"


def dense_document_mask(recipe, *, device: str) -> bool:
    """Whether ranks on `device` hold a dense [s, s] document mask (the memory model counts
    it: estimate/memory.py)."""
    documents = document_attention(recipe.data, device=device,
                                   sdpa_backend=recipe.model.sdpa_backend)
    return documents is not None and documents.impl == "sdpa-mask"


def predicted_memory(resolved: Resolved, device: str) -> MemoryEstimate:
    """The memory model's estimate for the resolved recipe's ranks on `device`, with the loss
    their kernels compute (fused_loss) and the document mask they hold: the one way every
    command asks it."""
    r, lay = resolved.recipe, resolved.layout
    return estimate_memory(model=r.model, train=r.train, zero=r.zero, layout=lay,
                           fused_loss=fused_loss(r.model, tp=lay.tp, device=device,
                                                 per_token_loss=r.data.eod_mask_loss),
                           document_mask=dense_document_mask(r, device=device))


def device_problems(model: ModelConfig, *, device: str, precision: str,
                    liger_available: bool, document_masking: bool = False) -> list[Problem]:
    """K1: what the ranks' device cannot run; X1: liger asked for where it is not installed."""
    if device == "cuda":
        problems = [] if model.kernels != "liger" or liger_available else [_liger_missing()]
        if document_masking and model.compile == "layers":
            # the mask (flex's block mask, or SDPA's dense one) is made once per microbatch
            # from Python (a cache by the ids tensor): inside a compiled layer that breaks
            # the graph at every layer
            problems.append(Problem(
                rule="K1", fields={"data.document_masking": True, "model.compile": "layers"},
                message="documents are masked on GPU ranks by a mask dsforge makes once per "
                        "microbatch outside torch.compile; compiled layers would break their "
                        "graph on it (not built yet)",
                fix="set model.compile: none with data.document_masking (flex attention is "
                    "compiled on its own)"))
        if model.sdpa_backend in HALF_ONLY_SDPA_BACKENDS and precision == "fp32":
            problems.append(Problem(
                rule="K1", fields={"model.sdpa_backend": model.sdpa_backend,
                                   "train.precision": "fp32"},
                message=f"torch's {model.sdpa_backend} attention kernel takes bf16 and fp16 "
                        "only; fp32 attention would find no kernel at the first step",
                fix="use model.sdpa_backend: auto (or efficient, math) with fp32, or "
                    "train.precision: bf16"))
        return problems
    problems = []
    if model.kernels == "liger":
        problems.append(Problem(
            rule="K1", fields={"model.kernels": "liger"},
            message="Liger Kernel's Triton kernels need GPU ranks; these ranks run on the CPU",
            fix="use model.kernels: auto (torch's kernels on CPU, Liger's on GPUs)"))
    if model.sdpa_backend not in CPU_SDPA_BACKENDS:
        problems.append(Problem(
            rule="K1", fields={"model.sdpa_backend": model.sdpa_backend},
            message="torch's scaled_dot_product_attention has no "
                    f"{model.sdpa_backend} kernel on the CPU",
            fix="use model.sdpa_backend: auto (or one of " + ", ".join(CPU_SDPA_BACKENDS) + ")"))
    return problems


def _liger_missing() -> Problem:
    return Problem(rule="X1", fields={"model.kernels": "liger"},
                   message="needs the liger-kernel package on the machines the ranks run on, "
                           "which is not installed here",
                   fix="pip install 'dsforge[gpu]', or set model.kernels: auto (Liger where "
                       "installed, torch's kernels elsewhere)")
