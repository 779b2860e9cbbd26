"""Byte-level tokenizer: UTF-8 bytes are the token ids (vocabulary 256, no files to download)."""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
