"""train.fp8 (runtime/assemble/fp8.py): Megatron-Core's linear layers multiply in float8 through
torchao's function, checked on the CPU, where torch runs float8 products too (the product
dsforge refuses on CPU ranks, rule FP6, for speed, not for numbers): the model's loss and
gradients follow bf16's, every transformer linear layer goes through torchao and nothing
else does, and a compiled layer stays one graph with the casts inside. The rules FP1-FP6."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dsforge.problems import RecipeError
from dsforge.recipe import resolve_file
from dsforge.translate.fp8 import fp8_device_problems
from tests.conftest import REPO
from tests.unit.helpers.child import run_child

TINY = REPO / "recipes" / "tiny.yaml"
SEQ = 32
pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    return run_child("tests.unit.test_fp8_layers", tmp_path_factory.mktemp("fp8"), "fp8.json")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_float8_layers_follow_bf16(ran, scaling):
    bf16, fp8 = ran["none"], ran[scaling]
    assert fp8["products"] == 4 * 4  # each of the 4 layers' 4 linear layers, once a forward
    assert abs(fp8["loss"] - bf16["loss"]) / bf16["loss"] < 0.02
    assert fp8["grad_cosine"] > 0.95 and fp8["finite"]
    assert fp8["loss"] != bf16["loss"]  # the products did change


def test_a_float8_layer_compiles_to_one_graph(ran):
    assert ran["compiled_graphs"] == 1, ran["compiled_reasons"]


@pytest.mark.parametrize("overrides, rule", [
    (("train.precision=fp32",), "FP1"),
    (("parallel.tp=2", "parallel.dp=1"), "FP2"),
    (("zero.stage=3",), "FP3"),
    (("model.preset=tiny-moe", "parallel.ep=1"), "FP4"),
    (("model.ffn_hidden_size=100",), "FP5"),
])
def test_what_float8_cannot_run_is_refused_with_its_rule(overrides, rule):
    with pytest.raises(RecipeError) as err:
        resolve_file(TINY, ["train.precision=bf16", "train.fp8=tensorwise", *overrides], world_size=2)
    found = [p for p in err.value.problems if p.rule == rule]
    assert found and "train.fp8" in found[0].fields and found[0].fix


def test_the_device_must_run_float8_gemms():
    assert [p.rule for p in fp8_device_problems("tensorwise", device="cpu", capability=None,
                                                torchao_available=True)] == ["FP6"]
    a100 = fp8_device_problems("tensorwise", device="cuda", capability=(8, 0), torchao_available=True)
    assert [p.rule for p in a100] == ["FP6"] and "none" in a100[0].fix
    l40s = fp8_device_problems("rowwise", device="cuda", capability=(8, 9), torchao_available=True)
    assert [p.rule for p in l40s] == ["FP6"] and "tensorwise" in l40s[0].fix
    assert fp8_device_problems("rowwise", device="cuda", capability=(9, 0), torchao_available=True) == []
    missing = fp8_device_problems("rowwise", device="cuda", capability=None, torchao_available=False)
    assert [p.rule for p in missing] == ["X1"] and "dsforge[gpu]" in missing[0].fix
    assert fp8_device_problems("none", device="cpu", capability=None, torchao_available=False) == []


def _step(chunk, tokens) -> tuple[float, torch.Tensor]:
    chunk.zero_grad(set_to_none=True)
    positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], -1)
    loss = chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in chunk.parameters() if p.grad is not None])
    return loss.item(), grads


def _chunk(resolved):
    from dsforge.runtime.assemble.init import init_layout_invariant
    from dsforge.runtime.assemble.model import build_model_chunks
    from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                            transformer_config_kwargs)

    r = resolved.recipe
    config = build_transformer_config(transformer_config_kwargs(
        model=r.model, train=r.train, layout=resolved.layout, device="cpu"))
    chunks = build_model_chunks(config, gpt_model_kwargs(model=r.model, layout=resolved.layout),
                                torch.device("cpu"), vocab_size=r.model.vocab_size)
    init_layout_invariant(chunks, seed=1, std=r.model.init_std, num_layers=r.model.num_layers,
                          vocab_size=r.model.vocab_size)
    return chunks[0].to(torch.bfloat16)


def _child(folder: Path) -> None:
    from torchao.float8 import float8_linear

    from dsforge.runtime.assemble.fp8 import float8_linears
    from tests.unit.test_accepted_builds import _init_one_rank_world
    from tests.unit.test_compile_layers import _explain

    _init_one_rank_world(folder)
    resolved = resolve_file(TINY, ["parallel.dp=1", "train.precision=bf16"], world_size=1)
    tokens = torch.randint(0, resolved.recipe.model.vocab_size, (2, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))
    calls = {"n": 0}
    original = float8_linear.matmul_with_hp_or_float8_args.apply

    def counted(*args):
        calls["n"] += 1
        return original(*args)

    float8_linear.matmul_with_hp_or_float8_args.apply = counted
    results = {}
    reference = None
    for scaling in ("none", "tensorwise", "rowwise"):
        chunk = _chunk(resolved)
        if scaling != "none":
            float8_linears([chunk], scaling)
        calls["n"] = 0
        loss, grads = _step(chunk, tokens)
        reference = grads if reference is None else reference
        results[scaling] = {"loss": loss, "products": calls["n"], "finite": bool(grads.isfinite().all()),
                            "grad_cosine": torch.nn.functional.cosine_similarity(grads, reference, dim=0).item()}
    float8_linear.matmul_with_hp_or_float8_args.apply = original
    chunk = _chunk(resolved)
    float8_linears([chunk], "tensorwise")
    found = _explain(chunk.decoder.layers[0].to(torch.bfloat16), resolved.recipe.model.hidden_size,
                     chunk.rotary_pos_emb(16), dtype=torch.bfloat16)
    results.update(compiled_graphs=found["graphs"], compiled_reasons=found["reasons"])
    (folder / "fp8.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
