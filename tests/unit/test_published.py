"""The published-measurement comparison (tools/published_runs.py, tools/published_compare.py):
its figures are held against regression, every row is scored or says why, and the measured
MFU is dsforge's formula applied to the published tokens/s."""

from __future__ import annotations

import dataclasses
import statistics
import sys

import pytest

from dsforge.problems import RecipeError
from tests.conftest import REPO, load_tool

# The comparison's data and scoring are tools, not the product: imported from tools/ as
# tools/published_compare.py imports them (its own folder on sys.path).
sys.path.insert(0, str(REPO / "tools"))
import published_runs as P  # noqa: E402

# Per source, the figures when this test was written (benchmarks/search/published.md,
# "after", at 82638d8's step-time model; KempnerForge and "all" since ZeRO-3 under a pipeline
# is charged without overlap, as its prefetch cannot work there: 3.37 -> 3.08, 5.93 -> 5.92): median absolute error in MFU points and Spearman
# rank correlation. A change to the step-time model may improve them; it may not make them
# worse than this plus the slack. The cost audit (82638d8) charges what dsforge's own stack does:
# DeepSpeed ZeRO 0-2 reduce gradients on the compute stream (overlap_comm is on at stage 3
# only) and Megatron-Core's TP backward collectives hide only behind their GEMMs. That brought
# KempnerForge, LLM-Foundry, the Playbook and "all" closer, and moved Megatron-LM further away
# (median 8.24 -> 10.57, Spearman 0.13 -> 0.03): Megatron-LM's runs overlap the data-parallel
# reduction and the TP traffic (distributed optimizer, tp-comm-overlap with Transformer
# Engine), so they are faster than a model of dsforge's stack says. That is a real difference
# between the implementations, not an error to tune the model towards.
# Rails (a ring collective across nodes drives one NIC per rank of its group in each node,
# cost.ring_bandwidth) moved every source but one closer (KempnerForge 3.08 -> 2.59,
# LLM-Foundry 5.94 -> 5.46, Megatron-LM 10.57 -> 8.35, "all" 5.92 -> 5.09) and torchtitan
# further (3.26 -> 7.12, Spearman 0.73 -> 0.63; LLM-Foundry's 0.35 -> 0.31): torchtitan's GPUs
# (500 W) run below the SXM peak at every scale, and the old model matched its 128-GPU runs only
# by charging their traffic 8x. The runs measured on one node and on several say which model is
# right (test_scaling_out_across_nodes_costs_what_was_measured): a gap of 0.040 against 0.199.
# torchtitan's per-op selective checkpointing, charged the matmuls it recomputes
# (P.per_op_sac_flops; dsforge's selective recomputes none) moved torchtitan 7.12 -> 4.43
# (Spearman 0.63 -> 0.83) and "all"'s Spearman 0.423 -> 0.431.
MEDIAN_SLACK_POINTS = 0.5
SPEARMAN_SLACK = 0.05
RECORDED = {  # source: (median absolute error, Spearman)
    "kempnerforge": (2.59, 0.983),
    "llm-foundry": (5.46, 0.313),
    "megatron-lm": (8.35, 0.050),
    "torchtitan": (4.43, 0.830),
    "playbook": (1.37, None),  # one row: no rank correlation
    "all": (5.09, 0.431),
}


@pytest.fixture(scope="module")
def scored():
    return P.score_all()


@pytest.fixture(scope="module")
def stats(scored):
    return {s.group: s for s in P.statistics_table(scored)}


@pytest.mark.parametrize("source", sorted(RECORDED))
def test_error_and_rank_correlation_no_worse_than_recorded(stats, source):
    median, rho = RECORDED[source]
    s = stats[source]
    assert s.scored > 0
    assert s.median_abs_error <= median + MEDIAN_SLACK_POINTS, (
        f"{source}: median |error| {s.median_abs_error:.2f} points > recorded {median} + {MEDIAN_SLACK_POINTS}")
    if rho is not None:
        assert s.spearman >= rho - SPEARMAN_SLACK, f"{source}: Spearman {s.spearman:.3f} < recorded {rho} - slack"


def test_scaling_out_across_nodes_costs_what_was_measured(scored):
    """The runs measured on one node and again on 2-64 nodes with the same per-GPU layout
    (LLM-Foundry's MPT, 18 pairs): the share of the one-node MFU each kept, predicted within
    0.06 on average and 0.15 at worst (0.040 and 0.104 when written; with one NIC's bandwidth
    for a whole data-parallel group, as before rails, 0.199, and MPT-13b kept 43% of its MFU
    where it measured 100%)."""
    pairs = P.scale_out_pairs(scored)
    gaps = [abs(p.predicted_ratio - p.measured_ratio) for p in pairs]
    assert len(pairs) >= 15
    assert statistics.fmean(gaps) < 0.06 and max(gaps) < 0.15


