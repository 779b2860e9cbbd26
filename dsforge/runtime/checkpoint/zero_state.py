"""Where DeepSpeed keeps a parameter's optimizer state, for each ZeRO stage.

The optimizer state of one parameter is its fp32 master weights and Adam's two moments. A view
answers two questions for the layout-free checkpoint (runtime/checkpoint/layout_free.py):
  fragments(param)          the part of the parameter's (tensor-parallel) shard this rank
                            owns: (flat start, {state: 1-D fp32 tensor}); [] if none
  install(param, key, value)  put the full shard of state `key` (the shard's shape) into
                            whatever part of it this rank owns
`prepare(step)` creates the optimizer's state before `install` (torch's Adam creates it
lazily at the first step) and `finish()` refreshes the training-precision weights from the
masters. The DeepSpeed internals used here are pinned in tests/unit/test_pins.py.

  ZeRO 1/2   each parameter group is flattened and cut into equal data-parallel partitions;
             `param._hp_mapping` says which range of the parameter this rank's partition
             holds (lp_fragment_address) and where (hp_fragment_address).
  ZeRO 3     each parameter is cut on its own: rank r of its partition group holds elements
             [r * p, (r + 1) * p) of it, p = ceil(n / ranks), the tail padded.
  ZeRO 0     every data-parallel rank holds everything; data-parallel rank 0 writes. fp32
             trains with torch's AdamW on the parameters themselves; bf16/fp16 wrap it with
             fp32 copies (DeepSpeed's FP16_UnfusedOptimizer, or FP16_Optimizer's flat groups).
"""

from __future__ import annotations

from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_view(engine):
    stage = engine.zero_optimization_stage()
    if stage in (1, 2):
        return Zero12(engine.optimizer)
    if stage == 3:
        return Zero3(engine.optimizer)
    return Zero0(engine.optimizer)


