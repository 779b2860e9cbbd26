"""Opening a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) through Megatron-Core's own
reader, whoever wrote it: `dsforge data prepare`, Megatron-LM's tools/preprocess_data.py or
GPT-NeoX's tools. A prefix is checked before training relies on it: both files present, the
index readable, the data file exactly as long as the index says, and dsforge's record (when
there is one) describing these files.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.data.errors import DataError
from dsforge.data.identity import TokenizerIdentity, read_record

ARGUMENT = "PREFIX"
MAKE_ONE = ("prepare it with `dsforge data prepare INPUT... --tokenizer T --output PREFIX` "
            "(or Megatron-LM's tools/preprocess_data.py)")


def megatron_indexed_dataset():
    """megatron.core.datasets.indexed_dataset; importing it imports megatron.core (seconds)."""
    with warnings.catch_warnings():  # Megatron warns at import that TE/Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    prefix: Path
    documents: int
    sequences: int
    tokens: int
    dtype: str
    identity: TokenizerIdentity | None  # None: no dsforge record (Megatron-LM's, GPT-NeoX's)
    record: dict[str, Any] | None


def open_dataset(prefix: str | Path):
    """(Megatron-Core's IndexedDataset, DatasetInfo) for PREFIX, or a DataError saying what is
    wrong with it."""
    prefix = Path(prefix)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    missing = [p.name for p in (bin_path, idx_path) if not p.is_file()]
    if missing:
        unfinished = list(prefix.parent.glob(f"{prefix.name}.*.partial-*"))
        why = " (a prepare to this prefix has not finished)" if unfinished else ""
        raise DataError(ARGUMENT, str(prefix), f"{' and '.join(missing)} missing{why}", MAKE_ONE)
    module = megatron_indexed_dataset()
    try:
        dataset = module.IndexedDataset(str(prefix))
    except (AssertionError, ValueError, KeyError, OSError, IndexError) as exc:
        raise DataError(ARGUMENT, str(prefix), f"{idx_path.name} is not a Megatron index "
                        f"({type(exc).__name__}: {exc})", MAKE_ONE) from None
    lengths = dataset.sequence_lengths
    tokens = int(lengths.sum(dtype="int64"))
    itemsize = dataset.index.dtype_size
    if os.path.getsize(bin_path) != tokens * itemsize:
        raise DataError(ARGUMENT, str(prefix), f"{bin_path.name} holds "
                        f"{os.path.getsize(bin_path):,} bytes but {idx_path.name} describes "
                        f"{tokens * itemsize:,} ({tokens:,} tokens of {itemsize} bytes): the two "
                        "files do not belong together, or one was cut short", MAKE_ONE)
    recorded = read_record(prefix)
    identity, record = recorded if recorded else (None, None)
    info = DatasetInfo(prefix=prefix, documents=len(dataset.document_indices) - 1,
                       sequences=len(lengths), tokens=tokens, dtype=dataset.index.dtype.__name__,
                       identity=identity, record=record)
    if record is not None and (record.get("tokens"), record.get("documents")) != \
            (info.tokens, info.documents):
        raise DataError(ARGUMENT, str(prefix), f"{prefix}.tokenizer.json records "
                        f"{record.get('documents')} documents and {record.get('tokens')} tokens, "
                        f"the index {info.documents} and {info.tokens}: the record belongs to "
                        "other files", MAKE_ONE)
    return dataset, info


def inspect_dataset(prefix: str | Path) -> DatasetInfo:
    return open_dataset(prefix)[1]
