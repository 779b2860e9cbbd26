"""model.kernels and model.sdpa_backend: the choice, its checks, and the liger path's wiring.

Liger Kernel's Triton kernels run only on a GPU (tests/gpu/test_gpu_precision.py holds their
losses to the plain path's over 30 steps). Here, on the CPU: which kernels each device and
installation gets, the refusals (K1, X1), and that the liger path puts its three pieces where
they belong: every norm, every MLP's activation (dense and each expert's) and the loss (with
one tensor-parallel rank, the output layer and the cross-entropy as one function). For
that, Liger's functions are replaced by torch references that count their calls (the one
seam, runtime/kernels.liger_ops): a model built with kernels "liger" must then compute the
plain model's loss and gradients exactly, and every stand-in must have been called. Built in
a child interpreter, as tests/unit/test_accepted_builds.py does (the CPU backend patches the
process).

The vocabulary's padding (runtime/assemble/vocab.py) is no part of any loss: with a vocabulary
Megatron pads, both paths must compute the loss and gradients of a model of exactly the
recipe's vocabulary, whatever the padded rows hold, and leave those rows without gradient; and
the masked shards of vocab-parallel logits must give the unpadded softmax on every tp.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsforge.problems import errors
from dsforge.recipe import Topology, resolve, validate
from dsforge.runtime.assemble.vocab import first_padded_column, mask_padded_logits
from dsforge.schema import ModelConfig, padded_vocab_size
from dsforge.translate.kernels import choose_kernels, device_problems
from tests.conftest import REPO, make_recipe

SEQ_LEN = 16


def _model(**fields) -> ModelConfig:
    return make_recipe(*(f"model.{k}={v}" for k, v in fields.items())).model


@pytest.mark.parametrize("device, installed, expected", [
    ("cpu", True, "torch"), ("cpu", False, "torch"), ("cuda", True, "liger"), ("cuda", False, "torch")])
def test_auto_uses_liger_only_on_gpus_where_installed(device, installed, expected):
    choice = choose_kernels(_model(), device=device, liger_available=installed)
    assert choice.impl == expected
    assert choice.why.startswith("auto")


def test_kernels_named_in_the_recipe_are_kept():
    assert choose_kernels(_model(kernels="torch"), device="cuda", liger_available=True).impl == "torch"
    assert choose_kernels(_model(kernels="liger"), device="cuda", liger_available=True).impl == "liger"


def test_cpu_ranks_refuse_what_only_a_gpu_runs():
    asked = _model(kernels="liger", sdpa_backend="cudnn")
    problems = device_problems(asked, device="cpu", precision="bf16", liger_available=True)
    assert [(p.rule, list(p.fields)) for p in problems] == [
        ("K1", ["model.kernels"]), ("K1", ["model.sdpa_backend"])]
    assert "model.kernels: auto" in problems[0].fix
    assert device_problems(asked, device="cuda", precision="bf16", liger_available=True) == []
    assert device_problems(_model(sdpa_backend="flash"), device="cpu", precision="fp32",
                           liger_available=False) == []


@pytest.mark.parametrize("backend, precision, refused", [
    ("flash", "fp32", True), ("cudnn", "fp32", True), ("flash", "bf16", False),
    ("efficient", "fp32", False), ("auto", "fp32", False)])
def test_gpu_attention_kernels_for_16_bits_only_are_refused_in_fp32(backend, precision, refused):
    problems = device_problems(_model(sdpa_backend=backend), device="cuda", precision=precision,
                               liger_available=True)
    assert [p.rule for p in problems] == (["K1"] if refused else [])


def test_liger_is_checked_where_the_ranks_run_not_at_validation():
    """A laptop without liger-kernel plans and validates a GPU job that asks for it; the
    machines its ranks run on must have it (the fit check here, preflight on each host)."""
    assert not errors(validate(make_recipe("model.kernels=liger"), Topology(world_size=1)))
    problems = device_problems(_model(kernels="liger"), device="cuda", precision="bf16",
                               liger_available=False)
    assert [(p.rule, p.fields) for p in problems] == [("X1", {"model.kernels": "liger"})]
    assert "pip install 'dsforge[gpu]'" in problems[0].fix
    assert device_problems(_model(), device="cuda", precision="bf16", liger_available=False) == []


# 257 at tp 4: rank 2 holds one real column, rank 3 none; 512 pads nothing.
@pytest.mark.parametrize("vocab, tp", [(257, 1), (257, 2), (257, 4), (300, 2), (32000, 4), (512, 2)])
def test_masked_vocab_parallel_logits_give_the_unpadded_loss(vocab, tp):
    """Each tp rank masks its shard of the padded logits; the softmax over every shard (what
    the vocab-parallel cross-entropies compute) is then the softmax over the recipe's
    vocabulary, and no gradient reaches a padded column. The same for gathered logits."""
    padded = padded_vocab_size(vocab, tp)
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 2, padded, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (3 * 2,), generator=g)
    width = padded // tp
    shards = [mask_padded_logits(shard.clone(), first_padded_column(vocab, width, padded, rank))
              for rank, shard in enumerate(logits.split(width, dim=-1))]
    gathered = mask_padded_logits(logits.clone(), first_padded_column(vocab, padded, padded, tp - 1))
    expected = F.cross_entropy(logits[..., :vocab].flatten(0, 1), labels)
    for masked in (torch.cat(shards, dim=-1), gathered):
        loss = F.cross_entropy(masked.flatten(0, 1), labels)
        assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
        (grad,) = torch.autograd.grad(loss, logits)
        (unpadded,) = torch.autograd.grad(expected, logits, retain_graph=True)
        assert not grad[..., vocab:].any()
        assert torch.allclose(grad, unpadded, atol=1e-7)


@pytest.fixture(scope="module")
def wiring(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("kernels")
    child = subprocess.run([sys.executable, "-m", "tests.unit.test_kernels", str(folder)],
                           cwd=REPO, capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads((folder / "results.json").read_text())


CASES = ["dense", "moe", "dense_gqa_math", "dense_vocab_300", "tied_vocab_300"]


@pytest.mark.parametrize("case", CASES)
def test_liger_path_computes_the_plain_model(wiring, case):
    result = wiring[case]
    assert result["loss_difference"] < 1e-6
    assert result["largest_grad_difference"] < 1e-5
    # Every norm (2 per layer + the final one), every activation, the loss: once per call.
    assert result["calls"] == result["expected_calls"]


@pytest.mark.parametrize("case", CASES)
def test_both_paths_compute_the_model_of_the_unpadded_vocabulary(wiring, case):
    """300 ids are 384 rows at tp 1; the padded rows hold drawn numbers, as a checkpoint saved
    without masking would: they must change neither the loss nor a real row's gradient."""
    for path in ("plain", "liger"):
        result = wiring[case][path]
        assert result["loss_difference"] < 1e-6, path
        assert result["largest_grad_difference"] < 1e-6, path
        assert result["padding_grad"] == 0.0, path
        assert result["logits_masked"], path


