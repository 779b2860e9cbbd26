"""The published runs predicted after a refit on their engine's other models
(tools/published_refit.py): the figures are held against regression, and no run's own
measurement (nor its model's other runs) enters the refit that predicts it."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import published_refit as R  # noqa: E402
import published_runs as P  # noqa: E402

# Per source, leave-one-model-out after the refit, when this test was written
# (benchmarks/search/published.md, "Refitted on each engine's other models"): median absolute
# error in MFU points and Spearman. torchtitan (two models) and the playbook (one) are not
# refitted and keep the default's figures (tests/unit/test_published.py holds those).
RECORDED = {
    "kempnerforge": (2.93, 0.968),
    "llm-foundry": (1.69, 0.913),
    "megatron-lm": (2.35, 0.583),
    "all": (1.73, 0.895),
}
MEDIAN_SLACK_POINTS, SPEARMAN_SLACK = 0.3, 0.03


@pytest.fixture(scope="module")
def scored():
    return P.score_all()


@pytest.fixture(scope="module")
def refits(scored):
    return R.refit_all(scored)


@pytest.fixture(scope="module")
def stats(refits):
    return {s.group: s for s in P.statistics_table([r.scored for r in refits])}


@pytest.mark.parametrize("source", sorted(RECORDED))
def test_refitted_error_and_rank_correlation_no_worse_than_recorded(stats, source):
    median, rho = RECORDED[source]
    s = stats[source]
    assert s.median_abs_error <= median + MEDIAN_SLACK_POINTS
    assert s.spearman >= rho - SPEARMAN_SLACK


def test_issue_23_targets_the_refit_meets(stats):
    """Median absolute error <= 4 MFU points over all scored runs; rank correlation >= 0.85
    in the sources it reaches (Megatron-LM's nine runs and torchtitan's eight do not:
    benchmarks/search/README.md)."""
    assert stats["all"].median_abs_error <= 4.0
    assert stats["llm-foundry"].spearman >= 0.85 and stats["kempnerforge"].spearman >= 0.85


def test_groups_are_refitted_where_they_have_enough_models(refits):
    for r in refits:
        if r.scored.predicted is None:
            assert not r.refitted
            continue
        models = {x.scored.row.model.name for x in refits
                  if x.scored.predicted is not None and R.group_key(x.scored) == R.group_key(r.scored)}
        assert r.refitted == (len(models) >= R.MIN_MODELS), r.scored.row.label


def test_a_models_runs_never_enter_the_refit_that_predicts_them(scored):
    """Scale the measured throughput of one model's runs: their own refitted predictions do
    not move; the other models' of the group do (they were refitted on them)."""
    group = [s for s in scored if s.predicted is not None and s.row.source == "llm-foundry"
             and s.row.gpu == "h100"]
    model = "MPT-7b"

    def faster(s):
        row = dataclasses.replace(s.row, tokens_per_s=s.row.tokens_per_s * 1.3)
        return dataclasses.replace(s, row=row, measured=s.measured * 1.3)

    changed = [faster(s) if s.row.model.name == model else s for s in group]
    moved = []
    for s, before, after in zip(group, R.refit_all(group), R.refit_all(changed)):
        assert before.refitted and after.refitted
        if s.row.model.name == model:
            assert after.scored.predicted == pytest.approx(before.scored.predicted, rel=1e-9)
        else:
            moved.append(abs(after.scored.predicted / before.scored.predicted - 1) > 1e-4)
    assert any(moved)
