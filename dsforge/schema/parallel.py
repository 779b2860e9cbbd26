"""The `parallel:` and `zero:` sections (docs/recipe.md#parallel, #zero)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsforge.problems import Checks
from dsforge.schema.limits import MAX_WORLD, require_at_most


Offload = Literal["none", "cpu"]


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
        require_at_most(c, "P3", "parallel", MAX_WORLD, tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep,
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
