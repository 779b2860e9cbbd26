"""Training and validation samples from prepared datasets, through Megatron-Core.

`build_splits` turns the recipe's data section (one prefix or a weighted blend, the split) into
Megatron-Core's `GPTDataset`s, blended by `BlendedMegatronDatasetBuilder` exactly as
Megatron-LM's `--data-path W1 P1 W2 P2 --split 98,1,1` would: the same split of each dataset's
sequences, sample index, shuffle and blending index (Megatron's compiled helpers), cached as .npy files.

Which samples a split holds depends only on the recipe (seed, seq_len, split, weights, the
number of samples asked for), never on the layout, so every layout reads the same samples for
global sample id i (runtime/loop/data.py assigns ids to ranks).

Index building, once per node: Megatron-Core builds the index cache on global rank 0 and has
every other rank load it, which fails on nodes that do not share rank 0's file system
(Megatron-LM issue 907). dsforge builds before the job's process group exists: each rank takes
an exclusive flock on CACHE_DIR/.build.lock, the first rank of a node builds (in a private
one-process world, so Megatron's rank-0 paths run locally) and the others find the cache and
only memory-map it. A second run with the same recipe data reuses the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from dsforge.data.identity import TokenizerIdentity
from dsforge.lock import exclusive


class DatasetTokenizer:
    """What Megatron's GPTDataset asks of a tokenizer, from the dataset's recorded identity.

    Samples never need text: GPTDataset reads `eod` only for EOD-based masks (off here) and
    `pad` to mask padding (it has none here: Megatron then uses -1, no real id). Its identity
    enters the cache key, so a dataset re-made with another tokenizer gets new indices."""

    def __init__(self, identity: TokenizerIdentity | None):
        self.vocab_size = identity.vocab_size if identity else None
        self.eod = identity.eod_id if identity else -1
        self.unique_identifiers = OrderedDict(
            [("class", "dsforge.DatasetTokenizer"), ("vocab_size", self.vocab_size),
             ("eod", self.eod), ("sha256", identity.sha256 if identity else None)])

    @property
    def pad(self) -> int:
        raise AttributeError("no pad token: samples are never padded")


@dataclass(frozen=True)
class Splits:
    train: object  # a Megatron GPTDataset or BlendedDataset
    validation: object | None  # None: not asked for, or the split gives it no share
    built: bool  # index files were written since this process started (by it, or by another
    # rank of the node that took the build lock first); False: all came from the cache
    seconds: float


class MegatronSamples:
    """Global sample id -> seq_len + 1 token ids (inputs and shifted labels), as runtime/loop/data.py's
    other sources."""

    def __init__(self, dataset, *, what: str):
        self.dataset, self.what = dataset, what

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, index: int) -> torch.Tensor:
        item = self.dataset[index % len(self.dataset)]
        return torch.cat([item["tokens"], item["labels"][-1:]])

    def locate(self, index: int) -> tuple[str, str, list[int]]:
        """("documents", the dataset's path prefix, the ids of the documents sample `index`
        spans), through a blend to the dataset it draws from."""
        dataset, index = self.dataset, index % len(self.dataset)
        if hasattr(dataset, "dataset_sample_index"):  # a BlendedDataset
            dataset[index]  # maps its index files on first use
            dataset, index = (dataset.datasets[int(dataset.dataset_index[index])],
                              int(dataset.dataset_sample_index[index]))
        _, documents = dataset._query_document_sample_shuffle_indices(index)
        return "documents", str(dataset.dataset_path), [int(d) for d in documents]


def build_splits(parts: list[tuple[str, float]], *, split: str, seq_len: int, seed: int,
                 train_samples: int, validation_samples: int | None,
                 identity: TokenizerIdentity | None, cache_dir: Path) -> Splits:
    """The train and, when `validation_samples` is given, validation datasets of the blend
    `parts` ((prefix, weight); weight-0 parts left out) with at least the sample counts asked
    for. Parts dsforge does not read (the test part; validation without evaluation) are not
    built: Megatron would build every part with a share, and an empty one loops forever in
    GPTDataset._get_num_epochs. Leaving them out changes no document's part."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    used = [(path, weight) for path, weight in parts if weight > 0]
    blend = ([path for path, _ in used], [w for _, w in used] if len(used) > 1 else None)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_len, blend=blend, split=split,
        path_to_cache=str(cache_dir), tokenizer=DatasetTokenizer(identity),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, mmap_bin_files=True)
    # split_matrix holds each part's book-ends (Megatron's own, from `split`); a None part is
    # skipped by the builder, the others keep their documents.
    config.split_matrix = [config.split_matrix[0],
                           config.split_matrix[1] if validation_samples else None, None]
    sizes = [train_samples, validation_samples or 0, 0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _node_build(cache_dir), _quiet_megatron():
        train, validation, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, lambda: True, config).build()
    return Splits(train=train, validation=validation, built=_written_since_start(cache_dir),
                  seconds=time.perf_counter() - started)


def _written_since_start(cache_dir: Path) -> bool:
    """Whether index files in `cache_dir` are newer than this process: the ranks of a job
    start together, before any of them builds, so this tells a job that built its indices
    from one that found them, whichever rank of the node took the lock first."""
    import psutil  # a DeepSpeed dependency

    started = psutil.Process().create_time()
    return any(entry.stat().st_mtime >= started for entry in os.scandir(cache_dir)
               if entry.name.endswith(".npy"))


@contextlib.contextmanager
def _node_build(cache_dir: Path) -> Iterator[None]:
    """One builder per node at a time (the flock), each in a private one-process gloo world:
    Megatron's builder asks torch.distributed for the rank (unguarded in BlendedDataset) and
    builds caches on rank 0 only. Inside an existing process group (the tests' shared worlds
    train several recipes in one) Megatron's own rank-0-first build runs as it is: a flock
    there would deadlock with its barrier."""
    if torch.distributed.is_initialized():
        yield
        return
    store = torch.distributed.HashStore()
    with exclusive(cache_dir / ".build.lock"):
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    """Megatron logs every index it builds at INFO and warns about optional kernels: the run
    directory's job.log gets them only with --verbose ranks; the terminal never."""
    logger = logging.getLogger("megatron.core.datasets")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)