# Published runs the fit refuses (each trained): 23 of 248 scored, all with the estimate inside
# the GPU's memory but over the search's 10% headroom (LLM-Foundry runs at 90-97% of it), or
# above the GPU with the source's smaller memory named in the row. Was 40 before the fp32
# gradient of the optimizer step stopped being counted at the backward's peak.
RECORDED_FIT_REJECTS = 23


def test_the_planners_pick_among_published_layouts_gives_up_under_a_point(scored):
    """Issue 23: in each scenario that measured several layouts, the one dsforge predicts
    fastest measured within a median of 1 MFU point of the best (0.0 when this was written,
    over 7 scenarios; benchmarks/search/published.md "First choices")."""
    choices = P.first_choices(scored)
    assert len(choices) >= 7
    assert statistics.median(c.regret for c in choices) < 1.0


def test_first_choice_regret_by_hand(scored):
    base = next(s for s in scored if s.row.source == "kempnerforge" and s.predicted is not None)

    def run(tp, predicted, measured, label):
        row = dataclasses.replace(base.row, tp=tp, dp=base.row.gpus // tp, label=label)
        return dataclasses.replace(base, row=row, predicted=predicted, measured=measured)

    wide = run(1, 0.50, 0.40, "dp")  # predicted fastest, measured slower
    deep = run(2, 0.45, 0.48, "tp2")
    again = run(2, 0.45, 0.47, "tp2 again")  # the same layout measured twice: one layout
    [choice] = P.first_choices([wide, deep, again])
    assert choice.pick is wide and choice.best is deep and choice.layouts == 2
    assert choice.regret == pytest.approx(8.0)
    assert P.first_choices([deep, again]) == []  # one layout: nothing to choose


def test_the_memory_fit_refuses_no_more_published_runs_than_recorded(stats):
    assert stats["all"].rejected_by_fit <= RECORDED_FIT_REJECTS


def test_every_published_run_estimated_over_its_gpu_has_a_named_reason(scored, stats):
    """Every row trained, so an estimate above the GPU's whole memory is an error of the memory
    model unless the source's engine is known to need less (the row's memory_note)."""
    unexplained = [s.row.label for s in scored if s.over_gpu and not s.row.memory_note]
    assert not unexplained and stats["all"].over_gpu_unexplained == 0, unexplained


def test_search_band_is_the_comparisons_median_relative_error(stats):
    """`dsforge plan --search` puts a band of +-PREDICTION_ERROR on every predicted step time
    (profile.py keeps a copy so a search need not score 279 runs). It must be the comparison's
    median |predicted / measured - 1| over all scored runs, to the rounding it is written with;
    a change to the step-time model that moves the error must move the band with it."""
    from dsforge.cost.profile import PREDICTION_ERROR, ClusterProfile

    computed = stats["all"].median_relative_error
    assert PREDICTION_ERROR == pytest.approx(computed, abs=0.0005), (
        f"the comparison's median relative error is now {computed:.4f}: set profile.PREDICTION_ERROR "
        f"to {computed:.3f} and say so in docs/search.md ('Ties')")
    assert ClusterProfile.__dataclass_fields__["prediction_error"].default == PREDICTION_ERROR


def test_median_relative_error_by_hand():
    rows = [P.Scored(P.ROWS[0], measured=m, predicted=p, fits=True, memory_gib=1, usable_gib=2)
            for m, p in ((0.50, 0.55), (0.40, 0.30), (0.20, 0.21))]
    # |0.55/0.50 - 1| = 0.10, |0.30/0.40 - 1| = 0.25, |0.21/0.20 - 1| = 0.05: median 0.10
    assert P.stats_for("x", rows).median_relative_error == pytest.approx(0.10)


def test_every_source_is_present_and_rows_are_not_dropped(scored):
    assert {r.source for r in P.ROWS} == set(P.SOURCES)
    assert len(scored) == len(P.ROWS)
    counts = {source: len(P.with_source(P.ROWS, source)) for source in P.SOURCES}
    assert counts == {"kempnerforge": 21, "llm-foundry": 216, "megatron-lm": 9, "torchtitan": 32, "playbook": 1}


def test_each_row_is_scored_exactly_or_says_why(scored):
    for s in scored:
        if s.predicted is None:
            assert s.reason, f"{s.row.label}: not scored and no reason"
            continue
        assert 0 < s.predicted < 1 and s.fits is not None
        if s.scored_as:  # the nearest accepted layout: say so, and the published one really is refused
            if "ZeRO-2" in s.scored_as:
                with pytest.raises(RecipeError):
                    P.predict(s.row)
            continue
        # Scored as published: the exact layout passes the validator and gives the same figure.
        assert P.predict(s.row).mfu == pytest.approx(s.predicted)
    assert all(s.reason for s in scored if s.row.unscorable)


def test_refused_layouts_fall_back_to_zero2_and_say_so():
    """ZeRO-3 with a pipeline (rule Z2, where the validator refuses it) is scored as ZeRO-2."""
    row = next(r for r in P.KEMPNERFORGE if r.label == "70b_32gpu_tp4_pp4")
    assert (row.zero, row.pp) == (3, 4)
    s = P.score(row)
    assert s.predicted is not None
    try:
        P.predict(row)
    except RecipeError:
        assert "ZeRO-2" in s.scored_as
    else:  # the validator accepts it: scored exactly, no fallback claimed
        assert s.scored_as == ""


def _llama3_8b_flops_per_token(seq: int) -> float:
    h, kv, ffn, layers, vocab, heads, head_dim = 4096, 1024, 14336, 32, 128256, 32, 128
    matmul = layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + vocab * h
    return 6 * matmul + 12 * layers * seq * heads * head_dim


def test_measured_mfu_by_hand_kempnerforge_single_gpu():
    """KempnerForge #1: 10,471 tok/s on one H200, Llama-3 8B, seq 4096. By hand: 54.5%, not the
    57.8% the report states (its formula differs)."""
    row = next(r for r in P.KEMPNERFORGE if r.label == "#1 7B single GPU")
    expected = 10471 * _llama3_8b_flops_per_token(4096) / 989e12
    assert expected == pytest.approx(0.54494, abs=1e-4)
    assert row.measured_mfu == pytest.approx(expected, rel=1e-9)
    assert row.published_mfu - row.measured_mfu > 0.03


def test_measured_mfu_by_hand_mpt_7b():
    """LLM-Foundry MPT-7B, seq 2048, 8 H100: 85,144 tok/s. MPT's GELU MLP (8 h^2) is written as
    SwiGLU of ffn 10920 (3 h ffn), tied embeddings, vocab 50368. By hand: 46.39% (published 46.44)."""
    row = next(r for r in P.LLM_FOUNDRY if r.label == "MPT-7b seq 2048" and r.gpus == 8 and r.gpu == "h100")
    h, layers, vocab, ffn = 4096, 32, 50368, 10920
    matmul = layers * (4 * h * h + 3 * h * ffn) + vocab * h
    per_token = 6 * matmul + 12 * layers * 2048 * h
    expected = 85144 * per_token / (8 * 989e12)
    assert expected == pytest.approx(0.46389, abs=1e-4)
    assert row.measured_mfu == pytest.approx(expected, rel=1e-9)
    assert row.measured_mfu == pytest.approx(row.published_mfu, abs=0.001)


def test_megatron_tokens_from_published_tflops():
    """Megatron's table gives TFLOP/s per GPU; its formula (12 L h^2 (6 + s/h) + 6 h V per token
    for GPT) turns it back into tokens/s, and dsforge's MFU then matches the published 47%."""
    row = next(r for r in P.MEGATRON_LM if r.label == "GPT 7.1B")
    per_token = 12 * 30 * 4096**2 * (6 + 4096 / 4096) + 6 * 4096 * 131072
    assert row.tokens_per_s == pytest.approx(465.9e12 / per_token * 96)
    assert row.measured_mfu == pytest.approx(0.471, abs=0.002)


def test_per_op_sac_recompute_by_hand():
    """torchtitan's per-op policy recomputes a Llama layer's 2nd, 4th and 6th matmul (wk, wo,
    w3): for llama3-8b, 2 x 32 layers x 4096 x (1,024 + 4,096 + 14,336) FLOPs a token, 36.5%
    of the layers' matmul forward. Only the rows that ran it are charged, and only in compute."""
    model = P.LLAMA3_8B.config(8192)
    assert P.per_op_sac_flops(model) == 2 * 32 * 4096 * (1024 + 4096 + 14336)
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert P.per_op_sac_flops(model) / (2 * 32 * layer) == pytest.approx(0.365, abs=0.001)
    charged = [r for r in P.ROWS if r.per_op_sac]
    assert charged and all(r.source == "torchtitan" and r.checkpointing == "selective" for r in charged)
    row = charged[0]
    plain = P.predict(dataclasses.replace(row, per_op_sac=False))
    sac = P.predict(row)
    hardware = P.flops_per_token(model, 8192, "selective").hardware
    assert sac.time.compute == pytest.approx(plain.time.compute * (1 + P.per_op_sac_flops(model) / hardware))
    assert sac.time.total - plain.time.total == pytest.approx(sac.time.compute - plain.time.compute)
    assert sac.mfu == pytest.approx(plain.mfu * plain.time.total / sac.time.total)


def test_spearman_by_hand():
    assert P.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert P.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): cov 4.5, norms sqrt(4.5 x 5)
    assert P.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert P.spearman([1, 2], [2, 1]) is None


def test_tool_writes_sections_and_keeps_the_other(tmp_path):
    tool = load_tool("published_compare")
    out = tmp_path / "published.md"
    out.write_text(tool.merge("", "before", "## before\n\nold figures"))
    tool.main(["--out", str(out), "--stats-only"])
    text = out.read_text()
    assert text.startswith(tool.HEADER)
    assert "old figures" in text and "## after" in text
    assert text.index("## before") < text.index("## after")
    assert "| kempnerforge | 21 | 21 |" in text
