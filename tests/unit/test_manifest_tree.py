"""manifest.json's record of the source tree (issue 39): the commit, whether the tree differed
from it, and a hash of the difference that two runs from the same tree share."""

from __future__ import annotations

import subprocess

import pytest

from dsforge.runtime.loop import manifest


@pytest.fixture
def repo(tmp_path, monkeypatch):
    git = lambda *args: subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                                       capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(manifest, "REPO", tmp_path)
    return tmp_path


def test_a_clean_tree_is_not_dirty(repo):
    tree = manifest.git_tree()
    assert len(tree["git_commit"]) == 40 and tree["git_dirty"] is False
    assert tree["git_diff_sha256"] is None


def test_a_change_or_a_new_file_makes_the_tree_dirty_with_a_hash_of_it(repo):
    (repo / "a.py").write_text("x = 2\n")
    changed = manifest.git_tree()
    assert changed["git_dirty"] is True and len(changed["git_diff_sha256"]) == 64
    assert manifest.git_tree() == changed  # the same tree, the same hash
    (repo / "b.py").write_text("y = 1\n")  # untracked, not ignored: part of what ran
    assert manifest.git_tree()["git_diff_sha256"] != changed["git_diff_sha256"]
    (repo / "b.py").write_text("y = 2\n")
    assert len({manifest.git_tree()["git_diff_sha256"], changed["git_diff_sha256"]}) == 2


def test_outside_a_checkout_nothing_is_claimed(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "REPO", tmp_path)
    assert manifest.git_tree() == {"git_commit": None, "git_dirty": None, "git_diff_sha256": None}


def test_the_machine_id_is_hashed():
    found = manifest.machine_id()
    assert found is None or (len(found) == 16 and int(found, 16) >= 0)
