"""The training data stream (dsforge.runtime.loop.data): synthetic and token-file sources, the
train/validation split, and the step's microbatches per data-parallel rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsforge.runtime.loop import data as data_mod


def test_synthetic_samples_are_deterministic_per_sample_id():
    source = data_mod.SyntheticTokens(seq_len=16, vocab_size=256, seed=1)
    assert torch.equal(source.sample(5), source.sample(5))
    assert not torch.equal(source.sample(5), source.sample(6))
    assert source.sample(0).shape == (17,) and int(source.sample(0).max()) < 256


def test_microbatches_split_the_global_batch_over_data_parallel_ranks():
    source = data_mod.SyntheticTokens(seq_len=8, vocab_size=256, seed=0)
    single = data_mod.microbatches(source, step=3, global_batch=8, micro_batch=2, grad_accum=4,
                                   dp=1, dp_rank=0, vocab_size=256)
    split = [data_mod.microbatches(source, step=3, global_batch=8, micro_batch=2, grad_accum=2,
                                   dp=2, dp_rank=r, vocab_size=256) for r in (0, 1)]
    rows = lambda batches: {tuple(row.tolist()) for mb in batches for row in mb.tokens}
    assert rows(single) == rows(split[0]) | rows(split[1])
    assert not rows(split[0]) & rows(split[1])
    mb = single[0]
    assert torch.equal(mb.tokens[:, 1:], mb.labels[:, :-1])  # labels are the next tokens


def test_synthetic_validation_is_another_stream():
    train = data_mod.SyntheticTokens(seq_len=16, vocab_size=256, seed=1)
    held_out = data_mod.SyntheticTokens(seq_len=16, vocab_size=256, seed=1, stream=data_mod.VALIDATION)
    assert not torch.equal(train.sample(3), held_out.sample(3))


def test_token_file_windows_shuffle_and_resume(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(path)
    windows = range(0, 111)
    source = data_mod.TokenFile(path, seq_len=9, seed=3, dtype="uint16", windows=windows, stream=0)
    first_epoch = [int(source.sample(i)[0]) for i in range(len(windows))]
    assert sorted(first_epoch) == sorted(int(s * 9 % 256) for s in range(111))  # each window once
    again = data_mod.TokenFile(path, seq_len=9, seed=3, dtype="uint16", windows=windows, stream=0)
    assert torch.equal(again.sample(150), source.sample(150))  # resumable: no state beyond the id
    assert [int(source.sample(111 + i)[0]) for i in range(5)] != first_epoch[:5]  # reshuffled


def test_token_file_split_cuts_windows_like_megatron_cuts_sequences():
    assert data_mod.split_ranges(111, "98,1,1") == [range(0, 109), range(109, 110), range(110, 111)]
    assert data_mod.split_ranges(10, "100") == [range(0, 10), range(0), range(0)]


def test_microbatches_refuse_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, 300, 4, 5], dtype=np.uint16).tofile(path)
    source = data_mod.TokenFile(path, seq_len=2, seed=0, dtype="uint16", windows=range(2), stream=0)
    with pytest.raises(ValueError, match="token id 300, outside the model's vocabulary"):
        data_mod.microbatches(source, step=0, global_batch=2, micro_batch=2, grad_accum=1, dp=1,
                              dp_rank=0, vocab_size=256)


def test_a_steps_data_names_the_token_offsets_of_its_windows(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    source = data_mod.TokenFile(path, seq_len=9, seed=3, dtype="uint16", windows=range(111),
                                stream=0)
    kind, name, [offset] = source.locate(150)
    assert (kind, name) == ("token offsets", str(path))
    assert int(source.sample(150)[0]) == offset  # token i of this file is i
    data = data_mod.step_data(source, step=2, global_batch=4)
    assert data["samples"] == [8, 11] and data["source"] == source.what
    assert data["token offsets"][str(path)] == sorted(int(source.sample(i)[0]) for i in range(8, 12))
    synthetic = data_mod.SyntheticTokens(seq_len=8, vocab_size=16, seed=1)
    assert data_mod.step_data(synthetic, step=0, global_batch=2) == {
        "samples": [0, 1], "source": "synthetic training samples"}


def test_a_megatron_samples_documents_hold_its_tokens(tmp_path):
    """The documents `locate` names (through a blend, as Megatron's GPTDataset maps a sample to
    them) contain the sample's tokens."""
    from dsforge.data.indexed import inspect_dataset
    from dsforge.data.samples import MegatronSamples, build_splits
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tests.conftest import REPO

    prefix = str(REPO / "data" / "tempest")
    identity = inspect_dataset(prefix).identity
    for parts in ([(prefix, 1.0)], [(prefix, 0.5), (prefix, 0.5)]):
        splits = build_splits(parts, split="90,5,5", seq_len=64, seed=1, train_samples=32,
                              validation_samples=None, identity=identity, cache_dir=tmp_path)
        samples = MegatronSamples(splits.train, what="training samples")
        documents = IndexedDataset(prefix)
        for index in (0, 7, 31):
            kind, name, ids = samples.locate(index)
            assert (kind, name) == ("documents", prefix) and ids
            text = np.concatenate([documents[i] for i in ids]).tolist()
            tokens = samples.sample(index).tolist()
            assert any(text[i:i + len(tokens)] == tokens for i in range(len(text) - len(tokens) + 1))
