"""A new user's path through the real commands: train the tiny recipe on one layout, resume it on
another, export it and load it with transformers, with the same logits as dsforge's own model.

1. `dsforge run recipes/tiny.yaml` on tp2 x pp2 (4 ranks) for 4 steps, a checkpoint every 2.
2. The job is taken back to its step-2 checkpoint (`checkpoints/latest` names it, as the CK4
   fix says; step 4 removed), and `dsforge run --resume` continues it on dp2 ZeRO-3: the
   terminal names the new layout, and steps 2 and 3 have the first run's losses (so the first
   run is the straight run on the first layout, at no extra cost). It saves step 4 on the new
   layout.
3. `dsforge export RUN --to OUT` writes a Llama folder from that checkpoint; transformers loads
   it in fp32, and its logits are compared with dsforge's own model (tp1, pp1) loaded from the
   same checkpoint's layout-free state (reader.full), in a child (tests/hf_check.py).

Measured on the 2-core machine, otherwise idle: 60 s in all (train 26.5 s, resume 23 s, export
+ transformers + dsforge's model 7.6 s; mostly Python and torch starting in 4 + 2 ranks), max
|logits difference| 3.6e-7 with logits up to 1.1 (printed with -s). An MoE ep2 -> Mixtral run
of the same path (~30 s more) does not fit the suite's budget: tests/unit/test_hf_export.py
checks Mixtral's logits from a model built in one process, and tests/distributed/test_reshard.py
the MoE resume.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from dsforge.job.metrics_file import read_metrics
from tests.conftest import REPO
from tests.distributed.test_run import _job_processes, dsforge
from tests.hf_check import TOKENS, TOLERANCE, transformers_logits

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="needs transformers to load the export: pip install 'dsforge[hf]'"),
]

TINY = str(REPO / "recipes" / "tiny.yaml")
TEXT = REPO / "data" / "tempest.u16.bin"
# model.vocab_size 512: a multiple of 128 x tp for tp 1 and 2, so the padding does not change.
COMMON = ["--set", f"data.source={TEXT}", "--set", "train.steps=4",
          "--set", "train.checkpoint_every=2", "--set", "train.timing_warmup=0",
          "--set", "model.vocab_size=512", "--set", "train.lr=1.0e-2"]
TP2_PP2 = ["--set", "parallel.dp=1", "--set", "parallel.tp=2", "--set", "parallel.pp=2",
           "--set", "zero.stage=1"]
DP2_ZERO3 = ["--set", "parallel.dp=2", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
             "--set", "zero.stage=3"]


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]}


def test_train_resume_on_another_layout_export_and_load_with_transformers(tmp_path):
    timings = {}
    run, out = tmp_path / "run", tmp_path / "hf"
    start = time.monotonic()
    first = dsforge("run", TINY, *COMMON, *TP2_PP2, "--run-dir", str(run))
    timings["train tp2 x pp2"] = time.monotonic() - start
    assert first.returncode == 0, first.stderr[-3000:]
    straight = _losses(run)
    first_norms = {r["step"]: r["grad_norm"] for r in read_metrics(run / "metrics.jsonl")[0]}
    assert sorted(straight) == [0, 1, 2, 3]

    # Back to the checkpoint of step 2, then on to the end on another layout.
    root = run / "checkpoints"
    (root / "latest").write_text("step00000002")
    shutil.rmtree(root / "step00000004")
    start = time.monotonic()
    resumed = dsforge("run", TINY, *COMMON, *DP2_ZERO3, "--run-dir", str(run), "--resume")
    timings["resume dp2 ZeRO-3"] = time.monotonic() - start
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dsforge: resuming" in resumed.stderr and "after step 2" in resumed.stderr
    for change in ("parallel.tp: 2 in the checkpoint, 1 now", "parallel.pp: 2 in the checkpoint, 1 now",
                   "zero.stage: 1 in the checkpoint, 3 now"):
        assert f"new layout: {change}" in resumed.stderr, resumed.stderr[-3000:]
    assert "continuing step00000002 on a new layout" in resumed.stderr
    # metrics.jsonl is cut back to the checkpoint's step on resume: steps 2-3 are the resumed ones.
    records = read_metrics(run / "metrics.jsonl")[0]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records[2:]:  # the same function on another layout: reduction-order noise only
        assert record["loss"] == pytest.approx(straight[record["step"]], abs=1e-5), record
        assert record["grad_norm"] == pytest.approx(first_norms[record["step"]], rel=1e-4), record
    assert (root / "latest").read_text().strip() == "step00000004"
    checkpoint = root / "step00000004"
    assert json.loads((checkpoint / "dsforge_complete.json").read_text())["recipe"]["zero"]["stage"] == 3
    assert not _job_processes(run)

    # dsforge's own model from the layout-free state, in a child, while this process exports.
    start = time.monotonic()
    own = subprocess.Popen([sys.executable, "-m", "tests.hf_check", str(checkpoint),
                            str(tmp_path / "own.pt")], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        exported = dsforge("export", str(run), "--to", str(out), timeout=120)
        assert exported.returncode == 0, exported.stderr[-3000:]
        assert "exported step 4" in exported.stdout and "as llama (float32" in exported.stdout
        model, hf_logits = transformers_logits(out)
        _, stderr = own.communicate(timeout=180)
    finally:
        if own.poll() is None:
            own.kill()
            own.wait()
    timings["export + transformers + dsforge's model"] = time.monotonic() - start
    assert own.returncode == 0, stderr[-3000:]
    saved = torch.load(tmp_path / "own.pt", weights_only=True)
    assert model.config.vocab_size == 512 and model.config.num_hidden_layers == 4
    difference = (hf_logits - saved["logits"][..., :512]).abs().max().item()
    print(f"max |logits difference| {difference:.3g} (max |logit| "
          f"{hf_logits.abs().max().item():.3g}); seconds: "
          + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    assert difference <= TOLERANCE
    assert len(TOKENS) == hf_logits.shape[0]
