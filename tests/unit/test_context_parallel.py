"""Context parallelism's arithmetic: the zigzag shards, the order Ulysses' gathered sequence
is put back in, and what cp changes in the DeepSpeed config, the memory model and the step
time (the runtime's equivalence with one rank: tests/distributed/test_equivalence.py)."""

from __future__ import annotations

import pytest
import torch

from dsforge.cost.profile import default_profile
from dsforge.cost.step_time import step_time
from dsforge.plan import build_plan
from dsforge.recipe import resolve_file
from dsforge.runtime.context_shards import context_shard, gathered_order
from dsforge.translate.deepspeed_config import deepspeed_config
from dsforge.translate.kernels import predicted_memory
from tests.conftest import REPO

TINY = REPO / "recipes" / "tiny.yaml"


def test_each_rank_holds_an_early_and_a_late_chunk_and_together_the_whole_sequence():
    shards = [context_shard(16, 4, r).tolist() for r in range(4)]
    assert shards[0] == [0, 1, 14, 15] and shards[3] == [6, 7, 8, 9]
    assert sorted(sum(shards, [])) == list(range(16))
    assert context_shard(16, 1, 0).tolist() == list(range(16))


@pytest.mark.parametrize("cp", [2, 4])
def test_the_gathered_shards_go_into_the_sequences_order_and_back(cp):
    seq = 8 * cp
    gathered = torch.cat([context_shard(seq, cp, r) for r in range(cp)])  # the all-to-all's order
    to_sequence, to_ranks = gathered_order(seq, cp)
    assert gathered.index_select(0, to_sequence).tolist() == list(range(seq))
    assert gathered.index_select(0, to_sequence).index_select(0, to_ranks).tolist() == gathered.tolist()


def _tiny(*overrides, world):
    return resolve_file(TINY, ["model.num_kv_heads=4", *overrides], world_size=world)


def test_deepspeed_counts_each_sequence_once_per_context_parallel_rank():
    """DeepSpeed's data-parallel group is dp x cp (engine.MegatronMPU), and it checks
    train_batch_size = micro x accumulation x that group's size."""
    resolved = _tiny("parallel.cp=2", "parallel.dp=2", world=4)
    lay = resolved.layout
    config = deepspeed_config(model=resolved.recipe.model, train=resolved.recipe.train,
                              zero=resolved.recipe.zero, layout=lay, device="cpu")
    assert config["train_batch_size"] == lay.micro_batch * lay.grad_accum * lay.dp_cp == 2 * lay.global_batch


def test_context_parallelism_divides_the_activations_and_zero_shards_over_dp_x_cp():
    for stage in (1, 3):
        one = predicted_memory(_tiny("parallel.dp=1", "train.global_batch=8", f"zero.stage={stage}",
                                     world=1), "cpu")
        two = predicted_memory(_tiny("parallel.dp=1", "parallel.cp=2", "train.global_batch=8",
                                     f"zero.stage={stage}", world=2), "cpu")
        assert two.activations == pytest.approx(one.activations / 2)
        assert two.optimizer == pytest.approx(one.optimizer / 2)  # partitioned over the cp ranks


def test_the_step_time_charges_the_shards_compute_and_ulysses_all_to_alls():
    profile = default_profile("h100", 8)
    one = step_time(_tiny("parallel.dp=1", "train.global_batch=8", world=1), profile)
    two = step_time(_tiny("parallel.dp=1", "parallel.cp=2", "train.global_batch=8", world=2), profile)
    assert one.cp_comm == 0 and two.cp_comm > 0
    # half the tokens a rank, at a rate that falls a little with the shorter microbatch
    assert one.compute / 2 < two.compute < one.compute


def test_the_plan_and_the_step_time_count_the_same_exchange():
    """recipes/8b_32k_cp4.yaml by hand: a rank's shard of 8,192 tokens, q and the output over
    32 / tp heads and k and v over 8 / tp, 128 channels, 2 bytes, 3/4 of it sent: 60 MiB a layer
    in the forward; forward and backward, 32 layers, 8 microbatches a step."""
    resolved = resolve_file(REPO / "recipes" / "8b_32k_cp4.yaml")
    traffic = build_plan(resolved)["context_parallel_traffic"]
    assert traffic["bytes_per_layer_forward"] == 8192 * (2 * 32 + 2 * 8) * 128 / 2 * 2 * 3 / 4
    assert traffic["bytes_per_layer_forward"] == 60 * 2**20
    assert traffic["passes"] == 2 and traffic["bytes_per_step"] == 60 * 2**20 * 2 * 32 * 8
    profile = default_profile("h100", 8)
    bandwidth = profile.intra_node_gbps * 1e9  # the tp x cp group of 8 fills one node
    assert step_time(resolved, profile).cp_comm == pytest.approx(traffic["bytes_per_step"] / bandwidth)
    assert build_plan(_tiny(world=2))["context_parallel_traffic"]["bytes_per_step"] == 0
