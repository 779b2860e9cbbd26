"""`dsforge plan --search --measure`: the top layouts of a tiny model run as short bench trials
on CPU ranks, are re-ranked by measured step time, a second run reuses finished trials, and
the trials refit a profile of this machine that predicts a layout it did not measure."""

from __future__ import annotations

import json
import sqlite3

import pytest

from tests.distributed.test_run import dsforge


@pytest.mark.timeout(400)
def test_measure_runs_and_reranks_the_top_layouts(tmp_path):
    out = tmp_path / "trials"
    args = ("plan", "--search", "tiny", "--gpus", "2", "--gpu", "h100", "--seq-len", "128",
            "--global-batch-tokens", str(8 * 128), "--top", "2", "--measure", "--measure-out", str(out),
            "--json")
    first = dsforge(*args, timeout=360)
    assert first.returncode == 0, first.stderr[-3000:]
    measured = json.loads(first.stdout)["measured"]
    assert sorted(t["predicted_rank"] for t in measured) == [1, 2]
    assert all(t["status"] == "ok" and t["measured_step_s"] > 0 for t in measured)
    steps = [t["measured_step_s"] for t in measured]
    assert steps == sorted(steps)  # re-ranked by what was measured
    with sqlite3.connect(out / "results.db") as con:
        assert con.execute("SELECT COUNT(*) FROM results WHERE status='ok'").fetchone()[0] == 2
    again = dsforge(*args, timeout=120)
    assert again.returncode == 0 and "trial 1/2" not in again.stderr  # finished trials are reused
    assert json.loads(again.stdout)["measured"] == measured
    refit = json.loads(first.stdout)["refit"]
    assert refit["profile"] == str(out / "profile.yaml") and refit["measured_on"].startswith("cpu")
    for trial in refit["trials"]:  # in-sample, two trials: the refit predicts them far closer
        assert abs(trial["after_s"] / trial["measured_s"] - 1) < abs(trial["before_s"] / trial["measured_s"] - 1)
    searched = dsforge("plan", "--search", "tiny", "--gpus", "2", "--gpu", "h100", "--seq-len", "128",
                       "--global-batch-tokens", str(8 * 128), "--profile", str(out / "profile.yaml"),
                       "--json", timeout=120)
    assert searched.returncode == 0, searched.stderr[-3000:]
    assert json.loads(searched.stdout)["profile"]["measured_runs"] == 2


# A tiny model wide enough that a CPU step takes ~0.3 s: the trials' medians are then steady
# to a few percent on a 2-core machine.
WIDER = ("--set", "model.hidden_size=256", "--set", "model.ffn_hidden_size=704",
         "--set", "train.seq_len=256")


@pytest.mark.timeout(400)
def test_two_measured_layouts_predict_a_third_within_10_percent(tmp_path):
    """Issue 23's CPU loop: --measure on two layouts refits a CPU profile; the third layout
    of the same search, measured afterwards, is within 10% of that profile's prediction."""
    out = tmp_path / "trials"
    search = ("plan", "--search", "recipes/tiny.yaml", *WIDER, "--gpus", "1", "--json")
    first = dsforge(*search, "--top", "2", "--measure", "--measure-out", str(out), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    profile = tmp_path / "two.yaml"
    profile.write_text((out / "profile.yaml").read_text())
    ranked = dsforge(*search, "--top", "3", timeout=120)  # the default profile's order
    third = json.loads(ranked.stdout)["candidates"][2]["layout"]
    predicted = dsforge(*search, "--top", "60", "--profile", str(profile), timeout=120)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    prediction = next(c["step_time_s"]["total"] for c in json.loads(predicted.stdout)["candidates"]
                      if c["layout"] == third)
    measured = dsforge(*search, "--top", "3", "--measure", "--measure-out", str(out), timeout=300)
    assert measured.returncode == 0, measured.stderr[-3000:]
    trial = next(t for t in json.loads(measured.stdout)["measured"] if t["predicted_rank"] == 3)
    assert trial["status"] == "ok"
    assert abs(prediction / trial["measured_step_s"] - 1) < 0.10, (prediction, trial)
