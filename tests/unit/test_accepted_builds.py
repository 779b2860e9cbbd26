"""A recipe that validates must build: accepted-then-crash cannot recur (issue 9: an MoE with
top_k 1 passed validation and Megatron-Core refused it at model build).

The recipes: every one the rule tests accept (test_validate.ACCEPTED) and every shipped recipe
at tiny size (recipe/tiny.py, same layout). Each goes through dsforge's own translation and
model builder: the TransformerConfig at the recipe's real layout (Megatron-Core checks heads,
query groups, sequence and expert parallelism against tp and ep there), then the GPTModel at
tp = pp = cp = ep = 1, all a one-rank gloo world can hold, run forward and backward on one tiny
batch. The CPU backend patches the whole process, so the builds run in one child interpreter
(`python -m tests.unit.test_accepted_builds FOLDER`), not in pytest's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsforge.recipe import Resolved, Topology, resolve, resolve_file
from dsforge.recipe.loader import build_recipe, dump_recipe, parse_yaml
from dsforge.recipe.tiny import tiny_resolved
from dsforge.runtime.assemble import cpu_backend, megatron_fixes
from dsforge.runtime.assemble.model import build_model_chunks
from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                        transformer_config_kwargs)
from tests.conftest import RECIPES, make_recipe
from tests.unit.helpers.child import run_child
from tests.unit.test_validate import ACCEPTED, MOE

SEQ_LEN = 16


def _accepted(overrides: tuple[str, ...], world: int) -> Resolved:
    return resolve(make_recipe(*overrides), Topology(world_size=world))


# Top-1 routing without the load-balancing loss: the router learns from the LM loss alone.
TOP1 = (*MOE, "model.moe.top_k=1", "model.moe.aux_loss_coeff=0")
CASES: dict[str, Resolved] = {
    **{f"recipe {p.stem}": tiny_resolved(resolve_file(p)) for p in RECIPES},
    **{f"{' '.join(o)} @{w}": _accepted(o, w) for o, w in ACCEPTED},
    "top-1 router": _accepted(TOP1, 1),
}


def _build_key(resolved: Resolved) -> str:
    """What a build depends on: the Megatron-Core arguments dsforge translates the recipe to
    (many rule cases differ only in fields that do not reach the model)."""
    r, lay = resolved.recipe, resolved.layout
    return json.dumps([transformer_config_kwargs(model=r.model, train=r.train, layout=lay, device="cpu"),
                       gpt_model_kwargs(model=r.model, layout=lay)], sort_keys=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, dict]:
    """Each case's result ({"error", "router_grad"}), from one child building each model once."""
    folder = tmp_path_factory.mktemp("builds")
    keys = {name: _build_key(r) for name, r in CASES.items()}
    unique = {key: name for name, key in keys.items()}
    cases = {name: [dump_recipe(CASES[name].recipe), CASES[name].layout.world_size]
             for name in unique.values()}
    (folder / "cases.json").write_text(json.dumps(cases))
    results = run_child("tests.unit.test_accepted_builds", folder, "results.json", timeout_s=240)
    return {name: results[unique[key]] for name, key in keys.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_accepted_recipe_builds_and_runs(built, name):
    assert built[name]["error"] is None, built[name]["error"]


def test_top1_routing_trains_the_router_through_its_gate(built):
    """Switch-style top-1: the chosen expert's output is scaled by its softmax probability, so
    the LM loss reaches the router (with post-softmax top-1 the weight is a constant 1.0)."""
    assert CASES["top-1 router"].recipe.model.moe.top_k == 1
    assert built["top-1 router"]["router_grad"] > 0


def _one_rank(resolved: Resolved) -> Resolved:
    lay = dataclasses.replace(resolved.layout, world_size=1, dp=1, tp=1, pp=1, vpp=1, cp=1, ep=1,
                              etp=1, edp=1, sequence_parallel=False)
    return dataclasses.replace(resolved, layout=lay)


def _config(resolved: Resolved):
    r = resolved.recipe
    return build_transformer_config(transformer_config_kwargs(
        model=r.model, train=r.train, layout=resolved.layout, device="cpu"))


def _build_and_run(resolved: Resolved) -> float | None:
    """Builds and runs one step's forward and backward; the router's gradient norm (MoE)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    # Megatron keeps one MoE aux-loss tracker per process, sized by the first model's layers.
    get_moe_layer_wise_logging_tracker().clear()
    _config(resolved)  # Megatron-Core's checks against the real layout
    small = _one_rank(resolved)
    gpt_kwargs = gpt_model_kwargs(model=small.recipe.model, layout=small.layout)
    (chunk,) = build_model_chunks(_config(small), gpt_kwargs, torch.device("cpu"),
                                  vocab_size=small.recipe.model.vocab_size)
    tokens = torch.randint(0, small.recipe.model.vocab_size, (1, SEQ_LEN + 1))
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    model = resolved.recipe.model
    if model.moe is not None and model.bias:
        # Expert biases train only with ep >= 2 (rule E8), on Megatron's explicit
        # expert-communication path, which a one-rank world cannot take: forward only.
        with torch.no_grad():
            chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        return None
    chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
    grads = [p.grad.norm().item() for n, p in chunk.named_parameters() if "router" in n]
    return sum(grads) if grads else None


def _init_one_rank_world(folder: Path) -> None:
    # Megatron-Core is imported in the child only: seconds of import pytest's process does not need.
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    megatron_fixes.apply()
    if not torch.cuda.is_available():
        cpu_backend.activate()
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)


def _child(folder: Path) -> None:
    _init_one_rank_world(folder)
    results = {}
    for name, (text, world) in json.loads((folder / "cases.json").read_text()).items():
        resolved = resolve(build_recipe(parse_yaml(text)), Topology(world_size=world))
        try:
            results[name] = {"error": None, "router_grad": _build_and_run(resolved)}
        except Exception:  # reported per recipe by the parent
            results[name] = {"error": traceback.format_exc(limit=-6), "router_grad": None}
    (folder / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
