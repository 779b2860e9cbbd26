"""Packed documents (data.document_masking, reset_position_ids, eod_mask_loss; issue 51): the
boundaries from the EOD ids, what each context-parallel rank gets of them, the rules (D17),
and, in a child process with a one-rank Megatron-Core model, a packed sequence trained as its
documents one by one (loss and gradients within 1e-5, with and without position resets), the
flex kernel's forward equal to the dense mask's, and positions from ids equal to Megatron's own rotary.
That every layout equals one rank with documents masked is test_equivalence's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dsforge.data.documents import document_ids, document_lengths, loss_mask, reset_positions
from dsforge.problems import RecipeError
from dsforge.recipe import resolve_file
from dsforge.runtime.loop import data as data_mod
from tests.conftest import REPO
from tests.unit.helpers.child import run_child

TINY = REPO / "recipes" / "tiny.yaml"
EOD = 0
# Three documents, the first cut at the sample's start (it counts as one of its own there).
PACKED = [7, 8, EOD, 5, 6, 9, 4, EOD, 3, 3, 2, 1, 11, EOD, 12, 13]


def test_the_eod_belongs_to_the_document_it_ends():
    inputs = torch.tensor([PACKED])
    ids = document_ids(inputs, EOD)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3]]
    assert reset_positions(ids).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert loss_mask(inputs, EOD)[0].tolist() == [float(t != EOD) for t in PACKED]
    assert document_lengths(ids[0]) == [3, 5, 6, 2]


class _Rows:
    what = "rows"

    def sample(self, index: int) -> torch.Tensor:
        return torch.tensor(PACKED + [21])

    def locate(self, index):
        return None


def test_documents_are_found_before_the_sequence_is_sharded():
    """cp 2: rank 1 holds chunks 1 and 2 of 4 (runtime/context_shards.py); it gets the whole
    sequence's document ids, its own positions (reset) and loss mask."""
    docs = data_mod.Documents(eod=EOD, masking=True, reset_positions=True, eod_mask_loss=True)
    (mb,) = data_mod.microbatches(_Rows(), step=0, global_batch=1, micro_batch=1, grad_accum=1,
                                  dp=1, dp_rank=0, vocab_size=32, cp=2, cp_rank=1,
                                  documents=docs)
    assert mb.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3]]
    assert mb.position_ids.tolist() == [[1, 2, 3, 4, 0, 1, 2, 3]]  # positions 4..11
    assert mb.tokens.tolist() == [PACKED[4:12]]
    assert mb.loss_mask.tolist() == [[1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]]
    assert mb.score_pairs == 74  # the whole sequence's documents, on every cp rank
    assert data_mod.score_pairs([mb, mb]) == 148.0
    (plain,) = data_mod.microbatches(_Rows(), step=0, global_batch=1, micro_batch=1,
                                     grad_accum=1, dp=1, dp_rank=0, vocab_size=32)
    assert plain.documents is None and plain.loss_mask is None


def test_the_validation_loss_weighs_each_batch_by_the_tokens_that_count():
    """With data.eod_mask_loss, the mean over validation batches is Megatron's: the losses and
    the counted tokens summed before the division, not a mean of batch means."""
    from dsforge.runtime.loop.step import validation_mean

    def batch(counted: float) -> list:  # weigh_loss's factor at dp x cp x grad_accum = 4
        return [data_mod.Microbatch(tokens=None, labels=None, position_ids=None,
                                    loss_norm=torch.tensor([4.0 / counted]))]

    means, counts = [torch.tensor(2.0), torch.tensor(5.0)], [30.0, 10.0]
    weighed = [(m, data_mod.batch_weight(batch(c))) for m, c in zip(means, counts)]
    assert validation_mean(weighed).item() == pytest.approx((2 * 30 + 5 * 10) / 40)
    plain = [(m, data_mod.batch_weight([data_mod.Microbatch(tokens=None, labels=None,
                                                            position_ids=None)])) for m in means]
    assert validation_mean(plain).item() == pytest.approx(3.5)


