"""The layout-free state of a checkpoint: file names and the record of each piece.

CHECKPOINT/dsforge_state/
  rankNNNNN.safetensors   the pieces rank NNNNN owns, as flat fp32 tensors; the file's
                          metadata "pieces" is a JSON list of Piece records
  state.json              written by rank 0: what is not a tensor (steps, the optimizer's
                          hyperparameters and step count, the scheduler, the loss scaler,
                          the padded vocabulary, the number of rank files)

A piece is a contiguous range [start, start + numel) of one tensor-parallel shard of one
parameter's state ("fp32": the optimizer's master weights, "exp_avg", "exp_avg_sq": Adam's
moments), flattened in row-major order. Each piece is written by exactly one rank: ZeRO
partitions a shard over the data-parallel ranks, which write their own range; without ZeRO,
data-parallel rank 0 writes the whole shard; a parameter replicated over tensor-parallel ranks
is written by tensor-parallel rank 0 only, recorded with tp_size 1. Pieces therefore tile each
shard exactly, which the reader checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

LATEST = "latest"  # beside the checkpoint directories: the tag of the newest complete one
COMPLETE = "dsforge_complete.json"  # the completion marker every checkpoint directory ends with
STATE_DIR = "dsforge_state"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def rank_file(rank: int) -> str:
    """A rank's layout-free state, in STATE_DIR."""
    return f"rank{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    """A rank's RNG states, in the checkpoint directory."""
    return f"dsforge_rng_rank{rank:05d}.pt"


def experts_file(rank: int) -> str:
    """A rank's expert weights (with expert parallelism), in the checkpoint directory."""
    return f"dsforge_experts_rank{rank:05d}.pt"


@dataclass(frozen=True)
class Piece:
    key: str  # the tensor's key in the rank file
    name: str  # the parameter's global name (ckpt/names.py)
    state: str  # one of STATES
    full_shape: tuple[int, ...]
    tp_dim: int | None
    stride: int
    tp_rank: int
    tp_size: int
    local_shape: tuple[int, ...]  # the tensor-parallel shard's shape
    start: int  # offset of this piece in the flattened shard
    numel: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> "Piece":
        return cls(**{**record, "full_shape": tuple(record["full_shape"]),
                      "local_shape": tuple(record["local_shape"])})


def piece_key(state: str, name: str, tp_rank: int, start: int) -> str:
    return f"{state}/{name}/tp{tp_rank}/{start}"
