"""`dsforge plan --search --measure`: the top layouts of a tiny model run as short bench trials
on CPU ranks, are re-ranked by measured step time, a second run reuses finished trials, and
the trials refit a profile of this machine that predicts a layout it did not measure."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest

from tests.conftest import REPO
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
        before, after = (abs(trial[k] / trial["measured_s"] - 1) for k in ("before_s", "after_s"))
        assert after < before
    with_profile = ("plan", "--search", "tiny", "--gpus", "2", "--gpu", "h100", "--seq-len", "128",
                    "--global-batch-tokens", str(8 * 128), "--profile", str(out / "profile.yaml"))
    searched = dsforge(*with_profile, "--json", timeout=120)
    assert searched.returncode == 0, searched.stderr[-3000:]
    assert json.loads(searched.stdout)["profile"]["measured_runs"] == 2
    text = dsforge(*with_profile, timeout=120).stdout  # two trials: no band of their own
    assert "from 2 trial(s), the band not: --measure --top 3 refits it" in text


# A tiny model wide enough that a CPU step takes ~0.3 s: the trials' medians are then steady
# to a few percent on a 2-core machine.
WIDER = ("--set", "model.hidden_size=256", "--set", "model.ffn_hidden_size=704",
         "--set", "train.seq_len=256")
ONE_RANK = ("--world-size", "1", "--set", "parallel.dp=1")


# Each layout is measured once a round, the three in turn, and its fastest trial kept: other
# work on a shared 2-core machine only slows a trial down, and a burst of it seldom hits one
# layout in every round. The model is judged by how the three relate, so a load that slows
# every trial alike cancels out of the refit's prediction.
ROUNDS = 2


@pytest.mark.timeout(600)
def test_two_measured_layouts_predict_a_third_within_10_percent(tmp_path):
    """Issue 23's CPU loop. `dsforge calibrate` measures this CPU's GEMMs and optimizer step;
    --measure's own functions run three layouts of the search (ZeRO-0 at micro-batch 1, 8 and
    4) in ROUNDS rounds; the fastest trials of micro-batch 1 and 8 refit that profile, and
    micro-batch 4's fastest, which the refit did not see, is within 10% of its prediction.
    The layouts are chosen, not the search's first two: those tie on this CPU and differ by
    one microbatch count, where a 2-core machine's run-to-run noise (5-8% a process) would
    decide an extrapolation."""
    from dsforge.bench.study import Measure
    from dsforge.cost.profile import load_profile
    from dsforge.cost.step_time import step_time
    from dsforge.search.command import SearchRequest, base_recipe, search_space
    from dsforge.search.measure import measure_top, refit_from_trials
    from dsforge.search.search import search

    calibrated = tmp_path / "cpu.yaml"
    done = dsforge("calibrate", "recipes/tiny.yaml", *WIDER, *ONE_RANK, "--reps", "3",
                   "--out", str(calibrated), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    request = SearchRequest(target=str(REPO / "recipes" / "tiny.yaml"), gpus=1, gpu=None,
                            global_batch_tokens=None, seq_len=None,
                            overrides=tuple(w for w in WIDER if w != "--set"))
    base = base_recipe(request)
    profile = load_profile(calibrated, None, None)
    result = search(base, search_space(base, request, profile), profile)

    def zero0(micro_batch: int):
        return next(r for r in result.ranked if r.resolved.recipe.zero.stage == 0
                    and r.resolved.layout.micro_batch == micro_batch
                    and r.resolved.recipe.train.activation_checkpointing == "none")

    def measured(candidates, out) -> list:
        trials = measure_top(base, dataclasses.replace(result, ranked=candidates), len(candidates),
                             out, Measure(), log=lambda line: None)
        assert [t.status for t in trials] == ["ok"] * len(candidates)
        return trials

    layouts = [zero0(1), zero0(8), zero0(4)]
    trials = [t for n in range(ROUNDS)
              for t in measured(layouts[n:] + layouts[:n], tmp_path / f"round{n}")]
    fastest = {mb: min((t for t in trials if t.candidate.resolved.layout.micro_batch == mb),
                       key=lambda t: t.measured_step_s) for mb in (1, 8, 4)}
    two = [fastest[1], fastest[8]]
    refit = refit_from_trials(base, dataclasses.replace(result, ranked=[t.candidate for t in two]),
                              two, tmp_path)
    assert refit.calibration.coefficients["fixed"] > 0  # micro-batch 1 pays 8x the fixed costs
    predicted = step_time(fastest[4].candidate.resolved, refit.calibration.after).total
    seconds = {mb: [t.measured_step_s for t in trials
                    if t.candidate.resolved.layout.micro_batch == mb] for mb in (1, 8, 4)}
    assert abs(predicted / fastest[4].measured_step_s - 1) < 0.10, (predicted, seconds)
