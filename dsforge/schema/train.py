"""The `train:` section (docs/recipe.md#train)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsforge.problems import Checks
from dsforge.schema.limits import (MAX_BATCH, MAX_SEQ_LEN, MAX_STEPS, SEED_LIMIT, require_at_most,
                                   require_positive)
from dsforge.schema.parsing import time_limit_seconds


Precision = Literal["bf16", "fp16", "fp32"]
Checkpointing = Literal["none", "selective", "full"]
Fp8 = Literal["none", "tensorwise", "rowwise"]
LrDecay = Literal["cosine", "linear", "constant"]
# What a step whose loss or gradients are not finite does (runtime/guard/health.py).
OnNonfinite = Literal["stop", "skip"]
OnSpike = Literal["report", "stop"]
# Which AdamW implementation steps the optimizer (translate/optimizer.py says what each means).
AdamImpl = Literal["auto", "fused", "foreach", "for-loop", "deepspeed"]
TORCH_ADAM_IMPLS = ("fused", "foreach", "for-loop")  # the ones that are torch.optim.AdamW


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    seq_len: int
    # Any two of global_batch, micro_batch, grad_accum fix the third (with dp):
    # global_batch = micro_batch x grad_accum x dp. grad_accum is the number of microbatches
    # per optimizer step, which is also what a pipeline schedule runs per step.
    # With only one given (or none), micro_batch is 1 and grad_accum follows.
    global_batch: int | None = None  # sequences per optimizer step
    micro_batch: int | None = None  # sequences per rank per microbatch
    grad_accum: int | None = None
    steps: int
    lr: float
    min_lr_ratio: float = 0.1  # final lr / peak lr for cosine decay
    lr_decay: LrDecay = "cosine"
    warmup_steps: int = 0  # linear learning-rate warmup
    # The schedule's length (Megatron-LM's --lr-decay-iters): warmup, then the decay up to this
    # step, after which the rate stays where the decay ended. None = train.steps. A run continued
    # with more train.steps keeps its old decay when this is its old total (docs/checkpoints.md).
    lr_decay_steps: int | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    adam_impl: AdamImpl = "auto"  # auto: torch's fused AdamW on GPUs (nothing to build)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    precision: Precision = "bf16"
    # float8 GEMMs in the transformer layers' linear layers (torchao's dynamic scaling), the
    # rest as in bf16; needs precision bf16 (runtime/assemble/fp8.py, rules FP1-FP6).
    fp8: Fp8 = "none"
    activation_checkpointing: Checkpointing = "none"
    seed: int = 1234
    timing_warmup: int = 1  # first steps left out of timing summaries (marked in metrics)
    # Save a checkpoint every N steps and after the last; 0 = never; auto = the interval that
    # loses least to saves and failures, chosen once the run has measured its steps
    # (runtime/loop/save_interval.py, estimate/save_cost.py).
    checkpoint_every: int | Literal["auto"] = 0
    # A periodic save stops training only for a snapshot in host memory and is written in the
    # background (runtime/loop/checkpointer.py); the last one, and a stop's, in the foreground.
    checkpoint_async: bool = True
    # Host memory (GB) one rank's save may hold at once. A rank's state larger than this is
    # copied and written in parts of this size, the optimizer step waiting until all but the
    # last part are on disk (runtime/checkpoint/staging.py). auto: half the memory the host
    # has free at the run's first save, shared by its ranks.
    checkpoint_staging_gb: float | Literal["auto"] = "auto"
    eval_every: int = 0  # validation loss every N steps and after the last; 0 = never
    eval_iters: int = 10  # global batches of held-out samples per evaluation
    # The job's wall-clock limit (time_limit_seconds says which forms): the ranks save a
    # checkpoint and exit, resumable, before it. None = no limit.
    time_limit: int | str | None = None
    keep_last: int = 0  # keep the newest N complete checkpoints; 0 = keep all
    # A step whose loss or gradients are not finite (runtime/guard/health.py): "stop" ends the
    # run keeping its last good checkpoint; "skip" drops the step's update and goes on, until
    # max_consecutive_skips steps in a row were skipped.
    on_nonfinite: OnNonfinite = "stop"
    max_consecutive_skips: int = 5
    # A loss above spike_factor x the median loss of the last spike_window steps is a spike:
    # reported with its data, and the run stopped with on_spike: stop. 0 = no spike check.
    spike_factor: float = 2.0
    spike_window: int = 20
    on_spike: OnSpike = "report"

    @property
    def staging_bytes(self) -> int | None:
        """checkpoint_staging_gb in bytes; None for auto (the rank decides at its first save)."""
        gb = self.checkpoint_staging_gb
        return None if gb == "auto" else int(float(gb) * 1e9)

    @property
    def time_limit_s(self) -> int | None:
        return time_limit_seconds(self.time_limit)

    @property
    def schedule_steps(self) -> int:
        """The steps the learning-rate schedule spans (train.lr_decay_steps or train.steps)."""
        return self.lr_decay_steps or self.steps

    def __post_init__(self) -> None:
        c = Checks()
        c.require(0 <= self.timing_warmup < max(self.steps, 1), "R1",
                  {"train.timing_warmup": self.timing_warmup, "train.steps": self.steps},
                  "must be >= 0 and leave at least one measured step",
                  "use train.timing_warmup < train.steps")
        require_positive(c, "B2", "train", seq_len=self.seq_len, global_batch=self.global_batch,
                         micro_batch=self.micro_batch, grad_accum=self.grad_accum)
        require_at_most(c, "B2", "train", MAX_SEQ_LEN, seq_len=self.seq_len)
        require_at_most(c, "B2", "train", MAX_BATCH, global_batch=self.global_batch,
                        micro_batch=self.micro_batch, grad_accum=self.grad_accum)
        require_positive(c, "R1", "train", steps=self.steps, lr=self.lr, adam_eps=self.adam_eps)
        require_at_most(c, "R1", "train", MAX_STEPS, steps=self.steps)
        c.require(0 <= self.seed < SEED_LIMIT, "R1", {"train.seed": self.seed},
                  "must be >= 0 and below 2**32 (numpy and the data order's generators take "
                  "no larger seeds)", "use a seed such as 1234")
        c.require(0 <= self.warmup_steps < max(self.steps, 1), "R1",
                  {"train.warmup_steps": self.warmup_steps, "train.steps": self.steps},
                  "warmup must be >= 0 and shorter than the run",
                  "use train.warmup_steps < train.steps")
        c.require(self.warmup_steps != 1, "R2", {"train.warmup_steps": 1},
                  "DeepSpeed's warmup schedulers warm up over at least 2 steps and would "
                  "silently use 2", "use train.warmup_steps: 0 (none) or 2 or more")
        c.require(self.checkpoint_every == "auto" or self.checkpoint_every >= 0, "R1",
                  {"train.checkpoint_every": self.checkpoint_every}, "must be >= 0 or auto",
                  "use train.checkpoint_every: 0 for no checkpoints, N to save every N steps, "
                  "or auto")
        c.require(self.checkpoint_staging_gb == "auto" or self.checkpoint_staging_gb > 0, "R1",
                  {"train.checkpoint_staging_gb": self.checkpoint_staging_gb},
                  "must be > 0 or auto", "use train.checkpoint_staging_gb: auto, or the GB of "
                  "host memory a rank's save may hold at once, such as 16")
        c.require(self.eval_every >= 0, "R1", {"train.eval_every": self.eval_every},
                  "must be >= 0", "use train.eval_every: 0 for no validation, or N to "
                  "evaluate every N steps and at the end")
        require_positive(c, "R1", "train", eval_iters=self.eval_iters)
        require_at_most(c, "R1", "train", MAX_STEPS, eval_every=self.eval_every, eval_iters=self.eval_iters)
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            c.require(value >= 0, "R1", {f"train.{name}": value}, "must be >= 0",
                      f"set train.{name} to 0 or more")
        for name in ("adam_beta1", "adam_beta2", "min_lr_ratio"):
            value = getattr(self, name)
            upper_ok = value <= 1 if name == "min_lr_ratio" else value < 1
            c.require(value >= 0 and upper_ok, "R1", {f"train.{name}": value},
                      "must be in [0, 1)" if name != "min_lr_ratio" else "must be in [0, 1]",
                      "typical values: train.adam_beta1 0.9, train.adam_beta2 0.95, "
                      "train.min_lr_ratio 0.1")
        c.require(self.keep_last >= 0, "R1", {"train.keep_last": self.keep_last}, "must be >= 0",
                  "use train.keep_last: 0 to keep every checkpoint, or N to keep the newest N")
        _schedule_and_guard_problems(c, self)
        c.require(_time_limit_ok(self.time_limit), "R3", {"train.time_limit": self.time_limit},
                  "not a time limit: give seconds > 0 (an integer), a number with a unit "
                  "(90s, 45m, 3h, 2d) or Slurm's MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; a "
                  "bare number in quotes is refused (Slurm reads it as minutes)",
                  "e.g. train.time_limit: 3600, \"4h\" or \"1-12:00:00\"; null for no limit")
        c.raise_if_any()


def _schedule_and_guard_problems(c: Checks, train: TrainConfig) -> None:
    """R5 (the schedule's length) and R1 for the guard's fields (runtime/guard/health.py)."""
    decay = train.lr_decay_steps
    if decay is not None:
        c.require(train.warmup_steps < decay <= MAX_STEPS, "R5",
                  {"train.lr_decay_steps": decay, "train.warmup_steps": train.warmup_steps},
                  f"the schedule must be longer than its warmup and at most {MAX_STEPS:,} steps",
                  "use null (the schedule spans train.steps) or a step count above "
                  "train.warmup_steps")
        c.require(train.lr_decay != "constant", "R5",
                  {"train.lr_decay_steps": decay, "train.lr_decay": "constant"},
                  "a constant rate has no decay to end", "remove train.lr_decay_steps, or set "
                  "train.lr_decay: cosine or linear")
    c.require(1 <= train.max_consecutive_skips <= MAX_STEPS, "R1",
              {"train.max_consecutive_skips": train.max_consecutive_skips},
              "must be >= 1: the number of non-finite steps in a row skipped before the run stops",
              "use e.g. train.max_consecutive_skips: 5")
    c.require(train.spike_factor == 0 or 1 < train.spike_factor, "R1",
              {"train.spike_factor": train.spike_factor},
              "must be 0 (no spike check) or above 1: a spike is a loss this many times the "
              "recent median", "use e.g. train.spike_factor: 2.0")
    c.require(1 <= train.spike_window <= MAX_STEPS, "R1",
              {"train.spike_window": train.spike_window},
              "must be >= 1: the recent steps whose median loss a spike is measured against",
              "use e.g. train.spike_window: 20")


def _time_limit_ok(value: int | str | None) -> bool:
    try:
        return value is None or time_limit_seconds(value) > 0
    except ValueError:
        return False
