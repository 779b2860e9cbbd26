"""The recipe: one frozen, keyword-only dataclass per YAML section (this package's modules).

Rules that concern one section only are checked in that section's __post_init__ and raised
together (RecipeError). Rules that span sections or need the world size live in
`dsforge.recipe.validate`. Field names are the public recipe interface (docs/recipe.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.problems import Checks
from dsforge.schema.data import DataConfig
from dsforge.schema.model import ModelConfig
from dsforge.schema.parallel import ParallelConfig, ZeroConfig
from dsforge.schema.parsing import name_problems
from dsforge.schema.tracking import ClusterConfig, TrackingConfig
from dsforge.schema.train import TrainConfig


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
