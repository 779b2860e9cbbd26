"""Training and validation samples, addressed by global sample id.

Step t of a run consumes global samples [t*G, (t+1)*G) (G = global batch). Data-parallel
rank r takes, for microbatch k, the micro_batch samples starting at (k*dp + r)*micro_batch,
so any layout sees the same samples per step as a single process does, and resuming at step
t needs no state beyond t. Each sample is seq_len + 1 tokens: inputs and shifted labels.
An evaluation reads validation batches 0 .. eval_iters - 1 the same way: the same held-out
samples every time, so successive validation losses are comparable.

- synthetic: tokens drawn from a generator seeded by (seed, stream, sample id); validation is
  a second stream.
- indexed (Megatron dataset prefixes, one or a weighted blend): Megatron-Core's GPTDataset and
  BlendedDataset (dsforge/data/samples.py), split into train/validation/test by the
  dataset's sequences (one a document in what `dsforge data prepare` writes).
- a flat token file: a flat array of uint16/uint32 ids read through a memory map, cut into
  windows of seq_len + 1 (consecutive windows share one token); the split cuts the windows
  into contiguous train/validation/test ranges, each visited in a seeded random order that
  is reshuffled every epoch.
Nothing scans a corpus at start-up: the recipe's validation checks token ids from the
dataset's record or a sample of the file, and every microbatch is checked as it is made.

With packed documents (data.document_masking, reset_position_ids, eod_mask_loss) a microbatch
also carries its sequences' document ids, their reset positions and the loss mask
(dsforge/data/documents.py), found before the sequence is cut into context-parallel shards;
`weigh_loss` makes a masked loss the mean over the global batch's counted tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from dsforge.recipe import Resolved
from dsforge.runtime.context_shards import context_shard

TRAIN, VALIDATION = 0, 1


class Source(Protocol):
    what: str  # names the samples in errors

    def sample(self, index: int) -> torch.Tensor: ...

    def locate(self, index: int) -> tuple[str, str, list[int]] | None:
        """Where sample `index` comes from, to find a bad batch: (what the numbers are, the
        file, the numbers), e.g. ("documents", "data/wiki", [311, 312]); None for synthetic."""


class SyntheticTokens:
    def __init__(self, *, seq_len: int, vocab_size: int, seed: int, stream: int = TRAIN):
        self.seq_len, self.vocab_size, self.seed, self.stream = seq_len, vocab_size, seed, stream
        self.what = "synthetic " + ("training" if stream == TRAIN else "validation") + " samples"

    def sample(self, index: int) -> torch.Tensor:
        if self.stream == TRAIN:  # the seeds training has always used
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        # torch's CPU generator keeps 32 bits of a seed; numpy's takes the whole key.
        rng = np.random.default_rng([self.seed, self.stream, index])
        return torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64))

    def locate(self, index: int) -> None:
        return None


class TokenFile:
    """The windows [first, last) of a flat token file, in a seeded order per epoch."""

    def __init__(self, path: str | Path, *, seq_len: int, seed: int, dtype: str,
                 windows: range, stream: int):
        self.path, self.tokens = path, np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len, self.seed, self.stream, self.windows = seq_len, seed, stream, windows
        self.what = f"{path} ({'training' if stream == TRAIN else 'validation'} windows)"
        self._epoch, self._order = -1, None

    def sample(self, index: int) -> torch.Tensor:
        start = self._start(index)
        window = self.tokens[start:start + self.seq_len + 1].astype(np.int64)
        return torch.from_numpy(window)

    def locate(self, index: int) -> tuple[str, str, list[int]]:
        return "token offsets", str(self.path), [self._start(index)]

    def _start(self, index: int) -> int:
        """The offset in the file of window `index`'s first token."""
        epoch, position = divmod(index, len(self.windows))
        if epoch != self._epoch:
            key = [self.seed, epoch] if self.stream == TRAIN else [self.seed, epoch, self.stream]
            rng = np.random.default_rng(key)
            self._epoch, self._order = epoch, rng.permutation(len(self.windows))
        return self.windows[int(self._order[position])] * self.seq_len


