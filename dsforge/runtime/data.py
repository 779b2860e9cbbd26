"""Training samples: synthetic or a token file, addressed by global sample id.

Step t of a run consumes global samples [t*G, (t+1)*G) (G = global batch). Data-parallel
rank r takes, for microbatch k, the micro_batch samples starting at (k*dp + r)*micro_batch,
so any layout sees the same samples per step as a single process does, and resuming at step
t needs no state beyond t. Each sample is seq_len + 1 tokens: inputs and shifted labels.

- synthetic: tokens drawn from a generator seeded by (seed, sample id).
- a token file: a flat array of uint16/uint32 ids read through a memory map, cut into
  windows of seq_len + 1 (consecutive windows share one token), visited in a seeded random
  order that is reshuffled every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class SyntheticTokens:
    def __init__(self, *, seq_len: int, vocab_size: int, seed: int):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)


class TokenFile:
    def __init__(self, path: str | Path, *, seq_len: int, vocab_size: int, seed: int,
                 dtype: str = "uint16"):
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len, self.seed = seq_len, seed
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{path}: {len(self.tokens)} tokens is fewer than one sample of "
                             f"seq_len + 1 = {seq_len + 1}; use a longer file or a shorter seq_len")
        largest = int(self.tokens.max())
        if largest >= vocab_size:
            raise ValueError(f"{path}: token id {largest} is outside the model's vocabulary "
                             f"({vocab_size}); check data.token_dtype and model.vocab_size")
        self._epoch, self._order = -1, None

    def sample(self, index: int) -> torch.Tensor:
        epoch, position = divmod(index, self.num_samples)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.num_samples)
        start = int(self._order[position]) * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].astype(np.int64)
        return torch.from_numpy(window)


@dataclass(frozen=True)
class Microbatch:
    tokens: torch.Tensor  # [micro_batch, seq_len] inputs
    labels: torch.Tensor  # [micro_batch, seq_len] next tokens
    position_ids: torch.Tensor


def microbatches(source, *, step: int, global_batch: int, micro_batch: int, grad_accum: int,
                 dp: int, dp_rank: int) -> list[Microbatch]:
    """The grad_accum microbatches data-parallel rank `dp_rank` trains on at `step`."""
    batches = []
    for k in range(grad_accum):
        first = step * global_batch + (k * dp + dp_rank) * micro_batch
        rows = torch.stack([source.sample(first + i) for i in range(micro_batch)])
        seq_len = rows.shape[1] - 1
        positions = torch.arange(seq_len).unsqueeze(0).expand(micro_batch, -1)
        batches.append(Microbatch(tokens=rows[:, :-1].contiguous(), labels=rows[:, 1:].contiguous(),
                                  position_ids=positions))
    return batches


def open_source(*, source: str, seq_len: int, vocab_size: int, seed: int, token_dtype: str = "uint16"):
    if source == "synthetic":
        return SyntheticTokens(seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    return TokenFile(source, seq_len=seq_len, vocab_size=vocab_size, seed=seed, dtype=token_dtype)