def test_documents_need_an_eod_and_a_kernel_that_takes_a_mask(tmp_path):
    tokens = tmp_path / "tokens.u16"
    torch.randint(1, 250, (4096,), dtype=torch.int16).numpy().tofile(tokens)
    on = ["data.document_masking=true"]

    def rules(*sets):
        with pytest.raises(RecipeError) as err:
            resolve_file(TINY, [*on, *sets])
        return [(p.rule, str(p)) for p in err.value.problems]

    assert "synthetic tokens have no documents" in rules()[0][1]
    assert "a flat token file records no end-of-document id" in \
        rules(f"data.source={tokens}")[0][1]
    found = rules(f"data.source={tokens}", "data.eod_id=0", "model.sdpa_backend=flash")
    assert found[0][0] == "D17" and "the flash kernel takes no attention mask" in found[0][1]
    assert "outside the model's vocabulary" in rules(f"data.source={tokens}", "data.eod_id=999")[0][1]
    resolve_file(TINY, [*on, f"data.source={tokens}", "data.eod_id=0"])
    with pytest.raises(RecipeError, match="data.eod_id.*none of them is on: it would change"):
        resolve_file(TINY, [f"data.source={tokens}", "data.eod_id=0"])
    # a dataset's record names its EOD (the bytes tokenizer's 256), and a different one is refused
    tempest = [f"data.source={REPO / 'data' / 'tempest'}", "model.vocab_size=257"]
    resolve_file(TINY, [*on, *tempest])
    assert "the datasets' records name end-of-document id 256" in \
        rules(*tempest, "data.eod_id=3")[0][1]


def test_a_blend_takes_the_eod_one_of_its_datasets_records(tmp_path):
    """A dataset without a record (Megatron-LM's tools) first in a blend: the rule and the
    ranks (runtime/loop/data.py) both take the other's record, through one function."""
    import shutil

    from dsforge.data.identity import end_of_document
    from dsforge.data.indexed import inspect_dataset

    for suffix in (".bin", ".idx"):
        shutil.copy(REPO / "data" / f"tempest{suffix}", tmp_path / f"bare{suffix}")
    parts = [tmp_path / "bare", REPO / "data" / "tempest"]
    blend = ("data.source=[" + ", ".join(f"{{path: {p}, weight: 0.5}}" for p in parts) + "]")
    resolve_file(TINY, ["data.document_masking=true", blend, "model.vocab_size=257"])
    identities = [inspect_dataset(str(p)).identity for p in parts]
    assert identities[0] is None and end_of_document(None, identities) == 256
    assert end_of_document(None, identities[:1]) is None
    assert end_of_document(7, identities) == 7


def test_compiled_layers_with_flex_on_gpus_are_refused():
    from dsforge.recipe import load_recipe
    from dsforge.translate.kernels import device_problems

    model = load_recipe(TINY, ["model.compile=layers"]).model
    found = device_problems(model, device="cuda", precision="bf16", liger_available=False,
                            document_masking=True)
    assert [p.rule for p in found] == ["K1"] and "model.compile: none" in found[0].fix
    assert device_problems(model, device="cpu", precision="fp32", liger_available=False,
                           document_masking=True) == []


def test_plan_names_the_kernel_and_how_flops_count(tmp_path):
    from dsforge.plan import build_plan, render_plan

    resolved = resolve_file(TINY, ["data.document_masking=true", "data.eod_mask_loss=true",
                                   f"data.source={REPO / 'data' / 'tempest'}",
                                   "model.vocab_size=257"])
    plan = build_plan(resolved, device="cpu")
    said = plan["implementations"]["documents"]
    assert said["kernel"] == "sdpa-mask" and "full seq x seq score matrix" in said["attention_flops"]
    assert "packed documents: attention within each, sdpa-mask" in render_plan(plan)
    assert build_plan(resolved, device="cuda")["implementations"]["documents"]["kernel"] == "flex"
    # the plan's memory is the fit check's: with the dense mask CPU ranks hold
    from dsforge.translate.kernels import predicted_memory
    assert plan["memory_bytes"]["total"] == predicted_memory(resolved, "cpu").total
    assert plan["memory_by_zero_stage"]["1"]["total"] == int(predicted_memory(resolved, "cpu").total)


def test_a_gpu_takes_the_sdpa_backend_asked_for_and_the_memory_model_counts_the_dense_mask():
    from dsforge.translate.kernels import document_attention, predicted_memory

    resolved = resolve_file(TINY, ["data.document_masking=true", "data.eod_mask_loss=true",
                                   f"data.source={REPO / 'data' / 'tempest'}",
                                   "model.vocab_size=257"])
    data = resolved.recipe.data
    assert document_attention(data, device="cuda", sdpa_backend="auto").impl == "flex"
    chosen = document_attention(data, device="cuda", sdpa_backend="efficient")
    assert chosen.impl == "sdpa-mask" and "model.sdpa_backend: efficient" in chosen.why
    # CPU ranks keep one fp32 [micro_batch, 1, seq, seq] mask; flex's block mask is small
    layout, seq = resolved.layout, resolved.recipe.train.seq_len
    extra = (predicted_memory(resolved, "cpu").activations
             - predicted_memory(resolved, "cuda").activations)
    assert extra == layout.micro_batch * seq * seq * 4


