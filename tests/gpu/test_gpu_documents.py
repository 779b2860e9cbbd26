"""On a GPU: flex attention over documents equals the dense document mask, forward and
backward, in fp32 and bf16, with grouped KV heads (skipped on CPU, where flex attention has no
backward; tests/unit/test_documents.py checks its forward there)."""

from __future__ import annotations

import pytest
import torch

from dsforge.data.documents import document_ids
from dsforge.runtime.assemble import documents

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_flex_equals_the_dense_mask_forward_and_backward(dtype, tolerance):
    torch.manual_seed(0)
    seq, heads, groups, dim = 1024, 8, 2, 64
    inputs = torch.randint(1, 100, (2, seq), device="cuda")
    inputs[:, torch.randint(0, seq, (12,))] = 0  # EODs at random places
    ids = document_ids(inputs, 0)
    q = torch.randn(2, heads, seq, dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, groups, seq, dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, groups, seq, dim, device="cuda", dtype=dtype, requires_grad=True)
    out = documents.flex(q, k, v, ids, scale=None, enable_gqa=True)
    repeat = heads // groups
    reference = documents.masked_sdpa(q, k.repeat_interleave(repeat, 1),
                                      v.repeat_interleave(repeat, 1), ids, scale=None,
                                      dropout_p=0.0, enable_gqa=False)
    grad = torch.randn_like(out)
    flex_grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_grads = torch.autograd.grad(reference, (q, k, v), grad)
    assert (out - reference).abs().max().item() < tolerance
    for got, ref in zip(flex_grads, ref_grads):
        assert (got - ref).abs().max().item() < tolerance * 10


def test_a_new_microbatch_reuses_the_compiled_kernels_and_frees_its_mask():
    """Each microbatch's block mask is made (compiled create_block_mask) and used (compiled
    flex attention) without compiling again, and goes with the microbatch's ids."""
    import gc

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    q = torch.randn(1, 4, 2048, 64, device="cuda", dtype=torch.bfloat16)

    def microbatch():
        inputs = torch.randint(1, 100, (1, 2048), device="cuda")
        inputs[:, torch.randint(0, 2048, (9,))] = 0
        ids = document_ids(inputs, 0)
        documents.flex(q, q, q, ids, scale=None, enable_gqa=False)

    microbatch()
    before, masks = dict(counters["stats"]), len(documents._MASKS)
    for _ in range(3):
        microbatch()
    gc.collect()
    assert counters["stats"].get("unique_graphs") == before.get("unique_graphs")
    assert len(documents._MASKS) == masks
