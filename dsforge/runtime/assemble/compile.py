"""model.compile: layers: every transformer layer compiled once with torch.compile (regional
compilation, torchtitan's way: the layers are identical, so one layer's graph is compiled and
the others reuse it; the embedding, the final norm and the output layer stay eager).

`module.compile()` (not `torch.compile(module)`) keeps the module and its state_dict keys, so
checkpoints, resharding and Hugging Face export see the same names as an eager run.

What a Megatron-Core layer needs to be one graph (torch._dynamo.explain on a dense layer gave 9
graphs, 12 with selective checkpointing): two Megatron-Core fixes that hold for eager runs too
(runtime/assemble/megatron_fixes.py: the row-parallel linear's warning, the offloading context);
and, with selective checkpointing, the attention core recomputed through torch's non-reentrant
checkpoint instead of Megatron's reentrant CheckpointFunction (which saves every RNG state
through calls torch.compile cannot trace). The recomputation is the same (dsforge's attention
has no dropout, so no random state is involved): only how autograd is told changes.

The backend and inductor's cache (with dsforge's other caches, so a second run on the machine
reuses the kernels): translate/compile.py.
"""

from __future__ import annotations

import os
import types

import torch

from dsforge.job.steps import step_text
from dsforge.translate.compile import INDUCTOR_CACHE_ENV, compile_backend, inductor_cache_dir


def transformer_layers(chunks) -> list[torch.nn.Module]:
    return [layer for chunk in chunks for layer in chunk.decoder.layers]


def compile_layers(chunks, *, selective: bool) -> int:
    """Compile every transformer layer of the chunks in place; returns how many."""
    _cache_with_dsforge()
    torch._logging.set_logs(recompiles=True)  # a recompile's reason goes to the rank's log
    layers = transformer_layers(chunks)
    for layer in layers:
        traceable(layer, selective=selective)
        layer.compile(backend=compile_backend())
    return len(layers)


def _cache_with_dsforge() -> None:
    """Inductor's kernels where translate/compile.py says (later lookups read the variable
    again)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ[INDUCTOR_CACHE_ENV] = inductor_cache_dir(torch_default=default_cache_dir())


def traceable(layer: torch.nn.Module, *, selective: bool) -> torch.nn.Module:
    """The layer as torch.compile can trace it in one graph (with megatron_fixes applied):
    with selective checkpointing, its attention core recomputed through torch's checkpoint."""
    if selective:
        attention = layer.self_attention
        attention._checkpointed_attention_forward = types.MethodType(_recomputed_attention, attention)
    return layer


def _recomputed_attention(self, query, key, value, attention_mask, rotary_pos_emb=None,
                          attn_mask_type=None, attention_bias=None, packed_seq_params=None):
    """Megatron's selective recomputation of the attention core, through torch's
    non-reentrant checkpoint (its `_checkpointed_attention_forward`'s signature)."""
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type

    def core(q, k, v, mask):
        return self.core_attention(q, k, v, mask, attn_mask_type=mask_type,
                                   attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)

    return torch.utils.checkpoint.checkpoint(core, query, key, value, attention_mask,
                                             use_reentrant=False)


def compile_seconds() -> float:
    """Seconds torch has spent compiling in this process (its own timers: each frame's
    compilation, and the backward graphs compiled at their first use)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(times) for name, times in compilation_time_metrics.items()
               if name == "_compile.compile_inner" or name.startswith("backward."))


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileReport:
    """What compiling cost and whether it happened again. torch compiles a layer at its first
    call, inside the first step: after it, `compile_s` (torch's own timers) joins the start-up
    breakdown as `compile`. After the warm-up every graph should exist: a new one is a
    recompile (a changed shape, a guard on a Python value) that costs a compilation each time;
    it is said once, with where torch logged its reason."""

    def __init__(self):
        self.compile_s: float | None = None
        self.baseline: int | None = None
        self.said = False

    def after_step(self, step: int, warm: bool) -> str | None:
        if self.compile_s is None:
            self.compile_s = compile_seconds()
            return (f"layers compiled in {self.compile_s:.1f} s, inside {step_text(step)} "
                    f"({graphs_compiled()} graph(s))")
        if not warm or self.baseline is None:
            self.baseline = graphs_compiled()
            return None
        now = graphs_compiled()
        if now == self.baseline or self.said:
            return None
        self.said = True
        return (f"warning: the compiled layers compiled again at {step_text(step)} ({now - self.baseline} "
                "new graph(s) after the warm-up; each costs a compilation); torch's reason is "
                "in the run's job.log ('Recompiling function')")

    def rebaseline(self) -> None:
        """After evaluation: its forward passes without gradients compile graphs of their
        own, which are not recompiles of the training step's."""
        if self.baseline is not None:
            self.baseline = graphs_compiled()
