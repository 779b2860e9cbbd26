"""model.compile: layers (runtime/assemble/compile.py): a dense Megatron-Core layer as dsforge
builds it is one graph for torch.compile, with and without selective checkpointing; the rules
that refuse what does not compile (CM1-CM5); the recompile watch. That compiled runs train
with eager's losses is tests/distributed/test_compile_run.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dsforge.problems import RecipeError
from dsforge.recipe import resolve_file
from tests.conftest import REPO
from tests.unit.helpers.child import run_child

TINY = REPO / "recipes" / "tiny.yaml"

SEQ, BATCH = 16, 2


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, dict]:
    """torch._dynamo.explain on the first layer of the tiny model, per checkpointing, from one
    child (Megatron-Core and a process group stay out of pytest's process)."""
    return run_child("tests.unit.test_compile_layers", tmp_path_factory.mktemp("compile"),
                     "graphs.json")


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_a_dense_layer_is_one_graph(graphs, checkpointing):
    found = graphs[checkpointing]
    assert (found["graphs"], found["breaks"]) == (1, 0), found["reasons"]


def test_without_the_fixes_the_layer_breaks(graphs):
    """The check can fail: Megatron-Core's layer as it comes breaks the graph."""
    assert graphs["unfixed"]["graphs"] > 1


@pytest.mark.parametrize("overrides, rule", [
    (("zero.stage=3",), "CM1"),
    (("model.preset=tiny-moe", "parallel.ep=1"), "CM2"),
    (("parallel.tp=2", "parallel.dp=1"), "CM3"),
])
def test_what_does_not_compile_is_refused_with_its_rule(overrides, rule):
    with pytest.raises(RecipeError) as err:
        resolve_file(TINY, ["model.compile=layers", *overrides], world_size=2)
    found = [p for p in err.value.problems if p.rule == rule]
    assert found and "model.compile" in found[0].fields and found[0].fix


def test_compile_is_off_by_default_and_layers_validate():
    assert resolve_file(TINY, [], world_size=2).recipe.model.compile == "none"
    resolve_file(TINY, ["model.compile=layers", "parallel.pp=2", "parallel.dp=1"],
                 world_size=2)


def _explain(layer, hidden: int, rope, dtype=torch.float32) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    x = torch.randn(SEQ, BATCH, hidden, dtype=dtype, requires_grad=True)
    found = torch._dynamo.explain(lambda t: layer(t, attention_mask=None, rotary_pos_emb=rope))(x)
    return {"graphs": found.graph_count, "breaks": found.graph_break_count,
            "reasons": [r.reason.splitlines()[0] for r in found.break_reasons]}


def _child(folder: Path) -> None:
    from dsforge.runtime.assemble.compile import traceable
    from dsforge.runtime.assemble.model import build_model_chunks
    from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                            transformer_config_kwargs)
    from tests.unit.test_accepted_builds import _init_one_rank_world

    _init_one_rank_world(folder)
    results = {}
    for checkpointing in ("none", "selective"):
        resolved = resolve_file(TINY, ["parallel.dp=1", "train.precision=fp32",
                                f"train.activation_checkpointing={checkpointing}"], world_size=1)
        r = resolved.recipe
        config = build_transformer_config(transformer_config_kwargs(
            model=r.model, train=r.train, layout=resolved.layout, device="cpu"))
        (chunk,) = build_model_chunks(config, gpt_model_kwargs(model=r.model, layout=resolved.layout),
                                      torch.device("cpu"), vocab_size=r.model.vocab_size)
        layer = traceable(chunk.decoder.layers[0], selective=checkpointing == "selective")
        results[checkpointing] = _explain(layer, r.model.hidden_size, chunk.rotary_pos_emb(SEQ))
    results["unfixed"] = _unfixed(chunk, r.model.hidden_size)
    (folder / "graphs.json").write_text(json.dumps(results))


