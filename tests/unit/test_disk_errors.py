"""A full disk during a run: the checkpoint error names the path and the likely cause; the
heartbeat thread keeps going instead of dying with a traceback."""

from __future__ import annotations

import types

import pytest
import torch

from dsforge.ckpt.trust import CheckpointError
from dsforge.job.heartbeat import Heartbeat
from dsforge.job.run_dir import RunDir
from dsforge.runtime.checkpoint import save_load as checkpoint
from dsforge.runtime.loop.checkpointer import Checkpointer


def _checkpointer(tmp_path, monkeypatch, *, background: bool, world_size: int = 1):
    """A Checkpointer on a stand-in engine whose snapshots are taken (nothing to copy) and
    whose barriers pass; `write_files` is the test's to replace."""
    monkeypatch.setattr("dsforge.runtime.loop.checkpointer.asdict", lambda _: {})
    monkeypatch.setattr("dsforge.runtime.guard.health.ranks_where", lambda flag, device: [])
    state = types.SimpleNamespace(nbytes=0, copy=lambda staging: None, optimizer=torch.optim.SGD(
        [torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    monkeypatch.setattr(checkpoint, "take_snapshot",
                        lambda engine, root, *, step, world_size, rank: types.SimpleNamespace(
                            step=step, rank=rank, state=state))
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    resolved = types.SimpleNamespace(
        recipe=types.SimpleNamespace(train=types.SimpleNamespace(
            keep_last=0, checkpoint_async=background, staging_bytes=None)),
        layout=types.SimpleNamespace(world_size=world_size))
    return Checkpointer(types.SimpleNamespace(module=torch.nn.Linear(2, 2)), resolved,
                        run_dir=RunDir(tmp_path), device=torch.device("cpu"), console=None,
                        rank=0)


def _full_disk(*args, **kwargs):
    raise RuntimeError("basic_ios::clear: iostream error")


def test_a_failed_checkpoint_write_names_the_directory(tmp_path, monkeypatch):
    checkpointer = _checkpointer(tmp_path, monkeypatch, background=False)
    monkeypatch.setattr(checkpoint, "write_files", _full_disk)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(4, after_bad_step=False)
    text = str(caught.value)
    assert str(tmp_path / "checkpoints") in text and "disk full" in text and "step 4" in text


def test_a_background_write_that_fails_is_the_ranks_failure_and_nothing_is_published(
        tmp_path, monkeypatch):
    """The writer's error comes back to the training thread at the next step's all-reduce (this
    rank still counts as writing, so no rank publishes), said as in the foreground."""
    checkpointer = _checkpointer(tmp_path, monkeypatch, background=True)
    monkeypatch.setattr(checkpoint, "write_files", _full_disk)
    assert checkpointer.save(4, after_bad_step=False) is True
    checkpointer.writer._thread.join()
    assert checkpointer.writing()  # failed: not written, so every rank holds the publication
    with pytest.raises(CheckpointError, match="step 4 .* Is the disk full"):
        checkpointer.after_step(ranks_writing=1)
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_a_background_save_is_published_once_no_rank_is_writing(tmp_path, monkeypatch):
    checkpointer = _checkpointer(tmp_path, monkeypatch, background=True)
    published = []
    monkeypatch.setattr(checkpoint, "write_files", lambda snapshot, fault, **_: None)
    monkeypatch.setattr(checkpoint, "publish", lambda root, step, **_: published.append(step))
    assert checkpointer.save(4, after_bad_step=False) is True
    checkpointer.writer._thread.join()
    checkpointer.after_step(ranks_writing=1)  # another rank still writes
    assert published == [] and checkpointer.in_flight == 4
    checkpointer.after_step(ranks_writing=0)
    assert published == [4] and checkpointer.in_flight is None
    assert checkpointer.save(6, after_bad_step=False, final=True) and published == [4, 6]


def test_heartbeat_survives_a_failing_write(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    beat = Heartbeat(RunDir(tmp_path), rank=0, write_every_s=3600)
    real_write = Path.write_text

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", no_space)
    beat.beat(1)
    beat.flush()  # would raise (and kill the writer thread) before the fix
    assert not beat.path.exists()
    monkeypatch.setattr(Path, "write_text", real_write)
    beat.flush()  # the next flush writes once the disk has room again
    assert beat.path.read_text().split()[0] == "1"


def test_a_peer_lost_while_saving_is_not_called_a_full_disk(tmp_path, monkeypatch):
    """A rank that dies while its peers wait for its files breaks their barrier with gloo's
    "Connection reset by peer": said as a lost peer (still a collective failure, which
    --max-restarts retries), never as this rank's disk."""
    from dsforge.runtime.guard.record import record_for

    def peer_gone():
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:26032: "
                           "Connection reset by peer")

    checkpointer = _checkpointer(tmp_path, monkeypatch, background=False, world_size=2)
    monkeypatch.setattr(checkpoint, "write_files", lambda snapshot, fault, **_: None)
    monkeypatch.setattr(torch.distributed, "barrier", peer_gone)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(4, after_bad_step=False)
    text = str(caught.value)
    assert "lost a peer rank while saving the checkpoint of step 4" in text
    assert "disk" not in text and "Connection reset by peer" in text
    assert record_for(caught.value, rank=0, step=3, detail="").kind == "collective"
