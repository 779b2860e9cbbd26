"""The pieces of a layout-free checkpoint join back into full tensors, and what a resume on
another layout accepts and refuses (the multi-rank proof is tests/distributed/test_reshard.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsforge.ckpt.format import COMPLETE, FORMAT_VERSION, STATE_DIR, STATE_FILE, Piece, piece_key
from dsforge.ckpt.names import ParamSpec, shard, unshard
from dsforge.ckpt.reader import StateError, open_state
from dsforge.ckpt.trust import CheckpointError, check_resumable
from dsforge.job.run_dir import RunDir
from tests.unit.helpers.checkpoints import RECIPE, fake_checkpoint


def _spec(shape, dim, stride, rank, size):
    return ParamSpec(global_name="w", full_shape=shape, tp_dim=dim, stride=stride, tp_rank=rank,
                     tp_size=size, expert=False)


@pytest.mark.parametrize("dim,stride,size", [(0, 1, 2), (1, 1, 4), (0, 2, 2), (0, 2, 4), (1, 1, 1)])
def test_shards_join_back_into_the_full_tensor(dim, stride, size):
    full = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)
    shards = [shard(full, _spec((8, 16), dim, stride, r, size)) for r in range(size)]
    assert torch.equal(unshard(shards, dim=dim, stride=stride), full)


def test_swiglu_shards_hold_their_gate_and_up_rows():
    """fc1 is [gate; up]: with stride 2, tp rank r holds [gate_r; up_r] (Megatron's layout)."""
    gate, up = torch.zeros(4, 3), torch.ones(4, 3)
    first = shard(torch.cat([gate, up]), _spec((8, 3), 0, 2, 0, 2))
    assert torch.equal(first, torch.cat([gate[:2], up[:2]]))


def _write(directory: Path, pieces_by_rank: dict[int, list[tuple[Piece, torch.Tensor]]],
           ranks: int | None = None) -> Path:
    """A checkpoint directory holding only the layout-free state and a marker."""
    state_dir = directory / STATE_DIR
    state_dir.mkdir(parents=True)
    for rank, pieces in pieces_by_rank.items():
        save_file({p.key: t for p, t in pieces}, str(state_dir / f"rank{rank:05d}.safetensors"),
                  metadata={"pieces": json.dumps([p.to_json() for p, _ in pieces])})
    (state_dir / STATE_FILE).write_text(json.dumps(
        {"format": FORMAT_VERSION, "ranks": ranks or len(pieces_by_rank), "padded_vocab_size": 128}))
    (directory / COMPLETE).write_text(json.dumps({"recipe": {"train": {"precision": "bf16"}}}))
    return directory


def _pieces(full: torch.Tensor, *, size: int, dp: int, dim: int = 0):
    """Pieces as tp x dp ranks write them under ZeRO: each shard cut into dp flat ranges."""
    by_rank = {}
    for tp_rank in range(size):
        local = shard(full, _spec(tuple(full.shape), dim, 1, tp_rank, size)).reshape(-1)
        part = math.ceil(local.numel() / dp)
        for dp_rank in range(dp):
            start = dp_rank * part
            numel = min(part, local.numel() - start)
            piece = Piece(key=piece_key("fp32", "w", tp_rank, start), name="w", state="fp32",
                          full_shape=tuple(full.shape), tp_dim=dim, stride=1, tp_rank=tp_rank,
                          tp_size=size, local_shape=tuple(full.shape[:dim]) + (full.shape[dim] // size,)
                          + tuple(full.shape[dim + 1:]), start=start, numel=numel)
            by_rank.setdefault(tp_rank * dp + dp_rank, []).append(
                (piece, local[start:start + numel].clone()))
    return by_rank


def test_the_reader_joins_data_and_tensor_parallel_pieces(tmp_path):
    full = torch.randn(6, 10)
    reader = open_state(_write(tmp_path, _pieces(full, size=2, dp=3, dim=1)))
    assert reader.names() == ["w"] and reader.padded_vocab_size == 128
    assert torch.equal(reader.full("w", "fp32"), full)
    assert reader.full("w").dtype == torch.bfloat16  # "param": the training precision
    assert not reader.has_state("exp_avg")
    # No rank file stays mapped between parameters: the pages read through an open map stay
    # resident, which made a 1B export's peak the model's size (benchmarks/checkpoints).
    assert reader.open_files == 0


def test_a_missing_range_is_an_error_not_zeros(tmp_path):
    pieces = _pieces(torch.randn(6, 10), size=2, dp=3)
    pieces[1] = []  # dp rank 1 of tp rank 0 wrote nothing
    with pytest.raises(StateError, match="are in no rank file"):
        open_state(_write(tmp_path, pieces)).full("w", "fp32")


def test_a_missing_rank_file_is_named(tmp_path):
    directory = _write(tmp_path, _pieces(torch.randn(4, 4), size=1, dp=2), ranks=3)
    with pytest.raises(StateError, match="rank00002.safetensors is missing"):
        open_state(directory)


def test_a_checkpoint_without_the_state_says_how_to_get_one(tmp_path):
    (tmp_path / COMPLETE).write_text(json.dumps({"recipe": {}}))
    with pytest.raises(StateError, match="Resume it once on its own layout"):
        open_state(tmp_path)


def _other_layout(**changes) -> dict:
    recipe = json.loads(json.dumps(RECIPE))
    for field, value in changes.items():
        section, key = field.split("__")
        recipe[section][key] = value
    return recipe


def test_a_layout_change_needs_the_layout_free_state(tmp_path):
    fake_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="resumes only on the layout that wrote it") as info:
        check_resumable(RunDir(tmp_path), _other_layout(parallel__tp=2), 2)
    assert "parallel.tp: 1 in the checkpoint, 2 now" in str(info.value)


def test_a_layout_change_is_listed_when_the_state_is_there(tmp_path):
    root = fake_checkpoint(tmp_path)
    (root / "step00000003" / STATE_DIR).mkdir()
    record = check_resumable(RunDir(tmp_path), _other_layout(parallel__tp=2, zero__stage=3), 4)
    assert record["layout_changes"] == ["parallel.tp: 1 in the checkpoint, 2 now",
                                        "zero.stage: 1 in the checkpoint, 3 now",
                                        "world size: 2 in the checkpoint, 4 now"]
    assert check_resumable(RunDir(tmp_path), RECIPE, 2)["layout_changes"] == []


def test_a_model_change_is_still_refused_with_the_list(tmp_path):
    root = fake_checkpoint(tmp_path)
    (root / "step00000003" / STATE_DIR).mkdir()
    with pytest.raises(CheckpointError, match="model.num_layers: 2 in the checkpoint, 4 now"):
        check_resumable(RunDir(tmp_path), _other_layout(model__num_layers=4, parallel__tp=2), 2)


def test_a_new_vocabulary_padding_keeps_the_model_and_says_so():
    """A vocabulary of 300 is 384 rows at tp 1, 512 at tp 2; the padding rows are zero in
    training (runtime/assemble/vocab.py), so a resume on the other tp holds exactly the tensor
    a run there would have, either way."""
    from dsforge.runtime.assemble.vocab import pad_rows
    from dsforge.runtime.checkpoint.layout_free import fit_to_layout

    rows = torch.arange(300 * 2, dtype=torch.float32).view(300, 2)
    saved = pad_rows(rows, 384)
    notes: list[str] = []
    grown = fit_to_layout(saved, ParamSpec("output_layer.weight", (512, 2), 0, 1, 0, 2, False), notes)
    assert torch.equal(grown, pad_rows(rows, 512))
    shrunk = fit_to_layout(grown, ParamSpec("embedding.word_embeddings.weight", (384, 2), 0, 1, 0, 1, False), notes)
    assert torch.equal(shrunk, saved)
    assert "from 384 to 512 rows" in notes[0] and "the model is unchanged" in notes[0]
    with pytest.raises(StateError, match="decoder.final_layernorm.weight is"):
        fit_to_layout(torch.ones(4), ParamSpec("decoder.final_layernorm.weight", (8,), None, 1, 0, 1, False), [])


@pytest.mark.parametrize("fused", [False, True])
def test_a_resumed_adam_state_is_the_one_torch_would_have_made(fused):
    """The layout-free resume writes Adam's state itself (runtime/checkpoint/zero_state.py): the step's
    dtype and device must be torch's own for that optimizer (fused: float32 on the parameter's
    device, which its kernel reads; a CPU step would fault there on a GPU)."""
    from dsforge.runtime.checkpoint.zero_state import new_adam_state

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=fused, foreach=False)
    weight.grad = torch.ones(4)
    optimizer.step()
    made = optimizer.state[weight]["step"]
    ours = new_adam_state(weight.detach(), optimizer, 7)["step"]
    assert (ours.dtype, ours.device, float(ours)) == (made.dtype, made.device, 7.0)


