"""Run Megatron-Core 0.16 on CPU with gloo: every CUDA assumption redirected, in one place.

Active only when no GPU is used (`activate()` is called by the rank runtime when the device
is the CPU). Megatron-Core assumes CUDA in four ways (../shared/reference/cpu-backend-facts.md):
  1. `device=torch.cuda.current_device()` / `device="cuda"` arguments and `.cuda()` calls
     -> a TorchFunctionMode rewrites any CUDA device (or bare device index) to the CPU;
  2. the CUDA RNG (`_get_cuda_rng_state`, `torch.cuda.manual_seed`, ...) -> the CPU generator,
     so Megatron's RNG tracker forks and restores the generator CPU ops actually use;
  3. CUDA streams and events in the MoE dispatcher -> no-op stand-ins;
  4. MoE split sizes that stay tensors on CPU (gloo's all_to_all wants lists), uneven
     all-gather / reduce-scatter of routed tokens (gloo supports equal sizes only).
Megatron-Core's bugs that show on every device are in megatron_fixes.py, not here.
It also keeps DeepSpeed from building its CPU shared-memory all-reduce (see skip_deepspeed_shm_allreduce).
Every patch names the attribute it replaces and fails loudly (CpuBackendError) when an
upgrade removes it, so a Megatron-Core change cannot silently bypass the backend.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE: "_CpuDeviceMode | None" = None
_CPU = torch.device("cpu")


class CpuBackendError(RuntimeError):
    pass


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA device in Megatron's calls
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # pinning needs CUDA (Megatron's rope pins its cp index)
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.cuda, torch.Tensor.record_stream):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _Stream:
    """Stands in for torch.cuda.Stream/Event on CPU, where all work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # wait_stream, record_event, synchronize, ...: nothing to wait for. Returning a stand-in
        # lets `event = stream.record_event()` be used as an event afterwards.
        return lambda *args, **kwargs: _Stream()

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _Stream()


def _replace(module_name: str, attribute: str, value: Any) -> None:
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise CpuBackendError(
            f"{module_name}.{attribute} no longer exists: the installed megatron-core/torch "
            "changed what dsforge's CPU backend redirects. Update dsforge/runtime/assemble/cpu_backend.py.")
    setattr(module, attribute, value)


def _as_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """CPU version of moe_utils.maybe_move_tensor_to_cpu: gloo needs plain split sizes."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _gloo_uneven_gather(original):
    """gloo's all_gather needs equal sizes; MoE with tensor parallelism gathers uneven token
    counts (output_split_sizes). Pad to the largest, gather, trim."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])

    return gather


def _gloo_uneven_reduce_scatter(original):
    """gloo has no list reduce_scatter: all-reduce the whole tensor and keep this rank's rows."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start:start + sizes[group.rank()]].contiguous()

    return reduce_scatter


def _patch_torch_cuda() -> None:
    cuda = "torch.cuda"
    # Returned as a device (not an index) because Megatron passes it as `device=` in autograd
    # backward functions too, where the TorchFunctionMode below is not in effect.
    _replace(cuda, "current_device", lambda: _CPU)
    _replace(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _replace(cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
    _replace(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    _replace(cuda, "manual_seed_all", lambda seed: None)  # torch.manual_seed calls it; CPU is seeded
    _replace(cuda, "synchronize", lambda device=None: None)
    _replace(cuda, "Stream", _Stream)
    _replace(cuda, "Event", _Stream)
    _replace(cuda, "current_stream", lambda device=None: _CURRENT_STREAM)
    _replace(cuda, "stream", lambda stream=None: contextlib.nullcontext())


def _patch_megatron() -> None:
    random = "megatron.core.tensor_parallel.random"
    _replace(random, "_get_cuda_rng_state",
             lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    _replace(random, "_set_cuda_rng_state",
             lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    moe_utils = "megatron.core.transformer.moe.moe_utils"
    _replace(moe_utils, "maybe_move_tensor_to_cpu", _as_split_sizes)
    _replace("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
             _as_split_sizes)
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    _replace(mappings.__name__, "_gather_along_first_dim",
             _gloo_uneven_gather(mappings._gather_along_first_dim))
    _replace(mappings.__name__, "_reduce_scatter_along_first_dim",
             _gloo_uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim))


def skip_deepspeed_shm_allreduce() -> None:
    """Keep deepspeed.init_distributed from compiling and mapping its shared-memory all-reduce."""
    # DeepSpeed's CPU shared-memory all-reduce (an inference kernel that training's collectives
    # do not use) is compiled on first use and maps /dev/shm buffers that are never unlinked
    # when a rank ends: run after run they filled the machine's memory. Training uses gloo.
    _replace("deepspeed.comm.torch", "build_shm_op", lambda: None)


def activate() -> None:
    """Install the CPU backend for the rest of the process (idempotent)."""
    global _ACTIVE
    if _ACTIVE is not None:
        return
    if torch.cuda.is_available():
        raise CpuBackendError("the CPU backend must not be activated when a GPU is in use")
    _patch_torch_cuda()
    _patch_megatron()
    skip_deepspeed_shm_allreduce()
    _ACTIVE = _CpuDeviceMode()
    _ACTIVE.__enter__()