# --- the child: one-rank gloo world, models built with and without the liger path ---

class _StandIns:
    """torch references with Liger's call signatures, counting their calls."""

    def __init__(self):
        self.calls = {"rms_norm": 0, "swiglu": 0, "cross_entropy": 0, "linear_cross_entropy": 0}

    def ops(self):
        from dsforge.runtime.assemble.kernels import LigerOps

        def rms_norm(x, weight, eps):
            self.calls["rms_norm"] += 1
            return F.rms_norm(x, (x.shape[-1],), weight, eps)

        def swiglu(x):
            self.calls["swiglu"] += 1
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up

        def cross_entropy(logits, labels, tp_group):
            self.calls["cross_entropy"] += 1
            flat = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
            return flat.view(labels.shape)

        def linear_cross_entropy(x, weight, labels):
            self.calls["linear_cross_entropy"] += 1
            return F.cross_entropy((x @ weight.t()).float(), labels)

        return LigerOps(rms_norm=rms_norm, swiglu=swiglu, cross_entropy=cross_entropy,
                        linear_cross_entropy=linear_cross_entropy)


def _build(resolved, kernels: str, sdpa_backend: str, padded: bool = True):
    """The rank's model; `padded=False`: one of exactly the recipe's vocabulary (Megatron
    takes any at tp 1), the reference the padded one must equal."""
    from dsforge.runtime.assemble.model import build_model_chunks
    from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                            transformer_config_kwargs)

    r = resolved.recipe
    config = build_transformer_config(transformer_config_kwargs(
        model=r.model, train=r.train, layout=resolved.layout, device="cpu", kernels=kernels))
    gpt_kwargs = gpt_model_kwargs(model=r.model, layout=resolved.layout)
    if not padded:
        gpt_kwargs["vocab_size"] = r.model.vocab_size
    (chunk,) = build_model_chunks(config, gpt_kwargs, torch.device("cpu"),
                                  vocab_size=r.model.vocab_size, kernels=kernels,
                                  sdpa_backend=sdpa_backend)
    return chunk


def _load_with_drawn_padding(padded, unpadded) -> None:
    """`padded` holds `unpadded`'s weights, and drawn numbers in its padded rows."""
    with torch.no_grad():
        for name, param in padded.named_parameters():
            source = unpadded.get_parameter(name)
            param[:source.shape[0]] = source
            param[source.shape[0]:] = torch.randn_like(param[source.shape[0]:])


def _loss_and_grads(chunk, tokens):
    positions = torch.arange(SEQ_LEN).unsqueeze(0).expand(tokens.shape[0], -1)
    loss = chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}


