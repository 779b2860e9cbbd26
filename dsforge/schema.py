"""The recipe: one frozen, keyword-only dataclass per YAML section.

Rules that concern one section only are checked in that section's __post_init__ and raised
together (RecipeError). Rules that span sections or need the world size live in
`dsforge.recipe.validate`. Field names are the public recipe interface (docs/recipe.md).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Literal

from dsforge.hardware import GPU_KEYS
from dsforge.problems import Checks, Problem, did_you_mean

Precision = Literal["bf16", "fp16", "fp32"]
Checkpointing = Literal["none", "selective", "full"]
Fp8 = Literal["none", "tensorwise", "rowwise"]
Offload = Literal["none", "cpu"]
LrDecay = Literal["cosine", "linear", "constant"]
# How an MoE layer runs its experts (translate/experts.py says what each means).
MoeExperts = Literal["auto", "sequential", "grouped"]
# What a step whose loss or gradients are not finite does (runtime/guard/health.py).
OnNonfinite = Literal["stop", "skip"]
OnSpike = Literal["report", "stop"]
TokenDtype = Literal["uint16", "uint32"]
# Which AdamW implementation steps the optimizer (translate/optimizer.py says what each means).
AdamImpl = Literal["auto", "fused", "foreach", "for-loop", "deepspeed"]
TORCH_ADAM_IMPLS = ("fused", "foreach", "for-loop")  # the ones that are torch.optim.AdamW
# Kernels for the work outside the matrix products (translate/kernels.py).
Kernels = Literal["auto", "torch", "liger"]
# torch.nn.attention.SDPBackend to use; auto = torch's own choice.
SdpaBackend = Literal["auto", "flash", "cudnn", "efficient", "math"]
Compile = Literal["none", "layers"]


# Largest values dsforge accepts. Far beyond any real model or cluster, they keep every loop
# over layers, ranks or candidate values (plan, the fixes validation suggests) short.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20  # hidden, ffn and head sizes
MAX_HEADS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_SEQ_LEN = 1 << 22
MAX_EXPERTS = 4096
MAX_ROTARY_BASE = 10**12
MAX_WORLD = 1 << 18  # ranks, and any one parallel degree
MAX_BATCH = 1 << 24  # sequences per step (global_batch), per microbatch, microbatches
MAX_STEPS = 10**9
# numpy's legacy seeding takes 0 <= seed < 2**32; the data order multiplies the seed by about
# 2**20 and torch generators take seeds below 2**64 (runtime/loop/data.py).
SEED_LIMIT = 1 << 32
MAX_NAME = 100
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def _positive(checks: Checks, rule: str, section: str, **values: int | float | None) -> None:
    for name, value in values.items():
        if value is not None:
            checks.require(value > 0, rule, {f"{section}.{name}": value}, "must be > 0",
                           f"set {section}.{name} to a positive value")


def _at_most(checks: Checks, rule: str, section: str, limit: int, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None:
            checks.require(value <= limit, rule, {f"{section}.{name}": value},
                           f"must be at most {limit:,} (dsforge's limit, far beyond real jobs)",
                           f"set {section}.{name} to a value up to {limit:,}")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    num_experts: int
    top_k: int = 2
    ffn_hidden_size: int  # per expert
    frequency: int = 1  # every Nth layer is an MoE layer (Megatron moe_layer_freq)
    aux_loss_coeff: float = 0.01  # load-balancing loss weight
    experts: MoeExperts = "auto"  # a loop of per-expert GEMMs, or grouped GEMMs

    def __post_init__(self) -> None:
        c = Checks()
        _positive(c, "M1", "model.moe", num_experts=self.num_experts,
                  ffn_hidden_size=self.ffn_hidden_size, frequency=self.frequency)
        _at_most(c, "M1", "model.moe", MAX_EXPERTS, num_experts=self.num_experts)
        _at_most(c, "M1", "model.moe", MAX_WIDTH, ffn_hidden_size=self.ffn_hidden_size)
        c.require(0 < self.top_k <= self.num_experts, "E2",
                  {"model.moe.top_k": self.top_k, "model.moe.num_experts": self.num_experts},
                  "top_k must be between 1 and num_experts",
                  f"set model.moe.top_k in 1..{max(self.num_experts, 1)}")
        c.require(self.aux_loss_coeff >= 0, "M1", {"model.moe.aux_loss_coeff": self.aux_loss_coeff},
                  "must be >= 0", "use 0 to disable the load-balancing loss")
        c.raise_if_any()


# Megatron pads the vocabulary so every tensor-parallel shard is a multiple of 128 (rule T4).
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP, rotary embeddings, optional GQA and MoE."""

    preset: str | None = None  # applied by the loader; kept to say where the numbers came from
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int | None = None  # None = num_attention_heads (no GQA)
    kv_channels: int | None = None  # head dim; None = hidden_size / num_attention_heads
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool = False
    bias: bool = False  # bias in linear layers
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    moe: MoEConfig | None = None
    # A Hugging Face Llama (dense) or Mixtral (MoE) folder whose weights the model starts from
    # instead of drawn ones (dsforge/recipe/init_from.py checks it, rules I1-I5); None = drawn.
    init_from: str | None = None
    # RMSNorm, SwiGLU, rotary embedding and the output layer's cross-entropy: torch's plain
    # operations, or Liger Kernel's fused Triton kernels (GPU only); auto picks per device.
    kernels: Kernels = "auto"
    sdpa_backend: SdpaBackend = "auto"  # the attention kernel torch's SDPA may use
    # none: eager; layers: each transformer layer compiled once with torch.compile (regional
    # compilation, runtime/build/compile.py; rules CM1-CM5).
    compile: Compile = "none"

    def __post_init__(self) -> None:
        c = Checks()
        _positive(c, "M1", "model", num_layers=self.num_layers, hidden_size=self.hidden_size,
                  ffn_hidden_size=self.ffn_hidden_size,
                  num_attention_heads=self.num_attention_heads, num_kv_heads=self.num_kv_heads,
                  kv_channels=self.kv_channels, vocab_size=self.vocab_size,
                  max_seq_len=self.max_seq_len, rotary_base=self.rotary_base,
                  norm_epsilon=self.norm_epsilon, init_std=self.init_std)
        _at_most(c, "M1", "model", MAX_LAYERS, num_layers=self.num_layers)
        _at_most(c, "M1", "model", MAX_WIDTH, hidden_size=self.hidden_size,
                 ffn_hidden_size=self.ffn_hidden_size, kv_channels=self.kv_channels)
        _at_most(c, "M1", "model", MAX_HEADS, num_attention_heads=self.num_attention_heads,
                 num_kv_heads=self.num_kv_heads)
        _at_most(c, "M1", "model", MAX_VOCAB, vocab_size=self.vocab_size)
        _at_most(c, "M1", "model", MAX_SEQ_LEN, max_seq_len=self.max_seq_len)
        _at_most(c, "M1", "model", MAX_ROTARY_BASE, rotary_base=self.rotary_base)
        if self.num_kv_heads and self.num_attention_heads > 0:
            c.require(self.num_attention_heads % self.num_kv_heads == 0, "M2",
                      {"model.num_attention_heads": self.num_attention_heads,
                       "model.num_kv_heads": self.num_kv_heads},
                      "num_attention_heads must be a multiple of num_kv_heads (query groups)",
                      "use model.num_kv_heads in {"
                      + ", ".join(map(str, divisors(min(self.num_attention_heads, MAX_HEADS))))
                      + "}")
        if self.kv_channels is None and self.num_attention_heads > 0:
            c.require(self.hidden_size % self.num_attention_heads == 0, "T2",
                      {"model.hidden_size": self.hidden_size,
                       "model.num_attention_heads": self.num_attention_heads},
                      "hidden_size must be divisible by num_attention_heads",
                      "change one of them, or set model.kv_channels (the head dimension)")
        if self.moe is not None:
            c.require(self.moe.frequency <= self.num_layers, "M3",
                      {"model.moe.frequency": self.moe.frequency,
                       "model.num_layers": self.num_layers},
                      "the MoE layer frequency exceeds the number of layers, so only layer 0 "
                      "would be MoE", f"use model.moe.frequency <= {self.num_layers} (1 = every layer)")
            c.require(not (self.moe.experts == "grouped" and self.bias), "E9",
                      {"model.moe.experts": "grouped", "model.bias": True},
                      "grouped experts compute bias-free SwiGLU experts",
                      "use model.moe.experts: sequential (or auto) with biases, or model.bias: false")
        c.raise_if_any()

    @property
    def query_groups(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Megatron's moe_layer_freq=N convention: layer i is MoE when i % N == 0."""
        return self.moe is not None and layer % self.moe.frequency == 0


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual stages per pipeline rank; 1 = plain 1F1B
    ep: int = 1  # expert parallel, carved out of the data-parallel ranks
    etp: int | None = None  # expert tensor parallel; None = tp (Megatron-Core default)
    cp: int = 1  # context parallel: each sequence split over cp ranks (Ulysses)
    dp: int = -1  # -1 = the rest of the world
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        c = Checks()
        for name in ("tp", "pp", "vpp", "ep", "cp"):
            value = getattr(self, name)
            c.require(value >= 1, "P3", {f"parallel.{name}": value}, "must be >= 1",
                      f"set parallel.{name} to 1 or more")
        if self.etp is not None:
            c.require(self.etp >= 1, "P3", {"parallel.etp": self.etp}, "must be >= 1",
                      "set parallel.etp to 1 or more, or leave it out to use tp")
        _at_most(c, "P3", "parallel", MAX_WORLD, tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep,
                 etp=self.etp, cp=self.cp, dp=self.dp)
        c.require(self.dp == -1 or self.dp >= 1, "P3", {"parallel.dp": self.dp},
                  "must be >= 1, or -1 for the rest of the world", "use parallel.dp: -1")
        c.require(not self.sequence_parallel or self.tp > 1, "T3",
                  {"parallel.sequence_parallel": True, "parallel.tp": self.tp},
                  "sequence parallelism splits along the tensor-parallel group and needs tp > 1",
                  "set parallel.sequence_parallel: false, or parallel.tp >= 2")
        c.require(self.vpp == 1 or self.pp > 1, "L3",
                  {"parallel.vpp": self.vpp, "parallel.pp": self.pp},
                  "virtual pipeline stages need pipeline parallelism",
                  "set parallel.vpp: 1, or parallel.pp >= 2")
        c.raise_if_any()

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: int = 1
    offload_optimizer: Offload = "none"
    offload_params: Offload = "none"
    # Share of optimizer state offloaded when offload_optimizer=cpu; < 1 keeps the rest on GPU
    # (DeepSpeed's offload_optimizer.ratio, stage 3 only).
    offload_ratio: float = 1.0

    def __post_init__(self) -> None:
        c = Checks()
        c.require(self.stage in (0, 1, 2, 3), "Z1", {"zero.stage": self.stage},
                  "ZeRO stage must be 0, 1, 2 or 3", "set zero.stage to one of 0, 1, 2, 3")
        c.require(self.offload_params == "none" or self.stage == 3, "Z4",
                  {"zero.offload_params": self.offload_params, "zero.stage": self.stage},
                  "parameter offload exists only in ZeRO stage 3 (DeepSpeed silently ignores it "
                  "below)", "set zero.stage: 3, or zero.offload_params: none")
        c.require(self.offload_optimizer == "none" or self.stage >= 1, "Z4",
                  {"zero.offload_optimizer": self.offload_optimizer, "zero.stage": self.stage},
                  "optimizer offload needs ZeRO stage 1, 2 or 3",
                  "set zero.stage >= 1, or zero.offload_optimizer: none")
        c.require(0 < self.offload_ratio <= 1, "Z4", {"zero.offload_ratio": self.offload_ratio},
                  "must be in (0, 1]", "use 1.0 to offload all optimizer state")
        if self.offload_ratio < 1:
            c.require(self.stage == 3 and self.offload_optimizer == "cpu", "Z4",
                      {"zero.offload_ratio": self.offload_ratio, "zero.stage": self.stage,
                       "zero.offload_optimizer": self.offload_optimizer},
                      "partial optimizer offload (ratio < 1) needs ZeRO stage 3 with "
                      "offload_optimizer: cpu",
                      "set zero.offload_ratio: 1.0, or zero.stage: 3 with zero.offload_optimizer: cpu")
        c.raise_if_any()


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
    # rest as in bf16; needs precision bf16 (runtime/build/fp8.py, rules FP1-FP6).
    fp8: Fp8 = "none"
    activation_checkpointing: Checkpointing = "none"
    seed: int = 1234
    timing_warmup: int = 1  # first steps left out of timing summaries (marked in metrics)
    checkpoint_every: int = 0  # save a checkpoint every N steps and after the last; 0 = never
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
        _positive(c, "B2", "train", seq_len=self.seq_len, global_batch=self.global_batch,
                  micro_batch=self.micro_batch, grad_accum=self.grad_accum)
        _at_most(c, "B2", "train", MAX_SEQ_LEN, seq_len=self.seq_len)
        _at_most(c, "B2", "train", MAX_BATCH, global_batch=self.global_batch,
                 micro_batch=self.micro_batch, grad_accum=self.grad_accum)
        _positive(c, "R1", "train", steps=self.steps, lr=self.lr, adam_eps=self.adam_eps)
        _at_most(c, "R1", "train", MAX_STEPS, steps=self.steps)
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
        c.require(self.checkpoint_every >= 0, "R1", {"train.checkpoint_every": self.checkpoint_every},
                  "must be >= 0",
                  "use train.checkpoint_every: 0 for no checkpoints, or N to save every N steps")
        c.require(self.eval_every >= 0, "R1", {"train.eval_every": self.eval_every},
                  "must be >= 0", "use train.eval_every: 0 for no validation, or N to "
                  "evaluate every N steps and at the end")
        _positive(c, "R1", "train", eval_iters=self.eval_iters)
        _at_most(c, "R1", "train", MAX_STEPS, eval_every=self.eval_every, eval_iters=self.eval_iters)
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


_UNIT_TIME = re.compile(r"([0-9]+)([smhd])")  # 90s, 45m, 3h, 2d
_DAY_TIME = re.compile(r"([0-9]+)-([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")  # D-HH[:MM[:SS]]
_CLOCK_TIME = re.compile(r"(?:([0-9]+):)?([0-9]+):([0-9]+)")  # [HH:]MM:SS
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def time_limit_seconds(value: int | str | None) -> int | None:
    """Seconds of a train.time_limit (None: no limit); ValueError when it is not one.

    An integer is seconds. A string is a whole number with a unit, `90s`, `45m`, `3h`, `2d`,
    or one of Slurm's `--time` forms that has a colon or a day: `MM:SS`, `HH:MM:SS`, `D-HH`,
    `D-HH:MM`, `D-HH:MM:SS`. A bare number in a string is refused: Slurm reads "90" as
    minutes, a recipe's integer 90 is seconds. (YAML 1.1 reads an unquoted 1:30:00 as the
    integer 5400: the same seconds.)"""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a time limit")
    if isinstance(value, int):
        return value
    text = value.strip()
    if match := _UNIT_TIME.fullmatch(text):
        return int(match[1]) * _UNIT_SECONDS[match[2]]
    if match := _DAY_TIME.fullmatch(text):
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        limits = (hours <= 23, minutes <= 59, seconds <= 59)
    elif match := _CLOCK_TIME.fullmatch(text):
        days = 0
        hours, minutes, seconds = (int(g or 0) for g in match.groups())
        limits = (minutes <= 59 or match[1] is None, seconds <= 59)
    else:
        raise ValueError(f"{value!r} is not a time limit")
    if not all(limits):
        raise ValueError(f"{value!r}: a field is out of range")
    return days * 86400 + hours * 3600 + minutes * 60 + seconds


@dataclass(frozen=True, kw_only=True)
class BlendPart:
    """One dataset of a blend: a Megatron dataset prefix and its relative weight."""
    path: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        c = Checks()
        c.require(bool(self.path.strip()) and "\0" not in self.path, "D1",
                  {"data.source[].path": self.path}, "must be a dataset prefix",
                  "write the prefix of PREFIX.bin + PREFIX.idx, e.g. corpus/wiki_text_document")
        c.require(self.weight >= 0, "D5", {"data.source[].weight": self.weight},
                  "a blend weight must be >= 0 (weights are relative shares)",
                  "use a weight such as 0.7 for 70%, or remove the dataset")
        c.raise_if_any()


SYNTHETIC = "synthetic"
SPLIT_NAMES = ("train", "validation", "test")


def split_parts(split: str) -> list[float] | None:
    """The numbers of a split string ("98,1,1" or "98/1/1"; missing trailing parts are 0), or
    None when it is not up to three finite non-negative numbers."""
    parts = [part.strip() for part in re.split(r"[,/]", split)]
    if not 1 <= len(parts) <= 3:
        return None
    try:
        values = [float(part) for part in parts]
    except ValueError:
        return None
    if any(not math.isfinite(v) or v < 0 for v in values):
        return None
    return values + [0.0] * (3 - len(values))


def split_shares(split: str) -> tuple[float, float, float] | None:
    """The train/validation/test shares of a valid split (percent adding up to 100, or
    fractions adding up to 1), or None."""
    values = split_parts(split)
    if values is None:
        return None
    total = sum(values)
    if not any(math.isclose(total, whole, rel_tol=1e-6) for whole in SPLIT_TOTALS):
        return None
    return values[0] / total, values[1] / total, values[2] / total


SPLIT_TOTALS = (100.0, 1.0)


def _split_problem(split: str) -> Problem | None:
    """D6: a split is percent adding up to 100 (or fractions adding up to 1). Megatron
    normalises any numbers; dsforge refuses a total like 101, which is more often a typo."""
    values = split_parts(split)
    if values is None:
        return Problem(rule="D6", fields={"data.split": split},
                       message="must be up to three non-negative numbers for train, validation "
                               "and test, separated by commas",
                       fix='use e.g. data.split: "98,1,1"')
    if split_shares(split) is not None:
        return None
    total = sum(values)
    if total <= 0:
        fix = 'use e.g. data.split: "98,1,1"'
    else:
        fix = "use data.split: \"" + ",".join(f"{100 * v / total:.4g}" for v in values) + "\""
    return Problem(rule="D6", fields={"data.split": split},
                   message=f"adds up to {total:g}: the shares of train, validation and test are "
                           "percent adding up to 100 (or fractions adding up to 1)", fix=fix)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    # "synthetic", a Megatron dataset prefix (PREFIX.bin + PREFIX.idx), a flat token file, or
    # a blend: a list of {path: PREFIX, weight: W} (Megatron's --data-path W1 P1 W2 P2).
    source: str | tuple[BlendPart, ...] = SYNTHETIC
    token_dtype: TokenDtype = "uint16"  # element type of a flat token file
    split: str = "98,1,1"  # train, validation, test shares of each dataset
    tokenizer: str | None = None  # "bytes", a tokenizer.json or a local Hugging Face model folder
    cache_dir: str | None = None  # dataset index cache; None: $XDG_CACHE_HOME/dsforge/indices

    def __post_init__(self) -> None:
        c = Checks()
        if isinstance(self.source, str):
            c.require(bool(self.source.strip()), "D1", {"data.source": self.source},
                      "must not be empty",
                      "use 'synthetic', a dataset prefix or the path of a token file")
            c.require("\0" not in self.source, "D1", {"data.source": self.source},
                      "a path cannot hold a NUL character", "write the dataset's path")
        else:
            c.require(len(self.source) > 0, "D5", {"data.source": []}, "an empty blend",
                      "list at least one {path: PREFIX, weight: W}, or write one prefix")
            weights = [part.weight for part in self.source]
            c.require(not self.source or sum(weights) > 0, "D5", {"data.source[].weight": weights},
                      "the blend weights add up to 0", "give at least one dataset a weight > 0")
        split = _split_problem(self.split)
        if split is not None:
            c.problems.append(split)
        for name in ("tokenizer", "cache_dir"):
            value = getattr(self, name)
            c.require(value is None or (bool(value.strip()) and "\0" not in value), "D1",
                      {f"data.{name}": value}, "must be a path",
                      f"write a path, or leave data.{name} out")
        c.raise_if_any()

    @property
    def is_synthetic(self) -> bool:
        return self.source == SYNTHETIC

    @property
    def kind(self) -> str:
        """"synthetic"; "token_file" (a string naming an existing file: a flat array of ids);
        or "indexed" (Megatron dataset prefixes, one or a blend). Looks at the file system."""
        if self.is_synthetic:
            return "synthetic"
        if isinstance(self.source, str) and os.path.isfile(self.source):
            return "token_file"
        return "indexed"

    @property
    def blend(self) -> tuple[BlendPart, ...]:
        """The datasets named by source (one of weight 1 when it is a single path)."""
        if isinstance(self.source, str):
            return () if self.is_synthetic else (BlendPart(path=self.source),)
        return self.source


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Where metrics go besides RUN_DIR/metrics.jsonl (docs/recipe.md#tracking)."""
    tensorboard: bool = False  # event files under RUN_DIR/tensorboard
    wandb: bool = False  # Weights & Biases (files under RUN_DIR/wandb)
    wandb_project: str = "dsforge"
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"  # offline: no network call at all
    # "A:B": a torch profiler trace of training steps A to B (0-based, as metrics.jsonl counts
    # them) of rank 0, under RUN_DIR/profile. None = no trace.
    profile: str | None = None

    def __post_init__(self) -> None:
        c = Checks()
        c.require(self.profile is None or profile_steps(self.profile) is not None, "R4",
                  {"tracking.profile": self.profile},
                  "not a step range: give the first and last step to trace as A:B with "
                  "0 <= A <= B (0-based, as metrics.jsonl counts steps)",
                  'e.g. tracking.profile: "3:5"; null for no trace')
        c.raise_if_any()

    @property
    def profile_range(self) -> tuple[int, int] | None:
        return None if self.profile is None else profile_steps(self.profile)


_PROFILE = re.compile(r"([0-9]{1,9}):([0-9]{1,9})")


def profile_steps(text: str) -> tuple[int, int] | None:
    """"A:B" -> (A, B) with 0 <= A <= B; None when `text` is not such a range."""
    match = _PROFILE.fullmatch(text.strip())
    if match is None:
        return None
    first, last = int(match.group(1)), int(match.group(2))
    return (first, last) if first <= last else None


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    nodes: int = 1
    gpus_per_node: int
    gpu: str | None = None  # a key of dsforge.hardware.GPUS

    def __post_init__(self) -> None:
        c = Checks()
        _positive(c, "C1", "cluster", nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        _at_most(c, "C1", "cluster", MAX_WORLD, nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        if self.gpu is not None:
            c.require(self.gpu in GPU_KEYS, "C2", {"cluster.gpu": self.gpu}, "unknown GPU",
                      f"use one of {', '.join(GPU_KEYS)}.{did_you_mean(self.gpu, GPU_KEYS)}")
        c.raise_if_any()

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    zero: ZeroConfig = ZeroConfig()
    train: TrainConfig
    data: DataConfig = DataConfig()
    tracking: TrackingConfig = TrackingConfig()
    cluster: ClusterConfig | None = None

    def __post_init__(self) -> None:
        c = Checks()
        c.problems.extend(name_problems(self.name))
        c.raise_if_any()

    @property
    def schedule(self) -> str:
        """Pipeline schedule the recipe asks for: none, 1f1b or interleaved."""
        if self.parallel.pp == 1:
            return "none"
        return "interleaved" if self.parallel.vpp > 1 else "1f1b"


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (trial division up to sqrt(n): n may be a world of a
    million ranks, and validation asks again for every value it suggests)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def name_problems(name: str) -> list[Problem]:
    """N1: a recipe name is a plain file-name word; it names the run directory
    (runs/NAME-TIME) and must not lead out of it."""
    if len(name) <= MAX_NAME and _NAME.fullmatch(name):
        return []
    plain = re.sub(r"[^A-Za-z0-9._-]+", "_", name[:MAX_NAME]).lstrip("._-") or "my_run"
    return [Problem(rule="N1", fields={"name": name},
                    message=f"must be a plain name: letters, digits, '.', '_' and '-', not "
                            f"starting with '.' or '-', at most {MAX_NAME} characters (it names "
                            "the run directory)",
                    fix=f"use e.g. name: {plain}")]
