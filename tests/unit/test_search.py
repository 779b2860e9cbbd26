"""`dsforge plan --search`: the space, the three steps, the step-time model, the reasons,
the written recipe, the CLI, and the published orderings (tools/search_anchors.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from dsforge.cli import main
from dsforge.cost.profile import ClusterProfile, ProfileFile, default_profile, load_profile
from dsforge.cost.step_time import gemm_saturation, step_time
from dsforge.estimate.flops import flops_per_token
from dsforge.problems import RecipeError
from dsforge.recipe import load_recipe, resolve, resolve_file
from dsforge.recipe.loader import build_recipe
from dsforge.search.command import SearchRequest, base_recipe, render, search_space, write_recipe
from dsforge.search.explain import reason
from dsforge.search.search import evaluate, search
from dsforge.search.space import Candidate, Space
from tests.conftest import REPO, load_tool


def _base(preset="llama2-7b", seq_len=4096):
    return build_recipe({"name": "s", "model": {"preset": preset},
                         "train": {"seq_len": seq_len, "steps": 10, "lr": 3e-4, "precision": "bf16"}})


def _search(preset="llama2-7b", gpus=8, gpu="h100", global_batch=64):
    return search(_base(preset), Space(gpus=gpus, gpus_per_node=8, global_batch=global_batch, gpu=gpu),
                  default_profile(gpu))


def _ranked(recipe, gpus, profile):
    resolved = resolve(recipe, Space(gpus=gpus, gpus_per_node=8, global_batch=0).topology())
    return evaluate(Candidate(resolved=resolved, exact_batch=True), profile)


def test_every_ranked_layout_is_valid_fits_and_is_sorted():
    result = _search()
    assert result.considered > result.valid > result.fit >= len(result.ranked) > 0
    usable = result.profile.usable_memory_bytes
    tied = [r for r in result.ranked if r.tied]
    rest = result.ranked[len(tied):]
    assert all(r.tied for r in result.ranked[:len(tied)])  # the tied layouts come first
    assert [r.time.total for r in rest] == sorted(r.time.total for r in rest)
    for r in result.ranked:
        assert r.memory.total <= usable and r.exact_batch
        assert r.resolved.layout.global_batch == 64
        resolve(r.resolved.recipe, r.resolved.topology)  # still passes the validator


def test_search_covers_the_axes():
    result = _search(preset="mixtral-8x7b", gpus=16, global_batch=128)
    rows = [(r.resolved.layout, r.resolved.recipe) for r in result.ranked]
    assert {lay.tp for lay, _ in rows} >= {1, 2, 4, 8}
    assert {lay.ep for lay, _ in rows} >= {1, 2, 4, 8}
    assert {lay.vpp for lay, _ in rows} >= {1, 2}
    assert {rec.zero.stage for _, rec in rows} == {0, 1, 2, 3}
    assert {rec.train.activation_checkpointing for _, rec in rows} == {"none", "selective", "full"}
    assert {lay.sequence_parallel for lay, _ in rows} == {False, True}


def _fastest(result):
    return min(result.ranked, key=lambda r: r.time.total)


def test_context_parallelism_is_searched_and_pays_only_for_long_sequences():
    """Llama-3 8B on 8 H100s: at 32k tokens a layout without context parallelism fits without
    recomputation only at tp 4 or more (narrower GEMMs, a tensor-parallel all-reduce per
    layer), and the fastest predicted splits the sequence (cp 4, 14% faster than cp 1's best).
    cp goes with pipelines too, and the search's recipe carries it. At 4k tokens the axis is
    not searched (CP_MIN_SEQ_LEN), and where it is anyway, the fastest has cp 1."""
    space = Space(gpus=8, gpus_per_node=8, global_batch=8, gpu="h100")
    base = _base("llama3-8b", seq_len=32768)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, max_seq_len=32768))
    long = search(base, space, default_profile("h100"))
    assert _fastest(long).resolved.layout.cp > 1
    assert not any(r.resolved.layout.cp == 1 and r.resolved.layout.tp < 4 and
                   r.resolved.recipe.train.activation_checkpointing == "none" for r in long.ranked)
    assert any(r.resolved.layout.pp > 1 for r in long.ranked if r.resolved.layout.cp > 1)
    cp = next(r for r in long.ranked if r.resolved.layout.cp > 1)
    assert cp.resolved.recipe.parallel.cp == cp.layout_row()["cp"] == cp.resolved.layout.cp
    assert f" cp{cp.resolved.layout.cp} " in cp.shape() and "cp" in cp.parallel_dimensions()
    header = next(line for line in render(long, 5, "8b").splitlines() if line.lstrip().startswith("#"))
    assert header.split()[:4] == ["#", "tp", "cp", "pp"]
    # Below CP_MIN_SEQ_LEN the axis is not searched; searched anyway at 4k tokens, cp buys
    # nothing and the fastest has cp 1.
    short_space = dataclasses.replace(space, global_batch=64)
    assert {r.resolved.layout.cp for r in search(_base("llama3-8b"), short_space,
                                                 default_profile("h100")).ranked} == {1}
    short = search(_base("llama3-8b"), dataclasses.replace(short_space, cp_min_seq_len=0),
                   default_profile("h100"))
    assert {r.resolved.layout.cp for r in short.ranked} >= {1, 2, 4, 8}
    assert _fastest(short).resolved.layout.cp == 1


def test_nothing_fits_names_the_smallest():
    result = _search(preset="llama3-70b", gpus=2, gpu="a100-40gb", global_batch=8)
    assert result.fit == 0 and not result.ranked
    assert result.nearest_memory.memory.total > result.profile.usable_memory_bytes


def test_nothing_fits_says_which_headroom_admits_the_smallest_when_the_gpu_holds_it():
    """8B on one H200: ZeRO-3 with full recomputation needs 127.0 GiB, inside the GPU's 140.4
    but over the 10% headroom; the text names the flag value that admits it, and it does."""
    runner = CliRunner()
    args = ["plan", "--search", "llama3-8b", "--gpus", "1", "--gpu", "h200"]
    refused = runner.invoke(main, args)
    assert "no layout fits" in refused.output
    assert "--memory-headroom 0.09 admits it" in refused.output, refused.output
    admitted = runner.invoke(main, [*args, "--memory-headroom", "0.09", "--json"])
    assert admitted.exit_code == 0 and json.loads(admitted.output)["candidates"]
    # 70B on two 40 GB GPUs does not fit even without headroom: no such hint
    too_big = runner.invoke(main, ["plan", "--search", "llama3-70b", "--gpus", "2", "--gpu", "a100-40gb"])
    assert "no layout fits" in too_big.output and "--memory-headroom" not in too_big.output


def test_unreachable_batch_keeps_the_nearest():
    # tiny: at most tp 4 x pp 4, so 32 GPUs always have dp >= 2 and 13 sequences never divide
    result = search(_base("tiny", seq_len=128), Space(gpus=32, gpus_per_node=8, global_batch=13),
                    default_profile("h100"))
    assert result.ranked and not result.batch_exact
    assert {r.resolved.layout.global_batch for r in result.ranked} <= {12, 14}
    exact = search(_base("tiny", seq_len=128), Space(gpus=32, gpus_per_node=8, global_batch=16),
                   default_profile("h100"))
    assert exact.batch_exact and {r.resolved.layout.global_batch for r in exact.ranked} == {16}


def test_step_time_by_hand_on_one_gpu():
    profile = default_profile("h100")
    r = _ranked(dataclasses.replace(_base(), train=dataclasses.replace(
        _base().train, global_batch=4, micro_batch=2)), 1, profile)
    m = r.resolved.recipe.model
    tokens = 4 * 4096
    efficiency = 0.60 * gemm_saturation(m.hidden_size) * gemm_saturation(2 * 4096)
    expected = tokens * flops_per_token(m, 4096).hardware / (989e12 * efficiency)
    assert r.time.compute == pytest.approx(expected)
    assert r.time.tp_comm == r.time.dp_comm == r.time.bubble == r.time.pp_comm == 0
    assert r.mfu == pytest.approx(tokens / r.time.total * flops_per_token(m, 4096).model / 989e12)


def _layout(base, gpus, **changes):
    parallel = {k: v for k, v in changes.items() if k in ("tp", "pp", "vpp", "sequence_parallel")}
    train = {k: v for k, v in changes.items() if k in ("micro_batch", "global_batch", "activation_checkpointing")}
    recipe = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **parallel),
                                 zero=dataclasses.replace(base.zero, stage=changes.get("zero", 1)),
                                 train=dataclasses.replace(base.train, **train))
    return _ranked(recipe, gpus, default_profile("h100"))


def test_zero_traffic_per_stage():
    base = _base()
    times = {z: _layout(base, 8, zero=z, micro_batch=1, global_batch=32).time.dp_comm for z in range(4)}
    m = 32 // 8  # microbatches per step
    assert times[0] == pytest.approx(times[1])
    assert times[2] == pytest.approx(times[1] * (m + 1) / 2)
    # Only ZeRO-3 overlaps (DeepSpeed's overlap_comm is on at stage 3 only): dp_overlap of it
    # is hidden, bounded by the compute it runs beside.
    overlap = default_profile("h100").dp_overlap
    assert times[3] == pytest.approx(times[1] * 3 * m / 2 * (1 - overlap))


def test_bubble_follows_the_schedule():
    base = _base()
    plain = _layout(base, 4, pp=4, micro_batch=1, global_batch=8)
    interleaved = _layout(base, 4, pp=4, vpp=2, micro_batch=1, global_batch=8)
    # The blocking sends are part of every pipeline slot, so they fill and drain too.
    work = plain.time.compute + plain.time.tp_comm
    assert plain.time.bubble == pytest.approx((work + plain.time.pp_comm) * 3 / 8)
    assert interleaved.time.bubble == pytest.approx((work + interleaved.time.pp_comm) * 3 / 16)
    assert interleaved.time.pp_comm > plain.time.pp_comm  # v x the sends


def test_pipeline_sends_cross_nodes_where_the_ranks_do():
    """tp2 x pp16 x dp1 with 4 GPUs per node: stages 2j and 2j+1 share a node, so every rank
    inside the pipeline has one intra- and one inter-node neighbour; with interleaving the
    wrap-around from the last stage to the first crosses nodes too (docs/search.md)."""
    from dsforge.cost.step_time import boundary_counts, pipeline_send_seconds

    assert boundary_counts(2, 16, 1, 4) == {(1, 0), (1, 1)}  # the two ends, the inner ranks
    assert boundary_counts(2, 16, 5, 4) == {(5, 5), (5, 4)}  # the ends: 4 wrap-arounds each
    assert boundary_counts(8, 4, 1, 8) == {(0, 1), (0, 2)}  # a stage fills a node: all inter
    assert boundary_counts(1, 4, 2, 8) == {(3, 0), (4, 0)}  # the whole pipeline in one node
    profile = dataclasses.replace(default_profile("h200"), gpus_per_node=4)
    lay = _layout(_base(), 32, tp=2, pp=16, vpp=2, micro_batch=1, global_batch=32).resolved.layout
    message = 1e8
    intra = message / (profile.intra_node_gbps * 1e9) + profile.p2p_latency_s
    inter = message / (profile.inter_node_gbps * 1e9) + profile.p2p_latency_s
    assert pipeline_send_seconds(lay, profile, message) == pytest.approx(2 * intra + 2 * inter)


def test_tensor_parallel_across_nodes_is_slower():
    profile = default_profile("h100")
    inside = step_time(_layout(_base(), 16, tp=8, global_batch=16).resolved, profile).tp_comm
    slow_nodes = dataclasses.replace(profile, gpus_per_node=4)  # the same tp 8 now spans 2 nodes
    across = step_time(_layout(_base(), 16, tp=8, global_batch=16).resolved, slow_nodes).tp_comm
    # Inside the node the backward all-reduces hide behind the weight-gradient GEMMs and only
    # the two forward ones per layer count; across nodes the ring runs over the 4 NICs of the
    # group's 4 ranks in each node (rails: 4 x 40 GB/s against 360), so the forward ones take
    # 2.25 x longer and the backward ones outgrow their GEMMs, partly exposed.
    ratio = profile.intra_node_gbps / (4 * profile.inter_node_gbps)
    assert inside * ratio < across < 2 * inside * ratio


def test_a_ring_across_nodes_drives_one_nic_per_rank_of_its_group_in_each_node():
    from dsforge.cost.step_time import ring_bandwidth

    profile = default_profile("h100")  # 8 a node, 360 GB/s inside, 40 GB/s a NIC
    assert ring_bandwidth(8, 8, profile) == 360e9  # one node
    assert ring_bandwidth(16, 16, profile) == 320e9  # 8 ranks a node: 8 NICs, under NVLink's 360
    assert ring_bandwidth(8, 64, profile) == 40e9  # dp 8 over tp 8: one rank, one NIC a node
    assert ring_bandwidth(16, 32, profile) == 160e9  # tp 2: 4 ranks of the group a node
    wide = dataclasses.replace(profile, inter_node_gbps=50.0)
    assert ring_bandwidth(64, 64, wide) == 360e9  # 8 x 50 would exceed the node's own


def test_reasons_name_the_difference():
    base = _base()
    z1 = _layout(base, 8, zero=1, global_batch=32)
    z3 = _layout(base, 8, zero=3, global_batch=32)
    assert "ZeRO-1" in reason(z1, z3) and "ZeRO-3 gathers parameters" in reason(z1, z3)
    none = _layout(base, 8, global_batch=32)
    full = _layout(base, 8, global_batch=32, activation_checkpointing="full")
    assert reason(none, full).startswith("recomputes less (checkpointing none vs full)")
    pp = _layout(base, 8, pp=2, vpp=2, global_batch=32)
    deep = _layout(base, 8, pp=8, global_batch=32)
    if pp.time.total < deep.time.total:
        assert "pipeline" in reason(pp, deep)


def test_written_recipe_runs_the_winner(tmp_path):
    result = _search()
    path = write_recipe(result, tmp_path / "mine.yaml")
    recipe = load_recipe(path)
    assert recipe.name == "mine"
    again = resolve(recipe, result.space.topology())
    assert again.layout == result.ranked[0].resolved.layout


def test_base_recipe_and_space_from_inputs(tmp_path):
    request = SearchRequest(target="llama3-8b", gpus=16, gpu=None, global_batch_tokens=None, seq_len=2048)
    base = base_recipe(request)
    assert base.train.seq_len == 2048
    space = search_space(base, request, default_profile("h100"))
    assert space.global_batch == 2**20 // 2048
    recipe_request = SearchRequest(target=str(REPO / "recipes" / "70b_pp4.yaml"), gpus=None, gpu=None,
                                   global_batch_tokens=None, seq_len=None)
    recipe = base_recipe(recipe_request)
    space = search_space(recipe, recipe_request, default_profile("h200"))
    assert space.gpus == recipe.cluster.world_size and space.global_batch == recipe.train.global_batch
    with pytest.raises(RecipeError, match="S2"):
        search_space(base, dataclasses.replace(request, global_batch_tokens=1000), default_profile("h100"))
    with pytest.raises(RecipeError, match='Did you mean "llama3-8b"'):
        base_recipe(dataclasses.replace(request, target="llama3-8"))


def test_profile_file_overrides_and_rejects_unknown(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("gpu: a100\ninter_node_gbps: 12.5\nmemory_margin: 0.2\n")
    profile = load_profile(path, None, 4)
    assert profile.gpu.key == "a100" and profile.inter_node_gbps == 12.5 and profile.gpus_per_node == 4
    path.write_text("inter_node_gbs: 12\n")
    with pytest.raises(RecipeError, match="inter_node_gbs"):
        load_profile(path, None, None)
    path.write_text("memory_margin: 1.5\n")
    with pytest.raises(RecipeError, match="out of range"):
        load_profile(path, None, None)
    with pytest.raises(RecipeError) as info:  # a recipe where a profile goes: one problem
        load_profile(REPO / "recipes" / "tiny.yaml", None, None)
    assert len(info.value.problems) == 1 and "a recipe, not a cluster profile" in str(info.value)


def test_profile_file_is_read_strictly(tmp_path):
    """Types, choices and ranges checked like a recipe's; every problem names the file."""
    path = tmp_path / "cluster.yaml"
    path.write_text("intra_node_gbps: fast\ninter_node_gbs: 12\n")
    with pytest.raises(RecipeError) as caught:
        load_profile(path, None, None)
    assert [p.rule for p in caught.value.problems] == ["Z6", "Y2"]
    text = str(caught.value)
    assert f"{path}: intra_node_gbps='fast': expected a number" in text and "Fix:" in text
    assert 'Did you mean "inter_node_gbps"?' in text
    path.write_text("gpu: h10\ncompute_efficiency: 1.4\ninter_node_gbps: 0\nmemory_margin: 0\n")
    with pytest.raises(RecipeError) as caught:
        load_profile(path, None, None)
    assert sorted(next(iter(p.fields)) for p in caught.value.problems) == [
        f"{path}: {name}" for name in ("compute_efficiency", "gpu", "inter_node_gbps")]
    assert 'Did you mean "h100"?' in str(caught.value)
    path.write_text("gpus_per_node: 4\ndp_overlap: 1\n")
    assert load_profile(path, "h200", None).gpus_per_node == 4
    with pytest.raises(RecipeError, match="file not found"):
        load_profile(tmp_path / "missing.yaml", None, None)


def test_profile_file_fields_are_the_profiles():
    assert ({f.name for f in dataclasses.fields(ProfileFile)}
            == {f.name for f in dataclasses.fields(ClusterProfile)})


def test_cli_bad_profile_is_a_clean_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("intra_node_gbps: fast\n")
    done = CliRunner().invoke(main, ["plan", "--search", "llama3-8b", "--gpus", "4", "--profile", str(path)])
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
    assert "llama3-8b: 1 error" in done.output and "intra_node_gbps='fast'" in done.output
    assert "Traceback" not in done.output


def test_cli_search_json_and_errors(tmp_path):
    runner = CliRunner()
    done = runner.invoke(main, ["plan", "--search", "llama2-7b", "--gpus", "8", "--gpu", "h100",
                                "--global-batch-tokens", str(64 * 4096), "--top", "3", "--json",
                                "--write", str(tmp_path / "best.yaml")])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert len(data["candidates"]) == 3 and data["counts"]["valid"] > 100
    assert data["candidates"][0]["why_above_next"]
    assert (tmp_path / "best.yaml").exists()
    text = runner.invoke(main, ["plan", "--search", "llama2-7b", "--gpus", "8"])
    assert text.exit_code == 0 and "why each beat the next:" in text.output
    unknown = runner.invoke(main, ["plan", "--search", "gpt5", "--gpus", "8"])
    assert unknown.exit_code == 2 and "MODEL_OR_RECIPE='gpt5'" in unknown.output
    misplaced = runner.invoke(main, ["plan", str(REPO / "recipes" / "tiny.yaml"), "--gpus", "8"])
    assert misplaced.exit_code == 2 and "--gpus only apply with --search" in misplaced.output
    world = runner.invoke(main, ["plan", "--search", "llama2-7b", "--world-size", "8"])
    assert world.exit_code == 2 and "--gpus N" in world.output


def _anchors():
    return load_tool("search_anchors")


def test_published_orderings_hold():
    """Where a source measured two layouts of one model on one cluster, the search predicts
    the faster one faster (benchmarks/search/anchors.md has the table and the misses)."""
    anchors = _anchors()
    pairs = 0
    for scenario in anchors.SCENARIOS:
        result = anchors.run_scenario(scenario)
        predicted = []
        for published in scenario.layouts:
            found = anchors.best_with_shape(scenario, result, published)
            assert found is not None, f"{scenario.model}: {published.name} not found"
            predicted.append(found[1].mfu)
        assert predicted == sorted(predicted, reverse=True), scenario
        pairs += max(0, len(predicted) - 1)
    assert pairs == 3


def test_zero2_with_pipelines_traffic():
    """With pp > 1, ZeRO-2 moves (m+1)/2 times ZeRO-1's bytes, none of it hidden, in m v
    reduce-scatters whose ring latency is added; interleaving splits the same bytes into v
    times as many collectives. The per-microbatch part lengthens the bubble too."""
    from dsforge.cost.step_time import dp_traffic

    for m in (1, 4, 32):
        assert sum(dp_traffic(2, m)) / sum(dp_traffic(1, m)) == pytest.approx((m + 1) / 2)
    base = _base()
    latency, d = default_profile("h100").p2p_latency_s, 4  # 8 GPUs = pp 2 x dp 4
    kw = dict(pp=2, micro_batch=1, global_batch=32)
    m = 32 // d
    zero1 = _layout(base, 8, zero=1, **kw).time
    for vpp in (1, 2):
        zero2 = _layout(base, 8, zero=2, vpp=vpp, **kw).time
        assert zero2.dp_comm == pytest.approx((m + 1) / 2 * zero1.dp_comm + m * vpp * (d - 1) * latency)
        in_slots = zero2.dp_comm - zero1.dp_comm / 2  # all but the once-per-step all-gather
        work = zero2.compute + zero2.tp_comm + zero2.ep_comm + zero2.pp_comm
        assert zero2.bubble == pytest.approx((work + in_slots) / (vpp * m))
    assert zero1.bubble == pytest.approx((zero1.compute + zero1.tp_comm + zero1.pp_comm) / m)


def _zero_pair(base, monkeypatch, usable_between: bool):
    """Search over just ZeRO-1 and ZeRO-2 of one pp 4 x dp 2 layout, with a memory margin that
    leaves room for both, or only for ZeRO-2."""
    import dsforge.search.search as search_module

    pair = [_layout(base, 8, zero=z, pp=4, micro_batch=1, global_batch=16) for z in (1, 2)]
    assert pair[1].memory.total < pair[0].memory.total and pair[0].time.total < pair[1].time.total
    usable = (pair[0].memory.total + pair[1].memory.total) / 2 if usable_between else pair[0].memory.total * 1.01
    profile = default_profile("h100")
    profile = dataclasses.replace(profile, memory_margin=1 - usable / profile.gpu.memory_bytes)
    candidates = [Candidate(resolved=r.resolved, exact_batch=True) for r in pair]
    monkeypatch.setattr(search_module, "enumerate_candidates", lambda *_: (candidates, 2))
    return search(base, Space(gpus=8, gpus_per_node=8, global_batch=16, gpu="h100"), profile)


def test_search_picks_zero2_with_pipelines_only_when_zero1_does_not_fit(monkeypatch):
    from dsforge.search.explain import zero_pipeline_note as zero2_pipeline_note

    base = _base()
    both = _zero_pair(base, monkeypatch, usable_between=False)
    assert [r.resolved.recipe.zero.stage for r in both.ranked] == [1, 2]
    assert zero2_pipeline_note(both.ranked[0], both.ranked, both.profile) is None
    assert zero2_pipeline_note(both.ranked[1], both.ranked, both.profile).startswith(
        "ZeRO-1 of this layout fits and is faster (#1)")
    only = _zero_pair(base, monkeypatch, usable_between=True)
    assert [r.resolved.recipe.zero.stage for r in only.ranked] == [2]
    note = zero2_pipeline_note(only.ranked[0], only.ranked, only.profile)
    assert note.startswith("needs ZeRO-2: at ZeRO-1 this layout takes") and "reduce-scatter" in note


def test_search_never_proposes_a_combination_rule_z2_rejects():
    from dsforge.problems import errors
    from dsforge.recipe.validate import validate

    result = _search()
    # Z2 accepts ZeRO-2 and ZeRO-3 with pipelines (27ab157): both are proposed, at their cost.
    stages_with_pp = {r.resolved.recipe.zero.stage for r in result.ranked if r.resolved.layout.pp > 1}
    assert {2, 3} <= stages_with_pp
    fp16 = dataclasses.replace(_base(), train=dataclasses.replace(_base().train, precision="fp16"))
    result = search(fp16, Space(gpus=8, gpus_per_node=8, global_batch=64, gpu="h100"), default_profile("h100"))
    assert result.ranked and all(r.resolved.layout.pp == 1 for r in result.ranked)
    for r in result.ranked:
        assert not [p for p in errors(validate(r.resolved.recipe, r.resolved.topology)) if p.rule == "Z2"]
    # What Z2 still rejects: ZeRO-2 with CPU optimizer offload and interleaving. The search does
    # not enumerate offload, and a recipe asking for it keeps no offload in any candidate.
    offload = dataclasses.replace(_base(), zero=dataclasses.replace(_base().zero, stage=2, offload_optimizer="cpu"))
    with pytest.raises(RecipeError, match="Z2"):
        resolve(dataclasses.replace(offload, parallel=dataclasses.replace(offload.parallel, pp=2, vpp=2),
                                    train=dataclasses.replace(offload.train, global_batch=64)),
                Space(gpus=8, gpus_per_node=8, global_batch=64).topology())
    result = search(offload, Space(gpus=8, gpus_per_node=8, global_batch=64, gpu="h100"), default_profile("h100"))
    assert result.ranked and all(r.resolved.recipe.zero.offload_optimizer == "none" for r in result.ranked)


# --- uncertainty: the band, ties and the headroom ------------------------------------------

def test_band_is_the_prediction_error_around_the_step_time():
    profile = dataclasses.replace(default_profile("h100"), prediction_error=0.2)
    r = _ranked(_base(), 8, profile)
    low, high = r.band
    assert (low, high) == pytest.approx((0.8 * r.time.total, 1.2 * r.time.total))
    assert r.to_dict()["step_time_band_s"] == pytest.approx([low, high])
    assert default_profile("h100").prediction_error > 0  # the default band is not empty


# A slow link inside the node (30 GB/s) makes data parallelism's all-reduce dear, so the
# pipelines are predicted faster than pure data parallelism: a tie has something to decide.
SLOW_LINK = dict(intra_node_gbps=30.0)


def _tie_candidates(base):
    """Four layouts of llama2-7b on 8 GPUs, in the model's order under SLOW_LINK: an
    interleaved pipeline, a plain one, pure data parallelism, tensor parallelism (asserted, so
    the test notices if the model changes the premise)."""
    shapes = {"pp2 vpp2": dict(pp=2, vpp=2), "pp2": dict(pp=2), "dp8": {}, "tp2": dict(tp=2)}
    profile = dataclasses.replace(default_profile("h100"), **SLOW_LINK)
    rows = {k: _ranked(_layout(base, 8, micro_batch=1, global_batch=64, **v).resolved.recipe, 8, profile)
            for k, v in shapes.items()}
    times = [r.time.total for r in rows.values()]
    assert times == sorted(times), times
    return rows


def _search_over(base, rows, monkeypatch, error, **profile_fields):
    import dsforge.search.search as search_module

    candidates = [Candidate(resolved=r.resolved, exact_batch=True) for r in rows]
    monkeypatch.setattr(search_module, "enumerate_candidates", lambda *_: (candidates, len(candidates)))
    profile = dataclasses.replace(default_profile("h100"), prediction_error=error, **profile_fields)
    return search(base, Space(gpus=8, gpus_per_node=8, global_batch=64, gpu="h100"), profile)


def _names(result, rows):
    by_layout = {r.parallel_layout(): name for name, r in rows.items()}
    return [by_layout[r.parallel_layout()] for r in result.ranked]


def test_ties_go_to_fewer_dimensions_then_shallower_pipelines(monkeypatch):
    base = _base()
    rows = _tie_candidates(base)
    # The dimensions these layouts have: (pp, vpp) 2, pp 1, none, tp 1.
    assert [len(r.parallel_dimensions()) for r in rows.values()] == [2, 1, 0, 1]
    # No band: the predicted order, nothing tied but the fastest itself.
    exact = _search_over(base, list(rows.values()), monkeypatch, error=0.0, **SLOW_LINK)
    assert _names(exact, rows) == list(rows) and [r.tied for r in exact.ranked] == [True, False, False, False]
    # A band wide enough for all four: dp8 (no model-parallel dimension) first; of tp2 and pp2
    # (one each) the shallower pipeline (tp2: pp 1); the interleaved pipeline last.
    wide = _search_over(base, list(rows.values())[::-1], monkeypatch, error=0.5, **SLOW_LINK)
    assert _names(wide, rows) == ["dp8", "tp2", "pp2", "pp2 vpp2"]
    assert all(r.tied for r in wide.ranked)
    for above, below in zip(wide.ranked, wide.ranked[1:]):
        if above.time.total > below.time.total:
            assert above.reason.startswith("won a tie on"), above.reason
    # dp8 is also faster than tp2: the order is still the tie's, and the line says both
    assert wide.ranked[0].reason.startswith("won a tie on fewer model-parallel dimensions (0 vs 1: tp), "
                                            "and predicted"), wide.ranked[0].reason
    assert "fewer model-parallel dimensions (1: pp vs 2: pp, vpp)" in wide.ranked[2].reason
    # The same input in another order gives the same ranking (deterministic).
    again = _search_over(base, list(rows.values()), monkeypatch, error=0.5, **SLOW_LINK)
    assert _names(again, rows) == _names(wide, rows)


def test_a_band_just_too_narrow_breaks_the_tie(monkeypatch):
    """Bands overlap when t (1 - e) <= t_fastest (1 + e): the layout just outside is not tied."""
    base = _base()
    rows = _tie_candidates(base)
    fastest, dp8 = rows["pp2 vpp2"].time.total, rows["dp8"].time.total
    e = (dp8 - fastest) / (dp8 + fastest)  # bands exactly touching
    inside = _search_over(base, list(rows.values()), monkeypatch, error=e * 1.01, **SLOW_LINK)
    outside = _search_over(base, list(rows.values()), monkeypatch, error=e * 0.99, **SLOW_LINK)
    assert inside.ranked[0].resolved.layout.dp == 8
    assert outside.ranked[0].resolved.layout.dp != 8 and not any(
        r.tied and r.resolved.layout.dp == 8 for r in outside.ranked)


def test_ties_between_equally_simple_layouts_go_to_the_smaller_degree_then_more_headroom(monkeypatch):
    base = _base()
    tp2 = _layout(base, 8, tp=2, micro_batch=1, global_batch=64)
    tp4 = _layout(base, 8, tp=4, micro_batch=1, global_batch=64)
    assert tp4.memory.total < tp2.memory.total and tp2.time.total < tp4.time.total
    wide = _search_over(base, [tp4, tp2], monkeypatch, error=0.5)
    assert [r.resolved.layout.tp for r in wide.ranked] == [2, 4]  # tp2 before memory
    assert wide.ranked[0].reason.startswith("won a tie on a smaller tensor x context x expert degree (2 vs 4)")
    # the same dimensions, depth and degree: more headroom decides, even against the faster one
    from dsforge.search.explain import tie_reason
    from dsforge.search.search import tie_key

    lean = dataclasses.replace(tp2, memory=dataclasses.replace(tp2.memory, activations=0.0),
                               time=dataclasses.replace(tp2.time, compute=tp2.time.compute * 1.1))
    assert tie_key(lean) < tie_key(tp2) and lean.time.total > tp2.time.total
    assert tie_reason(lean, tp2).startswith("won a tie on more memory headroom")
    narrow = _search_over(base, [tp2, tp4], monkeypatch, error=0.0)
    assert [r.resolved.layout.tp for r in narrow.ranked] == [2, 4]


def test_a_layouts_other_variants_do_not_enter_the_tie(monkeypatch):
    """ZeRO-3 and full recomputation of one layout need less memory but are variants: the tie
    is between layouts, each by its fastest variant."""
    base = _base()
    fast = _layout(base, 8, zero=1, global_batch=64)
    lean = _layout(base, 8, zero=3, global_batch=64, activation_checkpointing="full")
    assert lean.memory.total < fast.memory.total and fast.time.total < lean.time.total
    result = _search_over(base, [lean, fast], monkeypatch, error=0.5)
    assert [r.resolved.recipe.zero.stage for r in result.ranked] == [1, 3]
    assert [r.tied for r in result.ranked] == [True, False]


def test_tie_note_says_how_to_settle_it(monkeypatch):
    from dsforge.search.command import tie_note, tied_layouts

    base = _base()
    rows = _tie_candidates(base)
    wide = _search_over(base, list(rows.values()), monkeypatch, error=0.5, **SLOW_LINK)
    assert tied_layouts(wide) == 4
    note = tie_note(wide)
    assert "4 layouts tie within the model's +-50.0% error" in note and "--measure --top 4" in note
    assert "ranks first as the simpler layout" in note
    assert tie_note(_search_over(base, list(rows.values()), monkeypatch, error=0.0)) is None


def test_measure_verdict_says_whether_the_answer_changes():
    from dsforge.search.measure import Trial, verdict

    a, b = _layout(_base(), 8, global_batch=64), _layout(_base(), 8, tp=2, global_batch=64)
    kept = [Trial(1, a, "ok", None, 1.0), Trial(2, b, "ok", None, 1.2)]
    assert verdict(kept).startswith("the measurement keeps the search's answer")
    changed = [Trial(2, b, "ok", None, 1.0), Trial(1, a, "ok", None, 1.25)]
    text = verdict(changed)
    assert text.startswith("the measurement changes the answer: #2") and "#1 took 25.0% longer" in text
    assert verdict([Trial(1, a, "oom", "out of memory", None)]).startswith("no trial finished")


def test_memory_headroom_flag_sets_the_usable_memory():
    runner = CliRunner()
    args = ["plan", "--search", "llama2-7b", "--gpus", "8", "--gpu", "h100", "--json"]
    done = runner.invoke(main, args + ["--memory-headroom", "0.3"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    gpu_bytes = default_profile("h100").gpu.memory_bytes
    assert data["profile"]["memory_margin"] == 0.3
    assert all(c["memory_bytes"]["total"] <= 0.7 * gpu_bytes for c in data["candidates"])
    default = json.loads(runner.invoke(main, args).stdout)
    assert default["counts"]["fit"] > data["counts"]["fit"]  # less usable memory, fewer fit
    assert max(c["memory_bytes"]["total"] for c in default["candidates"]) > 0.7 * gpu_bytes


@pytest.mark.parametrize("value, fix", [("1.5", "use a fraction in [0, 1)"), ("-0.1", "use a fraction"),
                                        ("15", "write it as a fraction: --memory-headroom 0.15")])
def test_memory_headroom_flag_is_validated(value, fix):
    done = CliRunner().invoke(main, ["plan", "--search", "llama2-7b", "--gpus", "8", "--memory-headroom", value])
    assert done.exit_code == 2, done.output
    assert f"--memory-headroom={float(value)!r}" in done.output or f"--memory-headroom={value}" in done.output
    assert "must be in [0, 1)" in done.output and fix in done.output and "Traceback" not in done.output
    plain = CliRunner().invoke(main, ["plan", str(REPO / "recipes" / "tiny.yaml"), "--memory-headroom", "0.2"])
    assert plain.exit_code == 2 and "--memory-headroom only apply with --search" in plain.output


def test_the_16_bit_optimizer_step_is_the_measured_one(tmp_path):
    """8 ms + 109 bytes a parameter at the GPU's bandwidth: the fit to the GPU kit's H200 runs
    (1.24B parameters: 36-39 ms measured; 6.74B: 157-167 ms); a profile file replaces both."""
    seven_b = resolve_file(REPO / "recipes" / "7b_1gpu.yaml")
    h200 = default_profile("h200", 1)
    assert step_time(seven_b, h200).optimizer == pytest.approx(0.008 + 109 * 6.738e9 / 4.8e12, rel=1e-3)
    path = tmp_path / "measured.yaml"
    path.write_text("gpu: h200\noptimizer_bytes_per_param: 54.5\noptimizer_fixed_s: 0\n")
    halved = step_time(seven_b, load_profile(path, None, 1)).optimizer
    assert halved == pytest.approx((step_time(seven_b, h200).optimizer - 0.008) / 2)
    fp32 = resolve_file(REPO / "recipes" / "7b_1gpu.yaml", ["train.precision=fp32"])
    assert step_time(fp32, h200).optimizer == pytest.approx(0.008 + 35 * 6.738e9 / 4.8e12, rel=1e-3)


def test_the_explorers_time_bars_draw_every_step_time_term():
    """The page's stacked step-time bars add up to the total only if they draw every term."""
    import re
    from dataclasses import fields
    from pathlib import Path

    from dsforge.cost.step_time import StepTime

    page = (Path(__file__).resolve().parents[2] / "dsforge" / "search" / "explorer.html").read_text()
    parts = re.search(r"const TIME_PARTS = \[(.*?)\];", page, re.DOTALL).group(1)
    assert set(re.findall(r'\["(\w+)", "#', parts)) == {f.name for f in fields(StepTime)}


def test_the_step_time_is_the_sum_of_every_term():
    from dataclasses import fields

    from dsforge.cost.step_time import StepTime

    names = [f.name for f in fields(StepTime)]
    terms = StepTime(**{name: 2.0 ** i for i, name in enumerate(names)})  # each term one bit
    assert terms.total == 2.0 ** len(names) - 1