def _compare(overrides: tuple[str, ...], sdpa_backend: str) -> dict:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from dsforge.runtime.assemble import kernels as kernels_mod

    resolved = resolve(make_recipe("parallel.dp=1", "train.precision=fp32", *overrides),
                       Topology(world_size=1))
    stand_ins = _StandIns()
    kernels_mod.liger_ops = stand_ins.ops
    get_moe_layer_wise_logging_tracker().clear()
    unpadded = _build(resolved, "torch", sdpa_backend, padded=False)
    plain = _build(resolved, "torch", sdpa_backend)
    _load_with_drawn_padding(plain, unpadded)
    liger = _build(resolved, "liger", sdpa_backend)
    liger.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, resolved.recipe.model.vocab_size, (2, SEQ_LEN + 1))
    unpadded_loss, unpadded_grads = _loss_and_grads(unpadded, tokens)
    plain_loss, plain_grads = _loss_and_grads(plain, tokens)
    liger_loss, liger_grads = _loss_and_grads(liger, tokens)
    assert plain_grads.keys() == liger_grads.keys() == unpadded_grads.keys()
    calls = dict(stand_ins.calls)  # of the forward with labels
    m = resolved.recipe.model
    experts_per_layer = m.moe.num_experts if m.moe else 1
    return {"loss_difference": abs(plain_loss - liger_loss),
            "largest_grad_difference": max((plain_grads[n] - liger_grads[n]).abs().max().item()
                                           for n in plain_grads),
            **{path: {**_against_unpadded(loss, grads, unpadded_loss, unpadded_grads),
                      "logits_masked": _logits_masked(chunk, tokens, m.vocab_size)}
               for path, chunk, loss, grads in (("plain", plain, plain_loss, plain_grads),
                                                ("liger", liger, liger_loss, liger_grads))},
            "calls": calls,
            # forward only: the stand-ins are plain torch, autograd runs their backward
            # one tp rank: the output layer and the loss fused (vocab-parallel CE: tp > 1)
            "expected_calls": {"rms_norm": 2 * m.num_layers + 1,
                               "swiglu": m.num_layers * experts_per_layer,
                               "cross_entropy": 0, "linear_cross_entropy": 1}}


def _against_unpadded(loss: float, grads: dict, unpadded_loss: float, unpadded_grads: dict) -> dict:
    """How far a padded model's loss and real rows' gradients are from the unpadded model's,
    and the largest gradient of a padded row."""
    rows = {n: g.shape[0] for n, g in unpadded_grads.items()}
    return {"loss_difference": abs(loss - unpadded_loss),
            "largest_grad_difference": max((grads[n][:rows[n]] - g).abs().max().item()
                                           for n, g in unpadded_grads.items()),
            "padding_grad": max((grads[n][rows[n]:].abs().max().item() for n in grads
                                 if grads[n].shape[0] > rows[n]), default=0.0)}


def _logits_masked(chunk, tokens, vocab: int) -> bool:
    """Without labels (evaluation, generation) the model returns logits whose padded columns
    are the lowest value: no softmax or argmax of them picks a padded id."""
    positions = torch.arange(SEQ_LEN).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = chunk(tokens[:, :-1], positions, None)
    return bool((logits[..., vocab:] == torch.finfo(logits.dtype).min).all()) and \
        bool((logits[..., :vocab] > -1e4).all())


def _child(folder: Path) -> None:
    from tests.unit.test_accepted_builds import _init_one_rank_world

    _init_one_rank_world(folder)
    torch.manual_seed(0)
    # top-1 of 1 expert would drop tokens into no expert: route each token to every expert, so
    # each expert's activation runs once per forward
    moe = ("model.preset=tiny-moe", "model.moe.top_k=4", "model.moe.num_experts=4")
    results = {"dense": _compare((), "auto"), "moe": _compare(moe, "auto"),
               "dense_gqa_math": _compare(("model.num_kv_heads=2",), "math"),
               "dense_vocab_300": _compare(("model.vocab_size=300",), "auto"),
               "tied_vocab_300": _compare(("model.vocab_size=300", "model.tie_embeddings=true"),
                                          "auto")}
    (folder / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))


def test_auto_falls_back_to_torch_where_liger_does_not_load(monkeypatch):
    """A broken Triton or liger-kernel install: auto trains on torch's kernels and says why;
    liger asked for by name is not silently replaced."""
    from dsforge.runtime.assemble import kernels as kernels_mod
    from dsforge.translate.kernels import KernelChoice

    def broken():
        raise ImportError("libtriton.so: cannot open shared object file")

    monkeypatch.setattr(kernels_mod, "liger_ops", broken)
    liger = KernelChoice("liger", "auto: GPU ranks and liger-kernel installed")
    fallback = kernels_mod.loadable(liger, "auto")
    assert fallback.impl == "torch" and "libtriton.so" in fallback.why
    assert kernels_mod.loadable(liger, "liger") is liger
    monkeypatch.setattr(kernels_mod, "liger_ops", lambda: None)
    assert kernels_mod.loadable(liger, "auto") is liger