def test_masks_are_made_once_per_microbatch_and_go_with_it():
    """Every layer gets the same mask for one tensor of ids; the mask goes when the ids go
    (a mask that held its ids would keep both for ever)."""
    import gc

    from dsforge.runtime.assemble import documents as attention

    before = len(attention._MASKS)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    bias = attention._dense_bias(ids, torch.float32)
    assert attention._dense_bias(ids, torch.float32) is bias
    assert torch.equal(bias == 0, attention.dense_mask(ids))
    assert attention._block_mask(ids) is attention._block_mask(ids)
    assert len(attention._MASKS) == before + 2
    del ids, bias
    gc.collect()
    assert len(attention._MASKS) == before


def test_mfu_says_how_it_counts_attention_when_documents_are_masked():
    from dsforge.runtime.loop.metrics import format_summary

    summary = {"steps": 12, "final_loss": 2.0, "measured_steps": 10, "median_step_time_s": 1.0,
               "median_tokens_per_s": 65536, "median_tokens_per_s_per_gpu": 65536,
               "median_mfu": 0.41}
    assert format_summary(summary).endswith("MFU 41.0%")
    masked = {**summary, "median_attention_share": 0.125, "median_mfu_documents": 0.35}
    assert format_summary(masked).endswith("MFU 41.0% (attention over whole sequences; 35.0% "
                                           "within documents, 12.5% of the score matrices)")
    on_cpu = {**masked, "median_mfu": None, "median_mfu_documents": None}
    assert format_summary(on_cpu).endswith("MFU n/a (attention over whole sequences; 12.5% of "
                                           "the score matrices)")


def test_the_score_pairs_within_documents_are_each_documents_square():
    """Documents of 3, 5, 6 and 2 tokens in one row, one document of 16 in the next: the
    pairs are 9 + 25 + 36 + 4 and 256; MFU within documents counts that share of the full
    squares' attention FLOPs."""
    from dsforge.data.documents import attention_share, score_pairs
    from dsforge.estimate.flops import flops_per_token
    from dsforge.recipe import load_recipe

    ids = document_ids(torch.tensor([PACKED, [1] * 16]), EOD)
    assert score_pairs(ids) == 74 + 256
    share = attention_share(score_pairs(ids), sequences=2, seq_len=16)
    assert share == (74 + 256) / 512
    m = load_recipe(TINY, []).model
    full, none = flops_per_token(m, 16), flops_per_token(m, 16, attention_share=0.0)
    within = flops_per_token(m, 16, attention_share=share)
    assert within.model == pytest.approx(none.model + share * (full.model - none.model))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict:
    return run_child("tests.unit.test_documents", tmp_path_factory.mktemp("documents"),
                     "packed.json")


@pytest.mark.parametrize("reset", [False, True])
def test_a_packed_sequence_trains_as_its_documents_one_by_one(packed, reset):
    found = packed[f"reset={reset}"]
    assert found["loss"] == pytest.approx(found["one_by_one_loss"], abs=1e-5)
    assert found["grad_diff"] < 1e-5
    # the test can fail: without the mask the packed sequence is another computation
    assert abs(found["unmasked_loss"] - found["one_by_one_loss"]) > 1e-3


def test_flex_attention_equals_the_dense_mask(packed):
    """Per-token losses; its gradients need a GPU (tests/gpu/test_gpu_documents.py)."""
    assert packed["flex_vs_mask"] < 1e-5


def test_rotary_from_position_ids_is_megatrons_for_plain_positions(packed):
    assert packed["rotary_plain_diff"] == 0.0


