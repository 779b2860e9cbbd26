"""The rules on how data.split cuts a recipe's Megatron datasets: D6 Megatron-Core reads the
split as dsforge does; D10 with train.eval_every every dataset's validation part holds a
sequence; D11 every training part holds a sequence and together they hold one global batch.

The parts are cut as Megatron-Core cuts them (dsforge.data.indexed.split_ranges), counted from
each dataset's index.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator

from dsforge.problems import Problem
from dsforge.recipe.data_rules.datasets import Dataset, Opened, opened_datasets
from dsforge.recipe.fixes import Context, batch_fields, largest_that_work, split_fix, use
from dsforge.schema import Recipe, split_shares

TRAIN, VALIDATION = 0, 1  # indices of the parts in split_ranges


@functools.lru_cache(maxsize=256)
def _split_tokens(opened: Opened, split: str) -> tuple[tuple[int, int] | None, ...]:
    """(sequences, tokens) of the train, validation and test parts; None for a part without
    a share. Raises what Megatron's split parser raises."""
    from dsforge.data.indexed import split_ranges

    return tuple(None if bounds is None else (bounds[1] - bounds[0], opened.tokens(*bounds))
                 for bounds in split_ranges(split, opened.info.sequences))


def _megatron_reading(split: str) -> list[float] | None:
    """Megatron-Core's shares for the split string, None when its parser refuses it."""
    from dsforge.data.indexed import parse_split

    try:
        return parse_split(split)
    except (AssertionError, ValueError, ZeroDivisionError):
        return None


def dataset_splits(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    """D6: Megatron-Core reads the split as dsforge does; D10: with train.eval_every, every
    dataset's validation part holds a sequence; D11: the training part holds one global
    batch, and every dataset's training part a sequence. The test part, and the validation part
    without evaluation, are never built (data/samples.py), so they may be empty."""
    datasets = opened_datasets(recipe)
    if datasets is None:
        return
    split = recipe.data.split
    shares, megatron = split_shares(split), _megatron_reading(split)
    if shares is None:
        return  # D6, found when the section was built
    if megatron is None or not all(math.isclose(ours, theirs, abs_tol=1e-9)
                                   for ours, theirs in zip(shares, megatron)):
        read = "cannot read it" if megatron is None else \
            "reads it as " + ", ".join(f"{100 * share:.4g}%" for share in megatron)
        plain = ",".join(f"{100 * share:.4g}" for share in shares)
        yield Problem(rule="D6", fields={"data.split": split},
                      message=f"Megatron-Core, which splits the datasets, {read} (it takes the "
                              "digits and dots of the string as numbers)",
                      fix=f'write plain numbers: data.split: "{plain}"')
        return
    parts = [(d, _split_tokens(d.opened, split)) for d in datasets]
    if recipe.train.eval_every > 0:
        yield from _validation_part(recipe, ctx, parts)
    yield from _training_part(recipe, ctx, parts)


def _validation_part(recipe: Recipe, ctx: Context, parts: list) -> Iterator[Problem]:
    split, every = recipe.data.split, recipe.train.eval_every
    fields = {"data.split": split, "train.eval_every": every}
    if parts[0][1][VALIDATION] is None:
        yield Problem(rule="D10", fields=fields,
                      message="gives the validation set no share, but train.eval_every asks for "
                              f"a validation loss every {every} steps",
                      fix=split_fix(recipe, ctx, "D10", "or set train.eval_every: 0"))
        return
    empty = [d for d, shares in parts if shares[VALIDATION][0] == 0]
    if not empty:
        return
    fix = split_fix(recipe, ctx, "D10", "or set train.eval_every: 0")
    yield Problem(rule="D10", fields={**fields, **{d.field: d.path for d in empty}},
                  message=f"the validation part ({_share(split, VALIDATION)} of each dataset's "
                          "sequences, cut at bounds Megatron-Core rounds to whole sequences) is "
                          f"empty for {_sizes(empty)}: Megatron-Core would loop forever drawing "
                          "validation samples from it", fix=fix)


def _training_part(recipe: Recipe, ctx: Context, parts: list) -> Iterator[Problem]:
    split = recipe.data.split
    if parts[0][1][TRAIN] is None:
        yield Problem(rule="D11", fields={"data.split": split},
                      message="gives training no share of the data",
                      fix=split_fix(recipe, ctx, "D11", "") or 'use e.g. data.split: "98,1,1"')
        return
    empty = [d for d, shares in parts if shares[TRAIN][0] == 0]
    if empty:
        yield Problem(rule="D11", fields={"data.split": split, **{d.field: d.path for d in empty}},
                      message=f"the training part ({_share(split, TRAIN)} of each dataset's "
                              "sequences, cut at bounds Megatron-Core rounds to whole sequences) "
                              f"is empty for {_sizes(empty)}: Megatron-Core would loop forever "
                              "drawing training samples from it",
                      fix=split_fix(recipe, ctx, "D11", "or use datasets with more documents"))
        return
    yield from _one_global_batch(recipe, ctx, parts)


def _one_global_batch(recipe: Recipe, ctx: Context, parts: list) -> Iterator[Problem]:
    """D11: the training parts together hold global_batch x seq_len + 1 tokens."""
    t, split = recipe.train, recipe.data.split
    global_batch = ctx.batch.global_batch if ctx.batch else t.global_batch
    if global_batch is None:
        return  # derived from a world size not known here
    need = global_batch * t.seq_len + 1
    held = sum(shares[TRAIN][1] for _, shares in parts)
    if held >= need:
        return
    fields = {**batch_fields(t), "train.seq_len": t.seq_len, **{d.field: d.path for d, _ in parts}}
    batch = "train.global_batch" if t.global_batch is not None else "the global batch"
    most = (held - 1) // t.seq_len
    options = {path: largest_that_work(recipe, ctx, "D11", path, largest)
               for path, largest in (("train.global_batch", most),
                                     ("train.seq_len", (held - 1) // global_batch))}
    yield Problem(rule="D11", fields=fields,
                  message=f"the training part of the data ({_share(split, TRAIN)} of each "
                          f"dataset's sequences) holds {held:,} tokens, fewer than one global "
                          f"batch needs: {batch} x train.seq_len + 1 = {global_batch} x "
                          f"{t.seq_len} + 1 = {need:,}",
                  fix="use more data (a larger dataset or blend), or "
                      + use(options, _smaller_batch(most, (held - 1) // global_batch)))


def _smaller_batch(sequences: int, seq_len: int) -> str:
    """D11's fix where no nearby value was found to work: what would fit in the data."""
    if sequences >= 1:
        return f"a global batch of at most {sequences} sequences"
    return (f"a train.seq_len of at most {seq_len:,} tokens" if seq_len >= 1
            else "a dataset that holds one global batch")


def _sizes(datasets: list[Dataset]) -> str:
    """'data.source (50 sequences)', for each dataset."""
    return ", ".join(f"{d.field} ({d.info.sequences:,} sequence{'s' * (d.info.sequences != 1)})"
                     for d in datasets)


def _share(split: str, part: int) -> str:
    return f"{100 * split_shares(split)[part]:.4g}%"
