"""A new user's path with their own corpus, through the commands: prepare two datasets with a
Hugging Face tokenizer, blend them 70/30 with a 98/1/1 split, train with validation every N
steps and TensorBoard, run again and find the dataset indices in the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsforge.job.metrics_file import read_metrics
from dsforge.recipe import load_recipe
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(400)

TINY = str(REPO / "recipes" / "tiny.yaml")


def dsforge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsforge", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=dict(os.environ))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, bpe_tokenizer):
    """Two JSON-lines corpora (The Tempest's first and second half, by speech), each prepared
    with the BPE tokenizer.json; returns the recipe overrides that blend them."""
    root = tmp_path_factory.mktemp("corpus")
    speeches = (REPO / "data" / "tempest.jsonl").read_text().splitlines()
    half = len(speeches) // 2
    for name, lines in (("first", speeches[:half]), ("second", speeches[half:])):
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        result = dsforge("data", "prepare", str(root / f"{name}.jsonl"), "--tokenizer",
                         str(bpe_tokenizer), "--output", str(root / name), "--workers", "1")
        assert result.returncode == 0, result.stderr[-2000:]
    return root, [
        "--set", f"data.source=[{{path: {root / 'first'}, weight: 0.7}}, "
                 f"{{path: {root / 'second'}, weight: 0.3}}]",
        "--set", "data.split=98,1,1", "--set", f"data.tokenizer={bpe_tokenizer}",
        "--set", f"data.cache_dir={root / 'cache'}", "--set", "model.vocab_size=512",
        "--set", "train.eval_every=3", "--set", "train.eval_iters=1", "--set", "train.steps=6",
        "--set", "train.timing_warmup=1", "--set", "tracking.tensorboard=true"]


def test_a_blend_trains_with_validation_and_tensorboard_and_reuses_its_indices(corpus, tmp_path):
    root, overrides = corpus
    first = dsforge("run", TINY, *overrides, "--run-dir", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "indices built" in first.stderr and "2 datasets" in first.stderr
    steps, evals = read_metrics(tmp_path / "first" / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(6))
    assert [r["step"] for r in evals] == [2, 5]
    assert all(r["data_time_s"] < r["step_time_s"] for r in steps)
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    assert "validation loss" in first.stderr  # the summary line
    # The last step's progress line once, with the validation loss measured after it.
    last = [line for line in first.stderr.splitlines() if "step 6/6" in line]
    assert len(last) == 1 and f"val {evals[-1]['val_loss']:.4f}" in last[0], last

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "first" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [2, 5]
    assert [e.value for e in events.Scalars("val/loss")] == \
        pytest.approx([r["val_loss"] for r in evals])
    assert len(events.Scalars("train/loss")) == 6

    cached = {p.name: p.stat().st_mtime_ns for p in (root / "cache").iterdir()}
    again = dsforge("run", TINY, *overrides, "--run-dir", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "indices read from the cache" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (root / "cache").iterdir()} == cached
    # Same data, seed and layout: the same run.
    assert read_metrics(tmp_path / "again" / "metrics.jsonl")[1] == evals


def test_the_smoke_recipe_reports_a_falling_held_out_loss(tmp_path):
    """The README's main job, shortened: the shipped indexed Tempest, 5% of the speeches held
    out, evaluated twice."""
    run_dir = tmp_path / "smoke"
    result = dsforge("run", str(REPO / "recipes" / "smoke.yaml"), "--set", "train.steps=40",
                     "--set", "train.eval_every=20", "--set", f"data.cache_dir={tmp_path / 'cache'}",
                     "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in evals] == [19, 39]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < steps[0]["loss"]
    # The warmup, as the ranks ran it: step k at k / warmup_steps of the peak (one step at 0).
    train = load_recipe(REPO / "recipes" / "smoke.yaml").train
    assert [r["lr"] for r in steps[:3]] == pytest.approx([0.0, train.lr / train.warmup_steps,
                                                          2 * train.lr / train.warmup_steps])
