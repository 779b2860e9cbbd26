"""Stale DeepSpeed op build locks are cleared; a build that is alive keeps its lock."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dsforge.runtime.assemble.build_locks import clear_stale_locks, extensions_root, stale_locks


def _op_dir(root, name, age_s, lock=True):
    directory = root / name
    directory.mkdir()
    files = [directory / "build.ninja"] + ([directory / "lock"] if lock else [])
    then = time.time() - age_s
    for path in files:
        path.touch()
        os.utime(path, (then, then))
    os.utime(directory, (then, then))
    return directory


def test_only_idle_locks_are_stale(tmp_path):
    _op_dir(tmp_path, "killed_build", age_s=3600)
    _op_dir(tmp_path, "building_now", age_s=5)
    _op_dir(tmp_path, "built", age_s=3600, lock=False)
    assert stale_locks(tmp_path) == [tmp_path / "killed_build" / "lock"]


def test_a_fresh_object_file_keeps_an_old_lock(tmp_path):
    directory = _op_dir(tmp_path, "slow_build", age_s=3600)
    (directory / "cpu_adam.o").touch()  # the compiler is still writing
    assert stale_locks(tmp_path) == []


def test_clear_removes_and_reports(tmp_path):
    _op_dir(tmp_path, "killed_build", age_s=3600)
    said = []
    removed = clear_stale_locks(tmp_path, log=said.append)
    assert removed == [tmp_path / "killed_build" / "lock"]
    assert not (tmp_path / "killed_build" / "lock").exists()
    assert "killed_build/lock" in said[0]
    assert clear_stale_locks(tmp_path, log=said.append) == []


def test_root_is_where_torch_builds(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch's default root lives there
    assert extensions_root() == Path(_get_build_directory("probe", verbose=False)).parent
    assert tmp_path in extensions_root().parents
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "explicit"))
    assert extensions_root() == tmp_path / "explicit"
