"""Which tokens of a sequence each context-parallel rank holds, in one place: the data loader
cuts the shards (runtime/loop/data.py) and Ulysses' attention undoes the cut around SDPA
(runtime/assemble/layers.py).

The sequence is cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r, so every rank
does the same causal attention work (a rank with a late chunk also holds an early one). It is
the order Megatron-Core's rotary embedding slices its positions in
(rope_utils.get_pos_emb_on_this_cp_rank), so the positions follow the tokens without a patch.
"""

from __future__ import annotations

import torch


def context_shard(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The positions context-parallel rank `cp_rank` of `cp` holds, in its order."""
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)])


def gathered_order(seq_len: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a sequence gathered from every rank's shard, ranks in turn (Ulysses' all-to-all):
    the indices that put it in the sequence's order, and those that put it back."""
    gathered = torch.cat([context_shard(seq_len, cp, r) for r in range(cp)])
    return gathered.argsort(), gathered