def new_adam_state(flat: torch.Tensor, optimizer, step: int) -> dict[str, Any]:
    """Adam's state as the optimizer itself would have made it: torch keeps the step as a
    float32 tensor, on the parameter's device when it steps fused or capturable (its fused
    kernel reads the step there: a CPU step would fault on a GPU), on the CPU otherwise;
    DeepSpeed's CPU Adam keeps an int."""
    if not type(optimizer).__module__.startswith("torch."):
        counter = step
    elif optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"):
        counter = torch.tensor(float(step), dtype=torch.float32, device=flat.device)
    else:
        counter = torch.tensor(float(step))
    return {"step": counter, "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}


def _step_of(state: dict) -> int | None:
    step = state.get("step")
    return None if step is None else int(step.item() if torch.is_tensor(step) else step)


class _View:
    """What every stage's view shares: the torch optimizer (`base`) keeps Adam's state per
    fp32 tensor, the `holders` of the stage."""

    base: torch.optim.Optimizer

    def holders(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def adam_step(self) -> int | None:
        return next((_step_of(s) for s in self.base.state.values()), None)

    def prepare(self, step: int) -> None:
        for holder in self.holders():
            self.base.state[holder] = new_adam_state(holder.detach(), self.base, step)


class Zero12(_View):
    def __init__(self, optimizer):
        self.zero = optimizer
        self.base = optimizer.optimizer
        self.group = {id(p): g for g, group in enumerate(optimizer.bit16_groups) for p in group}

    def _flat(self, param) -> torch.Tensor:
        return self.zero.single_partition_of_fp32_groups[self.group[id(param)]]

    def fragments(self, param):
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return []
        flat = self._flat(param)
        state = self.base.state.get(flat, {})
        start, numel = mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel
        out = {"fp32": flat.narrow(0, start, numel)}
        out.update({k: state[k].narrow(0, start, numel) for k in MOMENTS if k in state})
        return [(mapping.lp_fragment_address.start, out)]

    def holders(self) -> list[torch.Tensor]:
        return list(self.zero.single_partition_of_fp32_groups)

    def install(self, param, key: str, value: torch.Tensor) -> None:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return
        flat = self._flat(param)
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        target = flat if key == "fp32" else self.base.state[flat][key]
        target.narrow(0, hp.start, hp.numel).copy_(value.reshape(-1).narrow(0, lp.start, lp.numel))

    def finish(self) -> None:
        self.zero.update_lp_params()  # every rank: all-gathers the bit16 partitions


class Zero3(_View):
    def __init__(self, optimizer):
        self.zero = optimizer
        self.base = optimizer.optimizer

    def _range(self, param) -> tuple[int, int, int]:
        """(start, numel, partition size) of this rank's part of `param`."""
        import torch.distributed as dist

        size = param.ds_tensor.ds_numel
        start = dist.get_rank(group=self.zero._get_param_partition_group(param)) * size
        return start, max(0, min(size, param.ds_numel - start)), size

    def fragments(self, param):
        start, numel, _ = self._range(param)
        if numel == 0:
            return []
        have = [k for k in MOMENTS if self._has_state(k)]
        out = {"fp32": self.zero.get_local_fp32_param(param)[:numel]}
        out.update({k: self.zero.get_local_fp32_param(param, k)[:numel] for k in have})
        return [(start, out)]

    def _has_state(self, key: str) -> bool:
        return all(key in self.base.state.get(flat, {}) for flat in self.holders())

    def holders(self) -> list[torch.Tensor]:
        return list(self.zero.fp32_partitioned_groups_flat)

    def install(self, param, key: str, value: torch.Tensor) -> None:
        start, numel, size = self._range(param)
        local = torch.zeros(size, dtype=torch.float32)
        local[:numel] = value.reshape(-1)[start:start + numel]
        self.zero.set_local_hp_param(local, param, None if key == "fp32" else key)

    def finish(self) -> None:
        """The training-precision partitions from the fp32 ones, as DeepSpeed's own loader
        (load_hp_checkpoint_state_from_checkpoint_dir_stage3) ends."""
        zero = self.zero
        for group, fp32 in enumerate(zero.fp32_partitioned_groups_flat):
            if fp32.numel() > 0:
                zero.fp16_partitioned_groups_flat[group].data.copy_(fp32.data)
        for group, flat in enumerate(zero.fp16_partitioned_groups_flat):
            views = zero.unflatten(flat, zero.fp16_partitioned_groups[group])
            for partitioned, view in zip(zero.fp16_partitioned_groups[group], views):
                partitioned.data = view.data


class Zero0(_View):
    """No ZeRO: the optimizer is torch's AdamW, or DeepSpeed's fp16/bf16 wrapper around it."""

    def __init__(self, optimizer):
        self.wrapper = optimizer
        self.base = getattr(optimizer, "optimizer", optimizer)
        self.master = {}  # id(param) -> (fp32 tensor holding the state, start, numel)
        if optimizer is self.base:  # fp32: the parameters are the masters
            for group in self.base.param_groups:
                for p in group["params"]:
                    self.master[id(p)] = (p, 0, p.numel())
        elif hasattr(optimizer, "fp32_groups"):  # FP16_UnfusedOptimizer
            for lp_group, fp32_group in zip(optimizer.fp16_groups, optimizer.fp32_groups):
                for lp, fp32 in zip(lp_group, fp32_group):
                    self.master[id(lp)] = (fp32, 0, lp.numel())
        elif hasattr(optimizer, "fp32_groups_flat"):  # FP16_Optimizer: one flat fp32 per group
            for lp_group, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
                offset = 0
                for lp in lp_group:
                    self.master[id(lp)] = (flat, offset, lp.numel())
                    offset += lp.numel()
        else:
            raise NotImplementedError(f"dsforge cannot read the state of {type(optimizer).__name__}")

    def _writes(self, param) -> bool:
        from megatron.core import parallel_state as ps

        from dsforge.ckpt.names import is_expert

        if is_expert(param):
            return ps.get_expert_data_parallel_rank() == 0
        return ps.get_data_parallel_rank(with_context_parallel=True) == 0

    def fragments(self, param):
        if not self._writes(param):
            return []
        holder, start, numel = self.master[id(param)]
        state = self.base.state.get(holder, {})
        out = {"fp32": holder.detach().reshape(-1).narrow(0, start, numel)}
        out.update({k: state[k].reshape(-1).narrow(0, start, numel) for k in MOMENTS if k in state})
        return [(0, out)]

    def holders(self) -> list[torch.Tensor]:
        """Each fp32 tensor once (FP16_Optimizer's flat group holds many parameters)."""
        return list({id(h): h for h, _, _ in self.master.values()}.values())

    def install(self, param, key: str, value: torch.Tensor) -> None:
        holder, start, numel = self.master[id(param)]
        target = holder.detach() if key == "fp32" else self.base.state[holder][key]
        target.reshape(-1).narrow(0, start, numel).copy_(value.reshape(-1))
        if key == "fp32" and holder is not param:
            param.copy_(value.view_as(param))  # the weights the next forward uses

    def finish(self) -> None:
        pass  # install already wrote the weights
