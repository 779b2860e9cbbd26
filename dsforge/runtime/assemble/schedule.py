"""The learning-rate schedule DeepSpeed has no class for: linear warmup, then linear decay to a
floor (`train.lr_decay: linear`).

DeepSpeed's WarmupDecayLR decays toward the rate its warmup starts from: 0 after a warmup
(min_lr_ratio ignored), and the peak itself without one (dsforge starts a warmup-free schedule
at the peak), where it does not decay at all. This one follows Megatron-LM's linear decay: from the
peak at step `warmup_steps` to `end_lr` at step `total_num_steps`, the floor after it. Cosine
and constant stay DeepSpeed's own (translate/deepspeed_config.py names them in the config).

It keeps DeepSpeed's scheduler interface and state (`last_batch_iteration` only), so the
engine steps it after each update, its checkpoints hold what WarmupDecayLR's held, and a
checkpoint written under WarmupDecayLR resumes under it.
"""

from __future__ import annotations

from typing import Any, Callable

from dsforge.translate.deepspeed_config import LINEAR_DECAY


class WarmupLinearDecayLR:
    def __init__(self, optimizer, *, peak_lr: float, end_lr: float, warmup_num_steps: int,
                 total_num_steps: int, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.peak_lr, self.end_lr = peak_lr, end_lr
        self.warmup_num_steps, self.total_num_steps = warmup_num_steps, total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def rate(self, iteration: int) -> float:
        """The rate of schedule iteration `iteration` (dsforge runs iteration k at step k)."""
        if iteration < 0:  # before the engine's first step, as DeepSpeed's warmup schedulers
            return 0.0
        if iteration < self.warmup_num_steps:
            return self.peak_lr * iteration / self.warmup_num_steps
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        done = min(1.0, (iteration - self.warmup_num_steps) / decay_steps)
        return self.peak_lr - (self.peak_lr - self.end_lr) * done

    def _apply(self) -> list[float]:
        rate = self.rate(self.last_batch_iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        return [rate] * len(self.optimizer.param_groups)

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def get_lr(self) -> list[float]:
        return [self.rate(self.last_batch_iteration)] * len(self.optimizer.param_groups)

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


# The schedules dsforge builds itself, by the type name translate/deepspeed_config.py gives.
OWN_SCHEDULERS = {LINEAR_DECAY: WarmupLinearDecayLR}


def make_scheduler(section: dict[str, Any]) -> Callable | None:
    """What `deepspeed.initialize(lr_scheduler=...)` takes for a schedule DeepSpeed's config
    cannot name (a function of the optimizer); None when the config names it."""
    own = OWN_SCHEDULERS.get(section["type"])
    if own is None:
        return None
    return lambda optimizer: own(optimizer, **section["params"])