def split_ranges(count: int, split: str) -> list[range]:
    """[0, count) cut into train/validation/test ranges exactly as Megatron-Core cuts a
    dataset's sequences (dsforge/data/indexed.py, the one place of that rule)."""
    from dsforge.data.indexed import split_ranges as megatron_ranges

    return [range(*bounds) if bounds else range(0) for bounds in megatron_ranges(split, count)]


@dataclass(frozen=True)
class Sources:
    train: Source
    validation: Source | None  # None: evaluation not asked for
    note: str | None = None  # what opening them did, for the user (indexed datasets)
    eod: int | None = None  # the end-of-document id, where the data has one


@dataclass(frozen=True)
class Documents:
    """What a microbatch carries of its packed documents (data.document_masking,
    reset_position_ids, eod_mask_loss; dsforge/data/documents.py)."""

    eod: int
    masking: bool = False  # the document ids of each whole sequence, for the attention
    reset_positions: bool = False  # position ids restart at each document
    eod_mask_loss: bool = False  # no loss where the input is the EOD

    @classmethod
    def of(cls, resolved: Resolved, eod: int | None) -> Documents | None:
        data = resolved.recipe.data
        if not data.documents:
            return None
        if eod is None:  # validation (D17) refuses this before any rank starts
            raise ValueError("data.document_masking and its companions need an end-of-document "
                             "id (data.eod_id)")
        return cls(eod=eod, masking=data.document_masking,
                   reset_positions=data.reset_position_ids, eod_mask_loss=data.eod_mask_loss)


def open_sources(resolved: Resolved) -> Sources:
    """The training source, and the validation source when train.eval_every > 0."""
    recipe = resolved.recipe
    data, train = recipe.data, recipe.train
    evaluate = train.eval_every > 0
    if data.kind == "synthetic":
        common = dict(seq_len=train.seq_len, vocab_size=recipe.model.vocab_size, seed=train.seed)
        return Sources(SyntheticTokens(**common),
                       SyntheticTokens(**common, stream=VALIDATION) if evaluate else None)
    if data.kind == "token_file":
        return dataclasses.replace(_token_file_sources(resolved, evaluate), eod=data.eod_id)
    return _indexed_sources(resolved, evaluate)


def _token_file_sources(resolved: Resolved, evaluate: bool) -> Sources:
    data, train = resolved.recipe.data, resolved.recipe.train
    count = (len(np.memmap(data.source, dtype=np.dtype(data.token_dtype), mode="r")) - 1) // train.seq_len
    ranges = split_ranges(count, data.split)
    if not ranges[TRAIN] or (evaluate and not ranges[VALIDATION]):
        part = "training" if not ranges[TRAIN] else "validation"
        raise ValueError(f"data.source={data.source!r}: the split {data.split!r} leaves the "
                         f"{part} part of its {count} windows of seq_len {train.seq_len} empty; "
                         "use a longer file, a shorter seq_len or another data.split")
    common = dict(seq_len=train.seq_len, seed=train.seed, dtype=data.token_dtype)
    validation = TokenFile(data.source, **common, windows=ranges[VALIDATION], stream=VALIDATION)
    return Sources(TokenFile(data.source, **common, windows=ranges[TRAIN], stream=TRAIN),
                   validation if evaluate else None)


