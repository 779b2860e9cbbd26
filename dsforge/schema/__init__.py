"""The recipe's schema: one frozen, keyword-only dataclass per YAML section, a module each
(model.py, parallel.py for `parallel:` and `zero:`, train.py, data.py, tracking.py for
`tracking:` and `cluster:`), the bounds they check against (limits.py), the values written as
text (parsing.py), and `Recipe` (recipe.py). Everything is imported from `dsforge.schema`, as
before the split: the modules are where to read and change a section."""

from dsforge.schema.data import SPLIT_NAMES, SYNTHETIC, BlendPart, DataConfig, TokenDtype
from dsforge.schema.limits import (MAX_BATCH, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_NAME,
                                   MAX_ROTARY_BASE, MAX_SEQ_LEN, MAX_STEPS, MAX_VOCAB,
                                   MAX_WIDTH, MAX_WORLD, SEED_LIMIT)
from dsforge.schema.model import (VOCAB_DIVISIBLE_BY, Compile, Kernels, ModelConfig, MoEConfig,
                                  MoeExperts, SdpaBackend, padded_vocab_size)
from dsforge.schema.parallel import Offload, ParallelConfig, ZeroConfig
from dsforge.schema.parsing import (SPLIT_TOTALS, divisors, name_problems, profile_steps,
                                    split_parts, split_shares, time_limit_seconds)
from dsforge.schema.recipe import Recipe
from dsforge.schema.tracking import ClusterConfig, TrackingConfig
from dsforge.schema.train import (TORCH_ADAM_IMPLS, AdamImpl, Checkpointing, Fp8, LrDecay,
                                  OnNonfinite, OnSpike, Precision, TrainConfig)

__all__ = [
    "MAX_BATCH", "MAX_EXPERTS", "MAX_HEADS", "MAX_LAYERS", "MAX_NAME", "MAX_ROTARY_BASE",
    "MAX_SEQ_LEN", "MAX_STEPS", "MAX_VOCAB", "MAX_WIDTH", "MAX_WORLD", "SEED_LIMIT",
    "SPLIT_NAMES", "SPLIT_TOTALS", "SYNTHETIC", "TORCH_ADAM_IMPLS", "VOCAB_DIVISIBLE_BY",
    "AdamImpl", "BlendPart", "Checkpointing", "ClusterConfig", "Compile", "DataConfig", "Fp8",
    "Kernels", "LrDecay", "ModelConfig", "MoEConfig", "MoeExperts", "Offload", "OnNonfinite",
    "OnSpike", "ParallelConfig", "Precision", "Recipe", "SdpaBackend", "TokenDtype",
    "TrackingConfig", "TrainConfig", "ZeroConfig", "divisors", "name_problems",
    "padded_vocab_size", "profile_steps", "split_parts", "split_shares", "time_limit_seconds",
]