def _unfixed(chunk, hidden: int) -> dict:
    """The same layer with Megatron-Core's RowParallelLinear and offloading context restored."""
    import importlib

    from dsforge.runtime.assemble import megatron_fixes

    attention = importlib.import_module(megatron_fixes.ATTENTION)
    row = importlib.import_module(megatron_fixes.LAYERS).RowParallelLinear
    fixed_impl, fixed_interface = row._forward_impl, attention.off_interface
    row._forward_impl = fixed_impl.__wrapped_original__
    attention.off_interface = fixed_interface.__mro__[1]
    try:
        return _explain(chunk.decoder.layers[1], hidden, chunk.rotary_pos_emb(SEQ))
    finally:
        row._forward_impl, attention.off_interface = fixed_impl, fixed_interface


if __name__ == "__main__":
    _child(Path(sys.argv[1]))


def test_inductor_needs_a_compiler_and_a_writable_cache(tmp_path, monkeypatch):
    from dsforge.recipe import load_recipe
    from dsforge.translate.compile import BACKEND_ENV, compile_problems

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    model = load_recipe(TINY, ["model.compile=layers"]).model
    blocked = tmp_path / "a-file"  # no directory can be made under a file, even by root
    blocked.write_text("")
    found = compile_problems(model, compiler=None, cache_dir=str(blocked / "inductor"), host="h")
    assert [p.rule for p in found] == ["CM4", "CM5"]
    assert compile_problems(model, compiler="/usr/bin/c++", cache_dir=str(tmp_path / "a" / "b"),
                            host="h") == []
    eager = load_recipe(TINY, []).model
    assert compile_problems(eager, compiler=None, cache_dir="/proc/x", host="h") == []
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # nothing compiled to C++
    assert compile_problems(model, compiler=None, cache_dir=None, host="h") == []


def test_a_recompile_after_the_warm_up_is_said_once(monkeypatch):
    from dsforge.runtime.assemble import compile as compiled

    graphs = iter([2, 3, 3, 3, 5, 6])  # after step 0 (said with the time), then each step
    monkeypatch.setattr(compiled, "graphs_compiled", lambda: next(graphs))
    monkeypatch.setattr(compiled, "compile_seconds", lambda: 12.5)
    report = compiled.CompileReport()
    said = [report.after_step(step, warm=step >= 2) for step in range(6)]
    assert said[0].startswith("layers compiled in 12.5 s, inside step 1 (2 graph(s)")
    assert report.compile_s == 12.5 and said[1:4] == [None, None, None]
    assert said[4].startswith("warning: the compiled layers compiled again at step 5 (2 new")
    assert said[5] is None  # once


def test_evaluation_graphs_are_not_recompiles(monkeypatch):
    from dsforge.runtime.assemble import compile as compiled

    graphs = iter([2, 3, 3, 5, 5])  # step 0, 1, 2; evaluation adds two; step 3
    monkeypatch.setattr(compiled, "graphs_compiled", lambda: next(graphs))
    monkeypatch.setattr(compiled, "compile_seconds", lambda: 1.0)
    report = compiled.CompileReport()
    said = [report.after_step(step, warm=step >= 1) for step in range(3)]
    report.rebaseline()
    assert said[1:] == [None, None] and report.after_step(3, warm=True) is None


def test_inductor_cache_is_the_users_choice_else_dsforges(tmp_path, monkeypatch):
    from dsforge.translate.compile import INDUCTOR_CACHE_ENV, inductor_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = str(tmp_path / "dsforge" / "inductor")
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert inductor_cache_dir() == ours
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, "/tmp/torchinductor_me")  # written by torch itself
    assert inductor_cache_dir(torch_default="/tmp/torchinductor_me") == ours
    assert inductor_cache_dir() == "/tmp/torchinductor_me"  # where torch's default is unknown
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert inductor_cache_dir(torch_default="/tmp/torchinductor_me") == str(tmp_path / "mine")