def _indexed_sources(resolved: Resolved, evaluate: bool) -> Sources:
    from dsforge.data.cache import default_cache_dir
    from dsforge.data.identity import end_of_document
    from dsforge.data.indexed import inspect_dataset
    from dsforge.data.samples import MegatronSamples, build_splits

    recipe, layout = resolved.recipe, resolved.layout
    data, train = recipe.data, recipe.train
    parts = [(part.path, part.weight) for part in data.blend]
    identity = inspect_dataset(parts[0][0]).identity
    cache = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    splits = build_splits(
        parts, split=data.split, seq_len=train.seq_len, seed=train.seed,
        train_samples=train.steps * layout.global_batch,
        validation_samples=train.eval_iters * layout.global_batch if evaluate else None,
        identity=identity, cache_dir=cache)
    if evaluate and splits.validation is None:
        raise ValueError(f"data.split={data.split!r} gives the validation set no documents; "
                         "give validation a share, or set train.eval_every: 0")
    validation = MegatronSamples(splits.validation, what="validation samples") if evaluate else None
    note = (f"data: {len(parts)} dataset{'s' if len(parts) > 1 else ''}, "
            f"{len(splits.train):,} training samples"
            + (f", {len(splits.validation):,} validation samples" if evaluate else "")
            + f"; indices {'built' if splits.built else 'read from the cache'} in "
              f"{splits.seconds:.1f} s ({cache})")
    # the other datasets' records only where documents are looked for (the first one's is read)
    others = [inspect_dataset(path).identity for path, _ in parts[1:]] if data.documents else []
    eod = end_of_document(data.eod_id, [identity, *others]) if data.documents else None
    return Sources(MegatronSamples(splits.train, what="training samples"), validation, note,
                   eod=eod)


def step_data(source: Source, step: int, global_batch: int) -> dict:
    """Where the samples of training step `step` come from: their global ids and, per file,
    the documents (a Megatron corpus) or token offsets (a flat token file) they hold."""
    first = step * global_batch
    found: dict[str, dict[str, list[int]]] = {}
    for index in range(first, first + global_batch):
        place = source.locate(index)
        if place is not None:
            kind, name, numbers = place
            found.setdefault(kind, {}).setdefault(name, []).extend(numbers)
    located = {kind: {name: sorted(set(numbers)) for name, numbers in files.items()}
               for kind, files in found.items()}
    return {"samples": [first, first + global_batch - 1], "source": source.what, **located}


@dataclass(frozen=True)
class Microbatch:
    tokens: torch.Tensor  # [micro_batch, seq_len] inputs
    labels: torch.Tensor  # [micro_batch, seq_len] next tokens
    position_ids: torch.Tensor
    # data.document_masking: each position's document in the whole sequence [micro_batch,
    # seq_len], in sequence order (under context parallelism too: Ulysses' attention sees the
    # whole sequence), handed to the attention as Megatron's attention_mask argument
    documents: torch.Tensor | None = None
    # data.eod_mask_loss: 1 where a position's loss counts [micro_batch, local seq_len], and
    # the factor that makes the weighted sum the mean over the global batch's counted tokens
    # (`weigh_loss`)
    loss_mask: torch.Tensor | None = None
    loss_norm: torch.Tensor | None = None
    # data.document_masking: the (query, key) pairs attention within the whole sequences'
    # documents scores (data/documents.py score_pairs), for MFU within documents
    score_pairs: int | None = None


def microbatches(source: Source, *, step: int, global_batch: int, micro_batch: int,
                 grad_accum: int, dp: int, dp_rank: int, vocab_size: int, cp: int = 1,
                 cp_rank: int = 0, documents: Documents | None = None) -> list[Microbatch]:
    """The grad_accum microbatches data-parallel rank `dp_rank` trains on at `step` (or
    evaluates for validation batch `step`); with context parallelism, context-parallel rank
    `cp_rank`'s shard of each sequence (runtime/context_shards.py). The documents are found
    before the sequence is cut into shards."""
    batches = []
    for k in range(grad_accum):
        first = step * global_batch + (k * dp + dp_rank) * micro_batch
        rows = torch.stack([source.sample(first + i) for i in range(micro_batch)])
        _check_ids(rows, source, first, vocab_size)
        seq_len = rows.shape[1] - 1
        keep = context_shard(seq_len, cp, cp_rank)
        positions = keep.unsqueeze(0).expand(micro_batch, -1)
        extra = {}
        if documents is not None:
            positions, extra = _documents(rows[:, :-1], keep, documents, positions)
        batches.append(Microbatch(tokens=rows[:, :-1][:, keep].contiguous(),
                                  labels=rows[:, 1:][:, keep].contiguous(), position_ids=positions,
                                  **extra))
    return batches


