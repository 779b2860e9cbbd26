"""Grouped experts' pieces (runtime/assemble/grouped_moe.py) and how `model.moe.experts` is
decided (translate/experts.py); tests/distributed/test_equivalence.py trains them against
Megatron's sequential experts at every layout."""

from __future__ import annotations

import pytest
import torch

from dsforge.runtime.assemble.grouped_moe import ALIGN_ROWS, _GroupedLinear, aligned_rows
from dsforge.translate.experts import choose_experts


def test_each_experts_rows_start_aligned_and_the_last_group_takes_the_rest():
    counts = torch.tensor([3, 0, 17, 2])
    destination, offsets, size = aligned_rows(counts, 22)
    assert size == 96 and size >= 22 + 4 * (ALIGN_ROWS - 1) and size % ALIGN_ROWS == 0
    assert destination.tolist() == [0, 1, 2, *range(16, 33), 48, 49]
    assert offsets.dtype == torch.int32 and offsets.tolist() == [16, 16, 48, size]
    empty, offsets, size = aligned_rows(torch.tensor([0, 0]), 0)
    assert empty.numel() == 0 and offsets.tolist() == [0, size] and size == 32


def _experts(counts, hidden=8, out=16):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), hidden, dtype=torch.float32, requires_grad=True)
    weights = [torch.randn(out, hidden, dtype=torch.float32, requires_grad=True) for _ in counts]
    return x, weights


@pytest.mark.parametrize("counts", [[3, 5, 2], [0, 7, 1], [4, 0, 0]])
def test_grouped_linear_is_each_experts_linear_forward_and_backward(counts):
    """Through the aligned buffer, as GroupedExperts runs it; an expert with no token gets a
    zero gradient, not NaN."""
    x, weights = _experts(counts)
    destination, offsets, size = aligned_rows(torch.tensor(counts), x.shape[0])
    buffer = x.new_zeros(size, x.shape[1]).index_copy(0, destination, x)
    got = _GroupedLinear.apply(buffer, offsets, *weights).index_select(0, destination)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, [x, *weights], grad)
    expected = torch.cat([part @ w.T for part, w in zip(torch.split(x, counts), weights)])
    expected_grads = torch.autograd.grad(expected, [x, *weights], grad)
    torch.testing.assert_close(got, expected)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e)
    for count, g in zip(counts, got_grads[1:]):
        assert torch.isfinite(g).all() and (count > 0 or not g.any())


def test_the_backward_stacks_the_weights_again_instead_of_keeping_the_stack():
    x, weights = _experts([2, 2])
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    y = _GroupedLinear.apply(x, offsets, *weights)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 2 + len(weights) and all(s is w for s, w in zip(saved[2:], weights))


def _model(experts="auto", bias=False, moe=True):
    from types import SimpleNamespace

    return SimpleNamespace(moe=SimpleNamespace(experts=experts) if moe else None, bias=bias)


@pytest.mark.parametrize("model, device, precision, capability, impl, why", [
    (_model(moe=False), "cuda", "bf16", (9, 0), None, None),
    (_model("sequential"), "cuda", "bf16", (9, 0), "sequential", "model.moe.experts"),
    (_model("grouped"), "cpu", "fp32", None, "grouped", "model.moe.experts"),
    (_model(), "cpu", "fp32", None, "sequential", "no fast CPU kernel"),
    (_model(), "cuda", "fp32", (9, 0), "sequential", "takes bf16, not fp32"),
    (_model(), "cuda", "bf16", (8, 0), "sequential", "sm80 has no fast grouped GEMM kernel"),
    (_model(), "cuda", "bf16", (9, 0), "grouped", "bf16 on sm90"),
    (_model(), "cuda", "bf16", (10, 0), "grouped", "bf16 on sm100"),
    (_model(), "cuda", "bf16", None, "grouped", "take sequential when they start"),
    (_model(bias=True), "cuda", "bf16", (9, 0), "sequential", "no biases"),
])
def test_auto_picks_grouped_where_torch_has_its_fast_kernel(model, device, precision, capability,
                                                             impl, why):
    choice = choose_experts(model, device=device, precision=precision, capability=capability)
    if impl is None:
        assert choice is None
        return
    assert choice.impl == impl and why in choice.why


def test_grouped_experts_with_biases_are_refused():
    from dsforge.problems import RecipeError
    from dsforge.recipe import load_recipe
    from tests.conftest import REPO

    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / "recipes" / "tiny_moe.yaml", ["model.moe.experts=grouped", "model.bias=true"])
    assert "E9" in [p.rule for p in info.value.problems]
