"""Documents in a packed sequence: where they start and end, from the EOD ids.

A sample packs documents end to end, each ended by the EOD token, and cuts them at the
sample's edges (Megatron's GPTDataset, a flat token file). As Megatron-LM counts them
(`_get_ltor_masks_and_position_ids`), the EOD belongs to the document it ends: the token
after it starts the next one. A document cut at the sample's start is a document of its own
there: its first token in the sample is at position 0 and sees nothing of what came before.

For the inputs of a sample (seq_len tokens):
- `document_ids`: the document of each input position, 0, 1, ... in sequence order (the EODs
  strictly before it); attention stays among equal ids.
- `reset_positions`: each position's place in its document (0 at its first token), for RoPE.
- `loss_mask`: 0 where the input is the EOD (its label is the next document's first token,
  which nothing in the document predicts), else 1 (Megatron's eod_mask_loss).
"""

from __future__ import annotations

import torch


def document_ids(inputs: torch.Tensor, eod: int) -> torch.Tensor:
    """[batch, seq] int32 ids of the document each input position belongs to."""
    is_eod = (inputs == eod).to(torch.int32)
    return (torch.cumsum(is_eod, dim=-1) - is_eod).to(torch.int32)


def reset_positions(documents: torch.Tensor) -> torch.Tensor:
    """[batch, seq] int64: each position's distance from its document's first token."""
    seq = documents.shape[-1]
    index = torch.arange(seq).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(first, dim=-1).values


def loss_mask(inputs: torch.Tensor, eod: int) -> torch.Tensor:
    """[batch, seq] float32: 0 where the input is the EOD, else 1."""
    return (inputs != eod).to(torch.float32)


def document_lengths(documents: torch.Tensor) -> list[int]:
    """The lengths of the documents of one sample's ids, in order."""
    return torch.unique_consecutive(documents, return_counts=True)[1].tolist()


def score_pairs(documents: torch.Tensor) -> int:
    """The (query, key) pairs of the score matrices attention within documents computes, in
    estimate/flops.py's count (each document's full square, the causal half not taken): the
    sum over the rows of [batch, seq] ids of their documents' squared lengths. seq^2 a row
    without documents."""
    rows, seq = documents.shape
    flat = documents.long() + torch.arange(rows).unsqueeze(1) * seq  # each row's ids apart
    counts = torch.bincount(flat.flatten())
    return int((counts * counts).sum())


def attention_share(pairs: float, sequences: int, seq_len: int) -> float:
    """The share of the sequences' full score matrices (seq_len^2 each) that `pairs` are."""
    return pairs / (sequences * seq_len * seq_len)