def _documents(inputs: torch.Tensor, keep: torch.Tensor, documents: Documents,
               positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The position ids and the Microbatch fields of `inputs`' documents, `keep` this
    context-parallel rank's positions."""
    from dsforge.data import documents as found

    ids = found.document_ids(inputs, documents.eod)
    extra = {"documents": ids, "score_pairs": found.score_pairs(ids)} if documents.masking else {}
    if documents.reset_positions:
        positions = found.reset_positions(ids)[:, keep].contiguous()
    if documents.eod_mask_loss:
        extra["loss_mask"] = found.loss_mask(inputs, documents.eod)[:, keep].contiguous()
    return positions, extra


def score_pairs(batches: list[Microbatch]) -> float:
    """The score pairs within documents of `batches` (0 without document masking)."""
    return float(sum(mb.score_pairs or 0 for mb in batches))


def weigh_loss(batches: list[Microbatch], *, layout, group, device) -> list[Microbatch]:
    """`batches` with the factor that makes a microbatch's loss its masked per-token loss
    summed, times dp x cp x grad_accum / the tokens that count in the whole global batch:
    DeepSpeed divides by grad_accum and averages over dp x cp, so the step's gradient is the
    mean over the global batch's counted tokens (not a mean of microbatch means). The count
    is one all-reduce over `group` (data and context parallel), kept on the device."""
    if not batches or batches[0].loss_mask is None:
        return batches
    counted = torch.tensor([float(sum(mb.loss_mask.sum() for mb in batches))], device=device)
    torch.distributed.all_reduce(counted, group=group)
    norm = (layout.dp * layout.cp * layout.grad_accum) / counted.clamp(min=1.0)
    return [dataclasses.replace(mb, loss_norm=norm) for mb in batches]


def batch_weight(batches: list[Microbatch]) -> torch.Tensor | None:
    """A validation batch's weight in the mean over batches: with data.eod_mask_loss its
    counted tokens up to weigh_loss's constant factor (Megatron sums the losses and the tokens
    of its evaluation batches before it divides); None, all alike, without."""
    return None if not batches or batches[0].loss_norm is None else 1.0 / batches[0].loss_norm


def rank_microbatches(source: Source, index: int, resolved: Resolved, *, eod: int | None,
                      device) -> list[Microbatch]:
    """This rank's microbatches of global batch `index` of `source`, by its data-parallel and
    context-parallel ranks in Megatron's groups; `eod`: the data's end-of-document id."""
    from megatron.core import parallel_state as ps

    layout = resolved.layout
    batches = microbatches(source, step=index, global_batch=layout.global_batch,
                           micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
                           dp=layout.dp, dp_rank=ps.get_data_parallel_rank(), cp=layout.cp,
                           cp_rank=ps.get_context_parallel_rank(),
                           vocab_size=resolved.recipe.model.vocab_size,
                           documents=Documents.of(resolved, eod))
    return weigh_loss(batches, layout=layout, device=device,
                      group=ps.get_data_parallel_group(with_context_parallel=True))


def _check_ids(rows: torch.Tensor, source: Source, first: int, vocab_size: int) -> None:
    """An id beyond the embedding table fails deep inside the model (a CUDA device assert on a
    GPU); the cost of this check is one max over a few thousand ids."""
    largest = int(rows.max())
    if largest >= vocab_size or int(rows.min()) < 0:
        raise ValueError(f"{source.what}: samples {first}..{first + len(rows) - 1} hold token id "
                         f"{largest if largest >= vocab_size else int(rows.min())}, outside the "
                         f"model's vocabulary (0..{vocab_size - 1}): set model.vocab_size to the "
                         "tokenizer's vocabulary, or check data.source / data.token_dtype")
