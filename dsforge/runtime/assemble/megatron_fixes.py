"""Bugs of the pinned Megatron-Core (0.16.1) that dsforge works around on every device.

The CPU backend (cpu_backend.py) redirects what Megatron assumes about CUDA; this module holds
what is wrong on a GPU as well, so the fix cannot depend on the device the tests run on.

- `moe_utils.te_general_gemm` is defined only when Transformer Engine imports, but
  `RouterGatingLinearFunction` (every MoE router's gating GEMM) tests `te_general_gemm is not
  None` unconditionally: without Transformer Engine the first MoE forward dies with
  "NameError: name 'te_general_gemm' is not defined" (measured on an H200, 2026-11-26, the GPU
  kit's moe-8l run). dsforge does not need Transformer Engine, so the name is bound to None,
  which selects the plain torch.mm path the function already has.
- `RowParallelLinear.forward` hands `tp_group=None` to its linear function (the column one
  hands its group), which then looks the group up and, on rank 0, calls `warnings.warn` on
  every forward: a graph break torch.compile cannot trace (model.compile: layers). The
  layer's own group is handed instead; the row layer's linear does no tensor-parallel
  communication of its own (its reduction follows outside), so nothing else changes.
- Attention's linear layers run inside `FineGrainedActivationOffloadingInterface(flag, x,
  name)`, a context manager that does nothing when offloading is off (dsforge never turns it
  on) but that torch.compile cannot step into. With offloading off it is a
  `contextlib.nullcontext(x)`, which torch.compile traces.
- Whole experts on every tensor-parallel rank (ep 1, expert tp 1 < tp): each tp rank holds a
  copy of every expert and, under sequence parallelism, feeds it only its slice of the
  sequence. Megatron marks the copies' weights `tensor_model_parallel` (every parallel linear
  is marked, even at size 1) and, at ep 1, not as experts (`allreduce=False` is set at ep > 1
  only), so they read as dense weights sharded over the dense tp group: dsforge's
  layout-invariant init (init.py, ckpt/names.py) would give each copy a different half of a
  weight twice the expert's size (tp 2 etp 1: a step-0 loss 1.35e-3 off the single process's),
  and their gradients are reduced over dp x cp only, with no sum over tp (nor in Megatron's
  own finalize_model_grads), so each copy would learn from its slice alone. The
  copies are marked as what they are, replicated like the router: not tensor-parallel (drawn
  whole, counted once in the gradient norm, checkpointed by tp rank 0) and `sequence_parallel`
  (their gradients summed over the tp group, grads.py). At ep > 1 the experts are DeepSpeed's
  MoE parameters, reduced over the expert-data-parallel group, which holds the copies.
"""

from __future__ import annotations

import contextlib
import importlib

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
ATTENTION = "megatron.core.transformer.attention"
LAYERS = "megatron.core.tensor_parallel.layers"
EXPERTS = "megatron.core.transformer.moe.experts"


def apply() -> None:
    """Install the workarounds (idempotent). A fixed Megatron-Core makes each a no-op."""
    moe_utils = importlib.import_module(MOE_UTILS)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _row_linear_group()
    _offloading_off()
    _whole_experts_replicated_over_tp()


def _row_linear_group() -> None:
    row = importlib.import_module(LAYERS).RowParallelLinear
    if getattr(row._forward_impl, "dsforge_fix", False):
        return
    original = row._forward_impl

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return original(self, input, weight, *args, **kwargs)

    _forward_impl.dsforge_fix = True
    _forward_impl.__wrapped_original__ = original  # what the fix replaced (the tests restore it)
    row._forward_impl = _forward_impl


def _offloading_off() -> None:
    attention = importlib.import_module(ATTENTION)
    interface = attention.off_interface
    if getattr(interface, "dsforge_fix", False):
        return

    class Offloading(interface):
        """The interface, or a nullcontext yielding its tensor where offloading is off."""
        dsforge_fix = True

        def __new__(cls, offload, tensor, name):
            if not offload:
                return contextlib.nullcontext(tensor)
            return super().__new__(cls)

    attention.off_interface = Offloading


def _whole_experts_replicated_over_tp() -> None:
    """SequentialMLP (and grouped_moe.GroupedExperts, its subclass) marks its weights as
    copies over tp where every tp rank holds whole experts and no token leaves the rank."""
    sequential = importlib.import_module(EXPERTS).SequentialMLP
    if getattr(sequential.__init__, "dsforge_fix", False):
        return
    original = sequential.__init__

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        original(self, num_local_experts, config, submodules, pg_collection=pg_collection)
        if _whole_experts_on_each_tp_rank(pg_collection):
            for param in self.parameters():
                param.tensor_model_parallel = False
                param.sequence_parallel = config.sequence_parallel

    __init__.dsforge_fix = True
    sequential.__init__ = __init__


def _whole_experts_on_each_tp_rank(groups) -> bool:
    """Expert tp 1 and ep 1 under tp > 1 (`groups`: Megatron's ProcessGroupCollection)."""
    return groups.expt_tp.size() == 1 and groups.ep.size() == 1 and groups.tp.size() > 1
