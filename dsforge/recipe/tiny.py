"""The same layout at tiny size: any recipe's parallelism, smoke-tested on CPU ranks.

`shrink` keeps everything that decides how the job is laid out and run (world size, dp, tp,
pp, vpp, ep, etp, sequence parallelism, ZeRO stage and offload, schedule, activation
checkpointing, precision, tied embeddings, GQA and MoE routing) and replaces the model and the
batch with the smallest ones (with the kernels and attention backend CPU ranks run: auto) that keep every divisibility rule of docs/validation.md true:
  - one layer per virtual pipeline stage (L1/L2), MoE frequency capped to the layers (M3);
  - query groups = tp x cp (T1, T7), twice as many heads when the recipe uses GQA, 8 channels
    a head;
  - MLP and expert widths multiples of tp and expert-tp (T1);
  - seq_len a multiple of tp (sequence parallelism splits it) and of 2 cp (T7: context
    parallelism cuts it into 2 cp chunks), micro_batch 1, and as few
    microbatches as the schedule allows: pp (L6, L4), or 2 without a pipeline when the recipe
    accumulates gradients;
  - the vocabulary a multiple of Megatron's padding unit times tp, so neither the tiny run nor
    its single-rank reference has padded rows (padded ones would take part in no loss either:
    runtime/assemble/vocab.py); vocabularies over TINY_MAX_VOCAB are replaced by synthetic
    data.
Fields given with --set are applied again after shrinking, so `--set train.steps=10` holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from dsforge.recipe.layout import Topology
from dsforge.recipe.loader import apply_overrides, build_recipe, parse_overrides
from dsforge.recipe.resolve import Resolved, resolve
from dsforge.schema import ModelConfig, Recipe, padded_vocab_size

TINY_STEPS = 4
TINY_HEAD_DIM = 8
TINY_SEQ_LEN = 32
TINY_VOCAB = 256
TINY_MAX_VOCAB = 4096  # recipes with a vocabulary this small keep it (and their token file)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tiny_model(model: ModelConfig, *, tp: int, etp: int, pp: int, vpp: int,
               cp: int = 1) -> ModelConfig:
    layers = pp * vpp
    gqa = model.num_kv_heads is not None and model.num_kv_heads < model.num_attention_heads
    groups = tp * cp  # each tensor- and context-parallel rank holds whole heads (T1, T7)
    heads = 2 * groups if gqa else max(2, groups)
    hidden = heads * TINY_HEAD_DIM
    moe = None
    if model.moe is not None:
        moe = dataclasses.replace(model.moe, ffn_hidden_size=_round_up(2 * hidden, etp),
                                  frequency=min(model.moe.frequency, layers))
    vocab = model.vocab_size if model.vocab_size <= TINY_MAX_VOCAB else TINY_VOCAB
    vocab = padded_vocab_size(vocab, tp)  # token ids of a kept token file still fit
    return dataclasses.replace(
        model, preset=None, num_layers=layers, hidden_size=hidden,
        ffn_hidden_size=_round_up(3 * hidden, tp), num_attention_heads=heads,
        num_kv_heads=groups if gqa else None, kv_channels=None, vocab_size=vocab,
        max_seq_len=_round_up(TINY_SEQ_LEN, math.lcm(tp, 2 * cp if cp > 1 else 1)), moe=moe,
        init_from=None,  # drawn: a model.init_from folder's weights are not the tiny model's
        # CPU ranks: the kernels and attention backend auto picks there (rule K1)
        kernels="auto", sdpa_backend="auto")


def _tiny_interval(every: int | str) -> int | str:
    """auto stays auto (chosen at run time, from the tiny run's own steps)."""
    return every if every == "auto" else min(every, TINY_STEPS)


def shrink(recipe: Recipe, grad_accum: int) -> Recipe:
    """`recipe` (valid, with `grad_accum` microbatches per step) at tiny size, same layout."""
    p = recipe.parallel
    model = tiny_model(recipe.model, tp=p.tp, etp=p.expert_tp, pp=p.pp, vpp=p.vpp, cp=p.cp)
    microbatches = p.pp if p.pp > 1 else min(grad_accum, 2)
    train = dataclasses.replace(
        recipe.train, seq_len=model.max_seq_len, micro_batch=1, grad_accum=microbatches,
        global_batch=None, steps=TINY_STEPS, warmup_steps=0, timing_warmup=1,
        checkpoint_every=_tiny_interval(recipe.train.checkpoint_every))
    data = recipe.data
    if recipe.model.vocab_size > TINY_MAX_VOCAB:  # the tiny model's vocabulary cannot hold it
        # synthetic tokens have no documents (rule D17): the tiny run checks the layout
        # without them
        data = dataclasses.replace(data, source="synthetic", tokenizer=None, eod_id=None,
                                   document_masking=False, reset_position_ids=False,
                                   eod_mask_loss=False)
    # The recipe's profiler steps are its own run's; the tiny run has TINY_STEPS (rule R4).
    tracking = dataclasses.replace(recipe.tracking, profile=None)
    # Names become directory names (at most 100 characters, rule N1): room for the suffixes.
    return dataclasses.replace(recipe, name=f"{recipe.name[:80]}-tiny", model=model, train=train,
                               data=data, tracking=tracking)


BATCH_FIELDS = ("global_batch", "micro_batch", "grad_accum")


def with_overrides(recipe: Recipe, overrides: Iterable[str]) -> Recipe:
    """`recipe` with the user's --set fields applied again (they win over shrinking). A batch
    field given lets the other two be derived again (global = micro x grad_accum x dp).
    Not the data section and model.init_from: the load already applied them, relative to the
    recipe's directory (given again here, a relative path would mean the working directory's),
    and shrinking changes them only where the tiny model cannot use them."""
    items = [(key, value) for key, value in parse_overrides(overrides)
             if not (key.startswith("data.") or key == "model.init_from")]
    if not items:
        return recipe
    raw = dataclasses.asdict(recipe)
    given = {key.split(".", 1)[1] for key, _ in items if key.startswith("train.")}
    if given & set(BATCH_FIELDS):
        raw["train"].update({name: None for name in BATCH_FIELDS if name not in given})
    return build_recipe(apply_overrides(raw, items))



def single_rank_reference(tiny: Recipe, global_batch: int) -> Recipe:
    """The same tiny model and data on one rank: every layout must train it to the same
    losses (layout-invariant init, same samples per step), up to reduction order."""
    parallel = dataclasses.replace(tiny.parallel, tp=1, pp=1, vpp=1, ep=1, etp=None, cp=1, dp=1,
                                   sequence_parallel=False)
    train = dataclasses.replace(tiny.train, micro_batch=1, grad_accum=global_batch,
                                global_batch=None, checkpoint_every=0)
    return dataclasses.replace(tiny, name=f"{tiny.name}-reference", parallel=parallel,
                               train=train, cluster=None)


def tiny_resolved(resolved: Resolved, overrides: Iterable[str] = ()) -> Resolved:
    """A resolved recipe at tiny size in the same world; raises RecipeError if a --set field
    re-applied after shrinking breaks a rule."""
    tiny = shrink(resolved.recipe, resolved.layout.grad_accum)
    return resolve(with_overrides(tiny, overrides), resolved.topology)


def reference_resolved(tiny: Resolved) -> Resolved:
    """The single-rank run that `tiny` must match."""
    return resolve(single_rank_reference(tiny.recipe, tiny.layout.global_batch),
                   Topology(world_size=1))
