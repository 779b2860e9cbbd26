"""Opening a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) through Megatron-Core's own
reader, whoever wrote it: `dsforge data prepare`, Megatron-LM's tools/preprocess_data.py or
GPT-NeoX's tools. A prefix is checked before training relies on it: both files present, the
index readable, the data file exactly as long as the index says, and dsforge's record (when
there is one) describing these files.
"""

from __future__ import annotations

import functools
import os
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsforge.data.errors import EXIT_INVALID, DataError
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


@functools.cache
def _reader():
    """Megatron-Core's IndexedDataset, without the AttributeError its __del__ prints for an
    object whose __init__ failed on a bad .idx."""
    class Reader(megatron_indexed_dataset().IndexedDataset):
        def __del__(self) -> None:
            if "index" in self.__dict__ and "bin_reader" in self.__dict__:
                super().__del__()
    return Reader


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
    if os.path.getsize(bin_path) == 0:  # Megatron cannot memory-map it
        raise DataError(ARGUMENT, str(prefix), f"{bin_path.name} is empty: it holds no tokens",
                        MAKE_ONE)
    try:
        dataset, unreadable = _reader()(str(prefix)), None
    except (AssertionError, ValueError, KeyError, OSError, IndexError, OverflowError,
            struct.error) as exc:  # what a cut-short or foreign .idx makes Megatron raise
        kind = "struct.error" if isinstance(exc, struct.error) else type(exc).__name__
        dataset, unreadable = None, f"{kind}: {exc}"
    if unreadable is not None:  # raised here, the error holds no frame of the failed reader
        raise DataError(ARGUMENT, str(prefix), f"{idx_path.name} is not a Megatron index "
                        f"({unreadable})", MAKE_ONE)
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


def _megatron_split():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import blended_megatron_dataset_config
    return blended_megatron_dataset_config


def parse_split(split: str) -> list[float]:
    """The train, validation and test shares Megatron-Core reads from a split string (its own
    parser: the runs of digits and dots, normalised). Raises what it raises (AssertionError,
    ValueError) for a string it cannot read."""
    return _megatron_split().parse_and_normalize_split(split)


def split_ranges(split: str, sequences: int) -> list[tuple[int, int] | None]:
    """The [first, last) sequence indices of the train, validation and test parts of a dataset
    of `sequences` sequences, exactly as Megatron-Core cuts them: its split matrix
    (BlendedMegatronDatasetConfig), then the rounded book-ends of
    BlendedMegatronDatasetBuilder._build_megatron_dataset_splits over GPTDataset's elements,
    which are sequences (GPTDataset.numel_low_level_dataset), not documents. None: the split
    gives that part no share, and Megatron builds no dataset for it."""
    matrix = _megatron_split().convert_split_vector_to_split_matrix(parse_split(split))
    return [None if bounds is None else
            (int(round(bounds[0] * float(sequences))), int(round(bounds[1] * float(sequences))))
            for bounds in matrix]


SCAN_CHUNK = 1 << 24  # tokens per read of a full scan (32-64 MiB)


def largest_token_id(prefix: str | Path, dtype: str, chunk: int = SCAN_CHUNK) -> int | None:
    """The largest token id in PREFIX.bin (None when it holds none), read through a memory map
    in chunks: the whole corpus is read, so only `dsforge data inspect --scan` calls it."""
    tokens = np.memmap(f"{prefix}.bin", dtype=np.dtype(dtype), mode="r")
    if len(tokens) == 0:
        return None
    return max(int(tokens[start:start + chunk].max()) for start in range(0, len(tokens), chunk))


def describe(info: DatasetInfo) -> list[str]:
    """What `dsforge data inspect` prints about a dataset."""
    tokenizer = (info.identity.summary() if info.identity is not None else
                 "no dsforge record: made by Megatron-LM/GPT-NeoX tools?")
    return [f"{info.prefix}", f"  documents  {info.documents:,}",
            f"  sequences  {info.sequences:,}", f"  tokens     {info.tokens:,}",
            f"  dtype      {info.dtype}", f"  tokenizer  {tokenizer}"]


def inspect_main(prefix: str, *, scan: bool) -> int:
    """`dsforge data inspect`: the dataset's counts and tokenizer on stdout; with `scan`, the
    largest token id of the whole corpus. Exit status 0, or 2 with the reason on stderr."""
    try:
        _, info = open_dataset(prefix)
    except DataError as exc:
        print(f"dsforge data inspect: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print("\n".join(describe(info)))
    if scan:
        started = time.perf_counter()
        largest = largest_token_id(info.prefix, info.dtype)
        seconds = time.perf_counter() - started
        shown = "none (no tokens)" if largest is None else f"{largest:,}"
        fits = ""
        if largest is not None and info.identity is not None:
            vocab = info.identity.vocab_size
            fits = (f" (fits the recorded vocabulary of {vocab:,})" if largest < vocab else
                    f" (BEYOND the recorded vocabulary of {vocab:,})")
        print(f"  largest id {shown}{fits}; scanned {info.tokens:,} tokens in {seconds:.1f} s")
    return 0
