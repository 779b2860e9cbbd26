"""A save that the host cannot hold at once (issue 49): the state staged in parts and written as a
stream, byte for byte the file a whole snapshot writes; and the watchdog, which tells a slow
save that moves from a hung one."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors import safe_open

from dsforge.runtime.checkpoint.staging import MIN_PART_BYTES, Staging, staging_budget
from dsforge.runtime.checkpoint.stream_file import Progress, write_stream
from dsforge.runtime.guard import watchdog


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"exp_avg/w": torch.randn(1000, generator=generator),
            "fp32/b": torch.randn(37, generator=generator), "fp32/empty": torch.zeros(0),
            "exp_avg_sq/w": torch.rand(40, 50, generator=generator)}


def _sizes(tensors):
    return {key: t.numel() for key, t in tensors.items()}


def test_a_stream_is_a_safetensors_file_with_its_metadata(tmp_path):
    tensors, progress = _state(), Progress()
    path = tmp_path / "rank00000.safetensors"
    write_stream(path, _sizes(tensors), {"pieces": "[]"}, [t.reshape(-1) for t in tensors.values()],
                 progress)
    assert progress() == 4 * sum(t.numel() for t in tensors.values())
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"pieces": "[]"} and set(f.keys()) == set(tensors)
        for key, tensor in tensors.items():
            assert torch.equal(f.get_tensor(key), tensor.reshape(-1))


@pytest.mark.parametrize("part_elements", [1, 7, 37, 1000, 5000])
def test_parts_write_the_same_bytes_as_a_whole_snapshot(tmp_path, part_elements):
    """Parts that cut tensors anywhere (one element, mid-tensor, exactly a tensor, more than
    the state): the file is the whole snapshot's, and the optimizer may step only once the
    last element is copied."""
    tensors = _state()
    whole = tmp_path / "whole.safetensors"
    copies = Staging().copy_all(tensors, ready=None)
    write_stream(whole, _sizes(tensors), {"pieces": "[]"}, copies.values())
    staging = Staging(budget_bytes=4 * part_elements)
    assert staging.holds(4 * part_elements) and not staging.holds(4 * part_elements + 1)
    events = []
    parts = staging.parts(tensors, None, lambda: events.append("copied"))

    def written(parts):
        for part in parts:
            assert part.numel() <= part_elements
            events.append("part")
            yield part

    streamed = tmp_path / "parts.safetensors"
    write_stream(streamed, _sizes(tensors), {"pieces": "[]"}, written(parts))
    assert streamed.read_bytes() == whole.read_bytes()
    assert events.count("copied") == 1 and events[-2:] == ["copied", "part"]


def test_a_large_chunk_reaches_the_disk_in_synced_pieces(tmp_path, monkeypatch):
    """The watchdog sees a long write move: every SYNC_EVERY_BYTES is synced and counted,
    within one chunk too."""
    from dsforge.runtime.checkpoint import stream_file

    monkeypatch.setattr(stream_file, "SYNC_EVERY_BYTES", 400)
    added = []

    class Counted(Progress):
        def add(self, nbytes):
            added.append(nbytes)
            super().add(nbytes)

    tensor = torch.arange(1000, dtype=torch.float32)  # 4,000 bytes in one chunk
    write_stream(tmp_path / "x.safetensors", {"t": 1000}, {}, [tensor], Counted())
    assert added[:10] == [400] * 10 and sum(added) == 4000  # and the final sync
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("t"), tensor)


def test_a_stream_short_of_its_tensors_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bytes of tensors given"):
        write_stream(tmp_path / "x.safetensors", {"a": 4}, {}, [torch.zeros(3)])


def test_the_budget_is_the_recipes_or_half_the_free_memory_shared(monkeypatch):
    from dsforge.recipe import resolve_file
    from tests.conftest import REPO

    def staging_bytes(setting: str) -> int | None:
        recipe = resolve_file(REPO / "recipes" / "tiny.yaml",
                              [f"train.checkpoint_staging_gb={setting}"]).recipe
        return recipe.train.staging_bytes

    assert staging_budget(staging_bytes("2.5"), local_ranks=8) == 2_500_000_000
    assert staging_bytes("auto") is None
    monkeypatch.setattr("dsforge.runtime.checkpoint.staging.memory_available", lambda: 64 * 2**30)
    assert staging_budget(None, local_ranks=4) == 8 * 2**30
    assert staging_budget(None, local_ranks=4096) == MIN_PART_BYTES
    monkeypatch.setattr("dsforge.runtime.checkpoint.staging.memory_available", lambda: None)
    assert Staging(staging_budget(None, local_ranks=1)).holds(2**50)


def _watchdog(tmp_path, monkeypatch, timeout_s):
    ended = []
    monkeypatch.setattr(watchdog.Watchdog, "_end", lambda self, step: ended.append(step))
    dog = watchdog.Watchdog(timeout_s, 0, run_dir=None, console=None)
    return dog, ended


def test_a_wait_that_moves_is_not_a_hang(tmp_path, monkeypatch):
    """A save whose bytes keep reaching the disk outlasts the step timeout; one whose bytes
    stop is ended as a hang, named by what it waits for."""
    dog, ended = _watchdog(tmp_path, monkeypatch, timeout_s=0.4)
    progress = Progress()
    dog.arm(3)
    with watchdog.waiting_for("its checkpoint writer", progress):
        for _ in range(12):  # 1.2 s, three timeouts: moving all along
            time.sleep(0.1)
            progress.add(1)
        assert ended == []
        time.sleep(1.2)  # stopped
    assert ended and ended[0] == 3
    dog.disarm()


def test_a_hang_names_what_the_training_thread_waits_for(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(watchdog.failure, "write", lambda run_dir, record: said.append(record))
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: said.append(code))
    monkeypatch.setattr(watchdog, "DUMP_GRACE_S", 0)
    console = type("Console", (), {"say": lambda self, line: said.append(line)})()
    dog = watchdog.Watchdog(60, 1, run_dir=None, console=console)
    with watchdog.waiting_for("its checkpoint writer to write the checkpoint of step 4"):
        dog._end(5)
    record, line, code = said
    assert record.kind == "hang" and (record.rank, record.step) == (1, 5)
    assert "waiting for its checkpoint writer to write the checkpoint of step 4" in line
    assert "hung collective" not in line and code == watchdog.EXIT_CODE
