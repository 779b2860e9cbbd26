"""Who tokenized a prepared dataset: the PREFIX.tokenizer.json record written beside it.

A Megatron indexed dataset (PREFIX.bin + PREFIX.idx) holds token ids only; nothing in it says
which tokenizer made them. `dsforge data prepare` records the tokenizer's identity and the
dataset's counts in PREFIX.tokenizer.json so that training can refuse a model whose vocabulary
is too small or a tokenizer that is not the one the data was made with (`mismatches`).
Datasets written by Megatron-LM's or GPT-NeoX's tools have no such record (`read_record`
returns None for them).

The record is written before PREFIX.idx is renamed into place (prepare.py), so a dataset that
looks complete always has its record.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dsforge.data.errors import DataError
from dsforge.files import write_atomic

RECORD_FORMAT = "dsforge.prepared-dataset"
RECORD_VERSION = 1
RECORD_SUFFIX = ".tokenizer.json"


@dataclass(frozen=True, kw_only=True)
class TokenizerIdentity:
    """What a tokenizer is, independent of where it lies on this machine.

    kind: "bytes", "tokenizers" (a tokenizer.json) or "transformers" (a model folder without one)
    name: what was given to --tokenizer; path: its absolute path (None for "bytes")
    vocab_size: largest id + 1, the smallest model vocabulary that fits every id it emits
    eod_id / eod_token: the end-of-document token appended to every document
    special_ids: every special token and its id
    sha256: hash of the files that define the tokenization (identical for a tokenizer.json and
      the model folder that holds it)
    """

    kind: str
    name: str
    path: str | None
    vocab_size: int
    eod_id: int
    eod_token: str | None
    special_ids: dict[str, int] = field(default_factory=dict)
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for messages: what it is, where, its vocabulary, EOD and a short hash."""
        where = "" if self.kind == self.name else f" {self.path or self.name}"
        eod = f"{self.eod_id}" + (f" {self.eod_token!r}" if self.eod_token else "")
        return (f"{self.kind}{where} (vocab_size {self.vocab_size:,}, eod {eod}, "
                f"sha256 {self.sha256[:12]})")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TokenizerIdentity":
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})


def mismatches(recorded: TokenizerIdentity, current: TokenizerIdentity) -> list[str]:
    """What differs between the tokenizer a dataset was made with and another one; empty when
    they tokenize alike. Names and paths are not compared: they differ between machines."""
    found = []
    for name in ("sha256", "vocab_size", "eod_id"):
        if getattr(recorded, name) != getattr(current, name):
            found.append(f"{name}: dataset {getattr(recorded, name)!r}, "
                         f"tokenizer {getattr(current, name)!r}")
    return found


def recorded_eods(identities: Iterable[TokenizerIdentity | None]) -> list[int]:
    """The end-of-document ids the datasets' records name (datasets without one name none)."""
    return sorted({identity.eod_id for identity in identities if identity is not None})


def end_of_document(eod_id: int | None,
                    identities: Iterable[TokenizerIdentity | None]) -> int | None:
    """The id packed documents end with (data.document_masking): data.eod_id when set, else
    the one id the datasets' records name; None when they name none, or several. Rule D17
    (recipe/data_rules/documents.py) refuses those before any rank starts, and a data.eod_id
    the records contradict; the ranks take what this returns."""
    if eod_id is not None:
        return eod_id
    recorded = recorded_eods(identities)
    return recorded[0] if len(recorded) == 1 else None


def record_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{RECORD_SUFFIX}")


def record_text(identity: TokenizerIdentity, dataset: dict[str, Any]) -> str:
    record = {"format": RECORD_FORMAT, "version": RECORD_VERSION,
              "tokenizer": identity.to_dict(), "dataset": dataset}
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def write_record(prefix: str | Path, identity: TokenizerIdentity, dataset: dict[str, Any]) -> Path:
    """Write PREFIX.tokenizer.json atomically (a reader sees the old record or the new one)."""
    path = record_path(prefix)
    write_atomic(path, record_text(identity, dataset))
    return path


def is_record(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == RECORD_FORMAT


def read_record(prefix: str | Path) -> tuple[TokenizerIdentity, dict[str, Any]] | None:
    """The tokenizer identity and dataset counts recorded for PREFIX, or None when the dataset
    has no record (one written by Megatron-LM's or GPT-NeoX's tools)."""
    path = record_path(prefix)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DataError("PREFIX", str(prefix), f"{path} cannot be read ({exc})",
                        "prepare the dataset again with `dsforge data prepare`") from None
    try:
        if is_record(data) and data.get("version") == RECORD_VERSION:
            return TokenizerIdentity.from_dict(data["tokenizer"]), data.get("dataset", {})
    except (KeyError, TypeError):
        pass
    raise DataError("PREFIX", str(prefix), f"{path} is not a dsforge dataset record "
                    f"(format {RECORD_FORMAT!r} version {RECORD_VERSION})",
                    "prepare the dataset again with `dsforge data prepare`, or remove the file")
