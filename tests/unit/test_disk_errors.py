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


def test_a_failed_checkpoint_write_names_the_directory(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(checkpoint, "save", full_disk)
    monkeypatch.setattr("dsforge.runtime.loop.checkpointer.asdict", lambda _: {})
    monkeypatch.setattr("dsforge.runtime.guard.health.ranks_where", lambda flag, device: [])
    resolved = types.SimpleNamespace(recipe=types.SimpleNamespace(train=types.SimpleNamespace(
        keep_last=0)), layout=types.SimpleNamespace(world_size=1))
    checkpointer = Checkpointer(types.SimpleNamespace(module=torch.nn.Linear(2, 2)), resolved,
                                run_dir=RunDir(tmp_path), device=torch.device("cpu"),
                                console=None, rank=0)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(4, after_bad_step=False)
    text = str(caught.value)
    assert str(tmp_path / "checkpoints") in text and "disk full" in text and "step 4" in text


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

    def peer_gone(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:26032: "
                           "Connection reset by peer")

    monkeypatch.setattr(checkpoint, "save", peer_gone)
    monkeypatch.setattr("dsforge.runtime.loop.checkpointer.asdict", lambda _: {})
    monkeypatch.setattr("dsforge.runtime.guard.health.ranks_where", lambda flag, device: [])
    resolved = types.SimpleNamespace(recipe=types.SimpleNamespace(train=types.SimpleNamespace(
        keep_last=0)), layout=types.SimpleNamespace(world_size=2))
    checkpointer = Checkpointer(types.SimpleNamespace(module=torch.nn.Linear(2, 2)), resolved,
                                run_dir=RunDir(tmp_path), device=torch.device("cpu"),
                                console=None, rank=0)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(4, after_bad_step=False)
    text = str(caught.value)
    assert "lost a peer rank while saving the checkpoint of step 4" in text
    assert "disk" not in text and "Connection reset by peer" in text
    assert record_for(caught.value, rank=0, step=3, detail="").kind == "collective"
