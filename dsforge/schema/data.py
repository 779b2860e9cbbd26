"""The `data:` section (docs/recipe.md#data)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from dsforge.problems import Checks
from dsforge.schema.parsing import split_problem


TokenDtype = Literal["uint16", "uint32"]


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


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    # "synthetic", a Megatron dataset prefix (PREFIX.bin + PREFIX.idx), a flat token file, or
    # a blend: a list of {path: PREFIX, weight: W} (Megatron's --data-path W1 P1 W2 P2).
    source: str | tuple[BlendPart, ...] = SYNTHETIC
    token_dtype: TokenDtype = "uint16"  # element type of a flat token file
    split: str = "98,1,1"  # train, validation, test shares of each dataset
    tokenizer: str | None = None  # "bytes", a tokenizer.json or a local Hugging Face model folder
    cache_dir: str | None = None  # dataset index cache; None: $XDG_CACHE_HOME/dsforge/indices
    # Packed documents (docs/data.md#documents-in-a-packed-sequence): attention stays inside
    # each document of a sequence; positions restart at each document (RoPE); no loss on the
    # position whose input is the EOD (Megatron-LM's --reset-attention-mask,
    # --reset-position-ids, --eod-mask-loss).
    document_masking: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    eod_id: int | None = None  # the end-of-document id; a dataset's record names its own

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
        split = split_problem(self.split)
        if split is not None:
            c.problems.append(split)
        c.require(self.eod_id is None or self.eod_id >= 0, "D17", {"data.eod_id": self.eod_id},
                  "a token id is >= 0", "write the tokenizer's end-of-document id")
        c.require(self.eod_id is None or self.documents, "D17", {"data.eod_id": self.eod_id},
                  "names where documents end for the document options, and none of them is "
                  "on: it would change nothing", "set data.document_masking: true (or "
                  "eod_mask_loss), or leave data.eod_id out")
        c.require(not self.reset_position_ids or self.document_masking, "D17",
                  {"data.reset_position_ids": True, "data.document_masking": False},
                  "positions restarting at each document while attention still reaches the "
                  "documents before would give tokens of two documents the same position",
                  "set data.document_masking: true as well, or leave reset_position_ids out")
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
    def documents(self) -> bool:
        """Whether the ranks look for document boundaries (any of the three options)."""
        return self.document_masking or self.reset_position_ids or self.eod_mask_loss

    @property
    def blend(self) -> tuple[BlendPart, ...]:
        """The datasets named by source (one of weight 1 when it is a single path)."""
        if isinstance(self.source, str):
            return () if self.is_synthetic else (BlendPart(path=self.source),)
        return self.source
