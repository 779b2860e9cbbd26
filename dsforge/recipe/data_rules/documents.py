"""D17: packed documents (data.document_masking, reset_position_ids, eod_mask_loss) need the
end-of-document id of the data, and an attention kernel that takes a mask.

Where the EOD comes from: a dataset's record (PREFIX.tokenizer.json, written by `dsforge data
prepare`) names it; a dataset without a record (Megatron-LM's or GPT-NeoX's tools) and a flat
token file need `data.eod_id`. Synthetic tokens have no documents: the options are refused
there rather than accepted as a silent no-op.
"""

from __future__ import annotations

from typing import Iterator

from dsforge.problems import Problem
from dsforge.recipe.data_rules.datasets import opened_datasets
from dsforge.recipe.data_rules.kind import data_kind
from dsforge.recipe.fixes import Context
from dsforge.schema import Recipe

# model.sdpa_backend values whose kernel takes no attention mask (torch's flash kernel; the
# cuDNN one takes none before torch 2.5 and is not checked with one here).
NO_MASK_BACKENDS = ("flash", "cudnn")


def _asked(recipe: Recipe) -> dict:
    d = recipe.data
    return {f"data.{name}": True for name in ("document_masking", "reset_position_ids",
                                              "eod_mask_loss") if getattr(d, name)}


def documents(recipe: Recipe, ctx: Context) -> Iterator[Problem]:
    d = recipe.data
    if not d.documents:
        return
    asked, kind = _asked(recipe), data_kind(d)
    if kind == "synthetic":
        yield Problem(rule="D17", fields={**asked, "data.source": "synthetic"},
                      message="synthetic tokens have no documents: there is nothing to mask",
                      fix="train on a dataset or a token file with end-of-document ids, or "
                          "leave the document options out")
        return
    eod = eod_id(recipe)
    if isinstance(eod, Problem):
        yield eod
    elif eod >= recipe.model.vocab_size:
        yield Problem(rule="D17", fields={"data.eod_id": eod,
                                          "model.vocab_size": recipe.model.vocab_size},
                      message="the end-of-document id is outside the model's vocabulary",
                      fix="write the tokenizer's end-of-document id")
    if d.document_masking and recipe.model.sdpa_backend in NO_MASK_BACKENDS:
        yield Problem(rule="D17", fields={"data.document_masking": True,
                                          "model.sdpa_backend": recipe.model.sdpa_backend},
                      message=f"the {recipe.model.sdpa_backend} kernel takes no attention "
                              "mask on GPU ranks, and document masking needs one",
                      fix="set model.sdpa_backend: auto (dsforge then picks flex attention on "
                          "a GPU), efficient or math")


def eod_id(recipe: Recipe) -> int | Problem:
    """The data's end-of-document id (data/identity.py `end_of_document`, which the ranks
    take too): data.eod_id, else the one id the datasets' records name; a Problem (D17) when
    neither names one, or they disagree."""
    from dsforge.data.identity import end_of_document, recorded_eods

    d, kind = recipe.data, data_kind(recipe.data)
    identities = [ds.info.identity for ds in (opened_datasets(recipe) or ()) if ds.info is not None]
    recorded = recorded_eods(identities)
    source = {"data.source": str(d.source)}
    if d.eod_id is not None and recorded and recorded != [d.eod_id]:
        return Problem(rule="D17", fields={"data.eod_id": d.eod_id, **source},
                       message=f"the datasets' records name end-of-document id "
                               f"{', '.join(map(str, recorded))}",
                       fix="leave data.eod_id out (the record's is used), or correct it")
    eod = end_of_document(d.eod_id, identities)
    if eod is not None:
        return eod
    if len(recorded) > 1:
        what = (f"the datasets' records name different end-of-document ids "
                f"({', '.join(map(str, recorded))}): they were made with different tokenizers")
        fix = "blend datasets prepared with one tokenizer"
    else:
        what = "a flat token file records no end-of-document id" if kind != "dataset" else \
            "the dataset has no record (PREFIX.tokenizer.json) naming its end-of-document id"
        fix = "set data.eod_id to the id the documents end with (dsforge data inspect shows " \
              "a dataset's record)"
    return Problem(rule="D17", fields={**_asked(recipe), **source}, message=what, fix=fix)
