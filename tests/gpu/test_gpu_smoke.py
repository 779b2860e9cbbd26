"""On a GPU: a default run trains in bf16 through NCCL, builds nothing and draws its weights on
the GPU (skipped on CPU).

"Nothing built at run time" (issue 21): the default GPU optimizer is torch's fused AdamW, so
no DeepSpeed op is compiled. A DeepSpeed JIT build writes its extension under
TORCH_EXTENSIONS_DIR (the run's own, empty at the start, conftest.py) and prints its load
line ("Time to load fused_adam op") into the run's job.log; neither may appear.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsforge.job.metrics_file import read_metrics
from dsforge.recipe.loader import load_recipe
from dsforge.translate.optimizer import ops_built_at_run_time

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

BUILD_LINES = ("Time to load", "Building extension module", "Emitting ninja build file")


def test_default_run_trains_in_bf16_on_one_gpu(gpu_runs):
    run = gpu_runs["default"]
    losses = run.losses()
    assert losses[-1] < losses[0]
    records, _ = read_metrics(run.run_dir / "metrics.jsonl")
    assert records[-1]["memory_source"] == "cuda max_memory_allocated"
    manifest = json.loads((run.run_dir / "manifest.json").read_text())
    assert manifest["device"]["type"] == "cuda"


def test_default_run_builds_nothing(gpu_runs):
    run = gpu_runs["default"]
    run.losses()  # it ran
    recipe = load_recipe(run.run_dir / "recipe.yaml")
    assert ops_built_at_run_time(train=recipe.train, zero=recipe.zero, device="cuda") == ()
    # what the engine was built with (runtime/loop/manifest.py), not what the recipe asks
    used = json.loads((run.run_dir / "manifest.json").read_text())["implementations"]
    assert used["optimizer"][-1] == "AdamW" and used["optimizer_fused"], used
    built = sorted(p.relative_to(run.extensions_dir) for p in run.extensions_dir.rglob("*"))
    assert built == [], f"a DeepSpeed op was built at run time: {built}"
    log = (run.run_dir / "job.log").read_text(errors="replace")
    assert not [line for line in log.splitlines() if any(b in line for b in BUILD_LINES)]


def test_weights_are_drawn_on_the_gpu_the_same_for_every_layout():
    """runtime/assemble/init.py draws each weight on its parameter's device (a CPU draw was
    ~30 s of a 7B rank's start-up): the GPU's generator, seeded by the name, gives the same
    full tensor on every call, so every layout's shard comes from the same weights."""
    from dsforge.runtime.assemble.init import _draw

    device = torch.device("cuda", torch.cuda.current_device())
    first = _draw("decoder.layers.0.mlp.linear_fc1.weight", [512, 256], torch.bfloat16, 1234, 0.02, device)
    again = _draw("decoder.layers.0.mlp.linear_fc1.weight", [512, 256], torch.bfloat16, 1234, 0.02, device)
    other = _draw("decoder.layers.1.mlp.linear_fc1.weight", [512, 256], torch.bfloat16, 1234, 0.02, device)
    assert first.device == device and first.dtype == torch.bfloat16
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.float().std().item() == pytest.approx(0.02, rel=0.05)


def test_the_run_says_where_its_start_up_went(gpu_runs):
    run = gpu_runs["default"]
    run.losses()  # it ran
    startup = json.loads((run.run_dir / "summary.json").read_text())["startup_s"]
    assert {"setup", "distributed", "model", "weights", "engine"} <= set(startup)