def _child(folder: Path) -> None:
    from dsforge.runtime.assemble.model import build_model_chunks
    from dsforge.translate.kernels import Documents
    from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                            transformer_config_kwargs)
    from tests.unit.test_accepted_builds import _init_one_rank_world

    _init_one_rank_world(folder)
    resolved = resolve_file(TINY, ["parallel.dp=1", "train.precision=fp32"], world_size=1)
    r, layout = resolved.recipe, resolved.layout
    config = build_transformer_config(transformer_config_kwargs(
        model=r.model, train=r.train, layout=layout, device="cpu"))

    def build(**documents):
        torch.manual_seed(0)
        (chunk,) = build_model_chunks(config, gpt_model_kwargs(model=r.model, layout=layout),
                                      torch.device("cpu"), vocab_size=r.model.vocab_size,
                                      documents=Documents(position_ids=True, **documents))
        return chunk

    model, flex_model = build(), build(kernel="flex")
    flex_model.load_state_dict(model.state_dict())
    inputs = torch.tensor([PACKED])
    labels = torch.tensor([PACKED[1:] + [21]])
    ids = document_ids(inputs, EOD)
    results = {}
    for reset in (False, True):
        positions = reset_positions(ids) if reset else torch.arange(len(PACKED))[None]
        loss, grads = _run(model, inputs, positions, ids, labels)
        pieces = [_run(model, inputs[:, a:b], torch.arange(b - a)[None], None, labels[:, a:b])
                  for a, b in _spans(ids[0])]
        one_loss = sum(p[0] for p in pieces)
        one_grads = [sum(p[1][i] for p in pieces) for i in range(len(grads))]
        unmasked, _ = _run(model, inputs, positions, None, labels)
        results[f"reset={reset}"] = {
            "loss": loss, "one_by_one_loss": one_loss, "unmasked_loss": unmasked,
            "grad_diff": max(float((g - o).abs().max()) for g, o in zip(grads, one_grads))}
    positions = reset_positions(ids)
    with torch.no_grad():  # flex attention has no backward on the CPU (tests/gpu: on a GPU)
        per_token = [m(inputs, positions, ids, labels=labels) for m in (model, flex_model)]
    results["flex_vs_mask"] = float((per_token[0] - per_token[1]).abs().max())
    plain = model.rotary_pos_emb(len(PACKED))
    model.rotary_pos_emb.position_ids = torch.arange(len(PACKED))[None]
    by_ids = model.rotary_pos_emb(len(PACKED))
    model.rotary_pos_emb.position_ids = None
    results["rotary_plain_diff"] = float((plain - by_ids).abs().max())
    (folder / "packed.json").write_text(json.dumps(results))


def _spans(ids: torch.Tensor) -> list[tuple[int, int]]:
    lengths = document_lengths(ids)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(a, a + n) for a, n in zip(starts, lengths)]


def _run(model, inputs, positions, ids, labels) -> tuple[float, list[torch.Tensor]]:
    """The summed per-token loss and the parameters' gradients of one forward and backward."""
    model.zero_grad(set_to_none=True)
    loss = model(inputs, positions, ids, labels=labels).float().sum()
    loss.backward()
    return float(loss), [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                         for p in model.parameters()]


if __name__ == "__main__":
    _child(Path(sys.argv[1]))


def test_the_meter_counts_a_steps_attention_within_its_documents():
    """A step whose documents hold a quarter of the score matrices' pairs: attention_share
    0.25, and with a known peak mfu_documents on those FLOPs beside mfu on the full count;
    a run without masking records neither."""
    from dsforge.estimate.flops import flops_per_token
    from dsforge.runtime.guard.health import StepView
    from dsforge.runtime.loop.meter import StepMeter

    masked = resolve_file(TINY, ["data.document_masking=true", "model.vocab_size=257",
                                 f"data.source={REPO / 'data' / 'tempest'}"])
    seq, batch = masked.recipe.train.seq_len, masked.layout.global_batch

    def record(resolved, pairs):
        meter = StepMeter(resolved, device=torch.device("cpu"), census=False,
                          first_timed_step=0, warn=print)
        meter.peak_flops = 1e12  # a CPU has none: as on a GPU of that peak
        seen = StepView(loss=1.0, bad_loss=False, bad_norm=False, skipped=False,
                        score_pairs=pairs)
        return meter.record(0, seen, lr=0.1, elapsed=1.0, ended_at=0.0, data_time=0.0,
                            phases=None, loss_scale=None)

    got = record(masked, batch * seq * seq / 4)
    m = masked.recipe.model
    assert got.attention_share == 0.25
    assert got.mfu == pytest.approx(got.tokens_per_s_per_gpu * flops_per_token(m, seq).model / 1e12)
    assert got.mfu_documents == pytest.approx(
        got.tokens_per_s_per_gpu * flops_per_token(m, seq, attention_share=0.25).model / 1e12)
    plain = record(resolve_file(TINY), 0.0)
    assert plain.attention_share is None and plain.mfu_documents is None and plain.mfu is not None