def test_the_fp16_loss_scalers_state_comes_back_whole():
    """fp16's dynamic loss scaler (DeepSpeed refuses fp16 on a CPU, so no run proves it here):
    its scale and counters go into state.json and back onto the resumed engine's scaler."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from dsforge.runtime.checkpoint.layout_free import _restore_engine, _scalars

    trained = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=100, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False)
    trained.cur_scale, trained.cur_iter, trained.last_overflow_iter = 512.0, 37, 30
    trained.cur_hysteresis = 1
    saved = {"param_group": {}, "lr_scheduler": None, "global_steps": 37, "global_samples": 296,
             "skipped_steps": 3, "loss_scaler": _scalars(trained)}
    fresh = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=100, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False)
    engine = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[], loss_scaler=fresh),
                             lr_scheduler=None)
    _restore_engine(engine, saved)
    assert _scalars(fresh) == _scalars(trained) and fresh.cur_scale == 512.0
    assert (engine.global_steps, engine.skipped_steps) == (37, 3)


def test_the_optimizer_step_waits_for_the_background_copy():
    """A background save copies the state while the next forward and backward run; the
    optimizer's step (which changes the state) waits for the copy (runtime/checkpoint/
    staging.py StepGate), so the snapshot is the state of the step it was taken after."""
    import threading
    import time

    from dsforge.runtime.checkpoint.staging import Staging, StepGate

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.ones(4)
    gate = StepGate(optimizer, 1)
    stepping = threading.Thread(target=optimizer.step)
    stepping.start()
    time.sleep(0.2)
    assert stepping.is_alive() and torch.equal(weight.detach(), torch.ones(4))  # held
    copy = Staging().copy_all({"w": weight.detach()}, ready=None)["w"]
    gate.open()
    stepping.join(timeout=5)
    assert not stepping.is_alive() and gate.waited_s >= 0.15
    assert torch.equal(copy, torch.ones(4)) and torch.equal(weight.detach(), torch.zeros(4))
    gate.close()
    optimizer.step()  # no gate any more: steps at once
    assert torch.equal(weight.detach(), -torch.ones(4))
