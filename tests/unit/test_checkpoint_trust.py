"""What a resume trusts before any rank starts (CK1-CK4): `latest`, the completion marker,
who may have written the files, and whether every saved file is still there."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsforge.ckpt import trust
from dsforge.ckpt.trust import (CheckpointError, check_complete, check_resumable,
                                check_safe_to_load, latest_complete)
from dsforge.job.run_dir import RunDir
from dsforge.runtime.checkpoint import save_load as checkpoint
from tests.unit.helpers.checkpoints import RECIPE, fake_checkpoint

def _refused(run_dir: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        check_resumable(RunDir(run_dir), RECIPE, 2)
    return info.value


def test_a_complete_checkpoint_of_your_own_is_resumable(tmp_path):
    fake_checkpoint(tmp_path)
    assert check_resumable(RunDir(tmp_path), RECIPE, 2)["step"] == 3


def test_a_finished_run_is_not_resumed_and_says_what_to_do_instead(tmp_path):
    """A run saves its last step too: resuming it with the same total would train nothing."""
    fake_checkpoint(tmp_path, step=6)
    error = _refused(tmp_path)
    assert "has finished: its newest checkpoint is after step 6 and train.steps is 6" in str(error)
    assert "continue it with a larger total (--set train.steps=N, N > 6)" in str(error)
    assert f"dsforge export {tmp_path} --to OUT" in str(error)
    fewer = {**RECIPE, "train": {**RECIPE["train"], "steps": 5}}
    with pytest.raises(CheckpointError, match="train.steps is 5"):
        check_resumable(RunDir(tmp_path), fewer, 2)


def test_a_finished_run_continues_with_a_larger_total(tmp_path):
    """Its schedule then spans the new total from the resumed step on, unless
    train.lr_decay_steps holds it to the old one; the launcher and the manifest say so."""
    fake_checkpoint(tmp_path, step=6)
    longer = {**RECIPE, "train": {**RECIPE["train"], "steps": 12}}
    record = check_resumable(RunDir(tmp_path), longer, 2)
    assert record["step"] == 6 and record["layout_changes"] == []
    assert record["changes"] == [
        "train.steps: 6 in the checkpoint, 12 now",
        "the learning-rate schedule now decays over 12 steps instead of 6, from the resumed "
        "step on; set train.lr_decay_steps: 6 to keep the old decay"]
    held = {**RECIPE, "train": {**RECIPE["train"], "steps": 12, "lr_decay_steps": 6}}
    assert check_resumable(RunDir(tmp_path), held, 2)["changes"] == [
        "train.lr_decay_steps: None in the checkpoint, 6 now",
        "train.steps: 6 in the checkpoint, 12 now"]


def test_the_experts_implementation_may_change_on_resume_field_by_field(tmp_path):
    """model.moe is compared field by field: its experts may change (the same parameters under
    the same names), its number of experts may not."""
    moe = {"num_experts": 4, "top_k": 2, "experts": "sequential"}
    saved = {**RECIPE, "model": {**RECIPE["model"], "moe": moe}}
    fake_checkpoint(tmp_path, recipe=saved)
    grouped = {**saved, "model": {**saved["model"], "moe": {**moe, "experts": "grouped"}}}
    assert check_resumable(RunDir(tmp_path), grouped, 2)["changes"] == [
        "model.moe.experts: 'sequential' in the checkpoint, 'grouped' now"]
    more = {**saved, "model": {**saved["model"], "moe": {**moe, "num_experts": 8}}}
    with pytest.raises(CheckpointError, match="model.moe.num_experts: 4 in the checkpoint, 8 now"):
        check_resumable(RunDir(tmp_path), more, 2)


def test_a_run_may_go_between_bf16_and_fp8_and_compiled_and_eager(tmp_path):
    """train.fp8 keeps the weights bf16 parameters (dynamic scales hold no state) and compiling
    runs the same operations: both may change on resume, either way."""
    fake_checkpoint(tmp_path, recipe=RECIPE)
    changed = {**RECIPE, "train": {**RECIPE["train"], "fp8": "tensorwise"},
               "model": {**RECIPE["model"], "compile": "layers"}}
    assert check_resumable(RunDir(tmp_path), changed, 2)["changes"] == [
        "model.compile: 'none' in the checkpoint, 'layers' now",
        "train.fp8: 'none' in the checkpoint, 'tensorwise' now"]


def test_a_refused_change_lists_what_may_change(tmp_path):
    fake_checkpoint(tmp_path)
    other_lr = {**RECIPE, "train": {**RECIPE["train"], "lr": 2e-3}}
    with pytest.raises(CheckpointError) as info:
        check_resumable(RunDir(tmp_path), other_lr, 2)
    text = str(info.value)
    assert "train.lr: None in the checkpoint, 0.002 now" in text
    assert "train.eval_every" in text and "train.time_limit" in text and "docs/checkpoints.md" in text
    assert "train.steps" in text and "train.on_nonfinite" in text


def test_a_checkpoint_from_before_a_field_existed_resumes_at_its_default(tmp_path):
    """A recipe saved by an older dsforge lacks the fields added since; they held their
    defaults then. The kernels and attention backend may change on resume (same model)."""
    fake_checkpoint(tmp_path)
    now = {**RECIPE, "model": {**RECIPE["model"], "kernels": "auto", "sdpa_backend": "auto"},
           "train": {**RECIPE["train"], "adam_impl": "auto"}}
    assert check_resumable(RunDir(tmp_path), now, 2)["step"] == 3
    changed = {**now, "model": {**now["model"], "kernels": "liger", "sdpa_backend": "flash"}}
    assert check_resumable(RunDir(tmp_path), changed, 2)["step"] == 3
    other_adam = {**now, "train": {**now["train"], "adam_impl": "deepspeed"}}
    with pytest.raises(CheckpointError, match="train.adam_impl: 'auto' in the checkpoint"):
        check_resumable(RunDir(tmp_path), other_adam, 2)


@pytest.mark.parametrize("content", [
    "../../other-run/checkpoints/step00000002",
    "/abs/step00000002",
    "step00000002/../step00000003",
    "step3",
    "",
])
def test_latest_must_be_a_plain_step_tag(tmp_path, content):
    root = fake_checkpoint(tmp_path)
    (root / "latest").write_text(content)
    error = _refused(tmp_path)
    assert error.problem.rule == "CK1" and "not the tag of a checkpoint" in str(error)
    assert str(root / "latest") in str(error)


def test_latest_pointing_outside_the_run_is_refused_even_when_the_target_is_complete(tmp_path):
    """Issue 10: ../../other-run/checkpoints/step00000002 resumed someone else's run."""
    fake_checkpoint(tmp_path / "other-run", step=2)
    root = fake_checkpoint(tmp_path / "mine")
    (root / "latest").write_text("../../other-run/checkpoints/step00000002")
    assert _refused(tmp_path / "mine").problem.rule == "CK1"


def test_a_binary_latest_is_a_clear_error(tmp_path):
    root = fake_checkpoint(tmp_path)
    (root / "latest").write_bytes(b"\x80\x00\xff" * 1000)
    error = _refused(tmp_path)
    assert error.problem.rule == "CK1" and len(str(error)) < 600


def test_latest_naming_a_missing_directory(tmp_path):
    root = fake_checkpoint(tmp_path)
    (root / "latest").write_text("step00000009")
    assert "names step00000009, which does not exist" in str(_refused(tmp_path))


def test_latest_as_a_symlink_is_refused(tmp_path):
    root = fake_checkpoint(tmp_path)
    (root / "latest").unlink()
    (root / "latest").symlink_to(root / "step00000003" / "dsforge_complete.json")
    error = _refused(tmp_path)
    assert error.problem.rule == "CK1" and "symbolic link" in str(error)


@pytest.mark.parametrize("text, why", [
    ('{"step": 3, "tag": "step00000003", "world_si', "not whole JSON"),
    ("\xff\xfe", "not whole JSON"),
    ("[1, 2]", "JSON object"),
    ('{"step": 3, "tag": "step00000004", "world_size": 2, "recipe": {}}', "records tag"),
    ('{"step": "3", "tag": "step00000003", "world_size": 2, "recipe": {}}', "records step"),
    ('{"step": 3, "tag": "step00000003", "world_size": 2, "recipe": {"model": 1}}', "recipe"),
    ('{"step": 3, "tag": "step00000003", "world_size": 2, "recipe": {}, '
     '"files": {"../../etc/passwd": 1}}', "relative paths"),
])
def test_a_truncated_or_damaged_marker_is_a_clear_error(tmp_path, text, why):
    root = fake_checkpoint(tmp_path)
    (root / "step00000003" / "dsforge_complete.json").write_bytes(text.encode("latin-1"))
    error = _refused(tmp_path)
    assert error.problem.rule == "CK3" and why in str(error)


def test_a_missing_marker_says_the_save_never_finished(tmp_path):
    root = fake_checkpoint(tmp_path)
    (root / "step00000003" / "dsforge_complete.json").unlink()
    assert "whose save never finished" in str(_refused(tmp_path))


def test_nothing_published_is_none(tmp_path):
    assert latest_complete(tmp_path / "checkpoints") is None


def _written_at(path: Path, seconds: int) -> None:
    os.utime(path, ns=(seconds * 10**9, seconds * 10**9))


def test_a_publish_cut_between_the_marker_and_latest_is_published(tmp_path):
    """Rank 0 killed after step 6's marker and before `latest` (save_load.publish): the resume
    takes step 6, which is complete, not step 3 that `latest` still names. A `latest` written
    later by hand to go back to step 3 is obeyed; a newer save that never finished, or whose
    marker is not whole JSON, is not published."""
    root = fake_checkpoint(tmp_path, step=3)
    fake_checkpoint(tmp_path, step=6)
    marker = root / "step00000006" / "dsforge_complete.json"
    (root / "latest").write_text("step00000003")
    _written_at(root / "latest", 100)
    _written_at(marker, 200)
    assert latest_complete(root)["step"] == 6 and trust.read_latest(root) == "step00000003"
    assert check_resumable(RunDir(tmp_path), {**RECIPE, "train": {"steps": 9}}, 2)["step"] == 6
    _written_at(root / "latest", 300)  # going back by hand, after step 6 was saved
    assert latest_complete(root)["step"] == 3
    _written_at(root / "latest", 100)
    marker.write_text('{"step": 6, "tag": ')  # cut short: not a marker to trust
    _written_at(marker, 200)
    assert latest_complete(root)["step"] == 3
    marker.unlink()  # the save of step 6 never finished
    assert latest_complete(root)["step"] == 3


@pytest.mark.parametrize("damage", ["missing", "truncated", "empty"])
def test_a_missing_or_truncated_optimizer_shard_is_found_before_any_rank_starts(tmp_path, damage):
    root = fake_checkpoint(tmp_path)
    shard = root / "step00000003" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(b"x" * (0 if damage == "empty" else 150))
    error = _refused(tmp_path)
    assert error.problem.rule == "CK4" and shard.name in str(error)


def test_a_marker_without_a_file_list_needs_an_rng_file_per_rank_and_no_empty_file(tmp_path):
    root = fake_checkpoint(tmp_path, files=None)
    record = latest_complete(root)
    check_complete(root, record)
    (root / "step00000003" / "dsforge_rng_rank00001.pt").unlink()
    with pytest.raises(CheckpointError, match="dsforge_rng_rank00001.pt .missing."):
        check_complete(root, record)
    (root / "step00000003" / "dsforge_rng_rank00001.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        check_complete(root, record)


def test_world_writable_files_are_refused(tmp_path):
    root = fake_checkpoint(tmp_path)
    os.chmod(root / "step00000003" / "mp_rank_00_model_states.pt", 0o666)
    error = _refused(tmp_path)
    assert error.problem.rule == "CK2" and "writable by every user" in str(error)


def test_world_writable_latest_is_refused(tmp_path):
    root = fake_checkpoint(tmp_path)
    os.chmod(root / "latest", 0o666)
    assert "writable by every user" in str(_refused(tmp_path))


def test_group_writable_files_are_refused_unless_the_group_is_yours_alone(tmp_path, monkeypatch):
    root = fake_checkpoint(tmp_path)
    os.chmod(root / "step00000003" / "mp_rank_00_model_states.pt", 0o664)
    monkeypatch.setattr(trust, "private_group", lambda gid, uid: False)
    error = _refused(tmp_path)
    assert error.problem.rule == "CK2" and "writable by group" in str(error)
    assert "chmod -R g-w" in str(error)
    monkeypatch.setattr(trust, "private_group", lambda gid, uid: True)
    check_resumable(RunDir(tmp_path), RECIPE, 2)


class _Account:
    def __init__(self, name, uid, gid, members=()):
        self.pw_name, self.pw_uid, self.pw_gid = name, uid, gid
        self.gr_name, self.gr_mem = name, list(members)


@pytest.mark.parametrize("group_members, others_primary_gid, gid, private", [
    ((), 2000, 1000, True),  # user-private group (umask 002 makes files group-writable)
    (("bob",), 2000, 1000, False),  # bob is a member
    ((), 1000, 1000, False),  # bob's primary group too
    ((), 2000, 2000, False),  # not the user's primary group
])
def test_private_group(monkeypatch, group_members, others_primary_gid, gid, private):
    alice = _Account("alice", 1000, 1000)
    bob = _Account("bob", 1001, others_primary_gid)
    monkeypatch.setattr(trust.pwd, "getpwuid", lambda uid: {1000: alice, 1001: bob}[uid])
    monkeypatch.setattr(trust.pwd, "getpwall", lambda: [alice, bob])
    monkeypatch.setattr(trust.grp, "getgrgid", lambda g: _Account("g", 0, g, group_members))
    trust.private_group.cache_clear()
    try:
        assert trust.private_group(gid, 1000) is private
    finally:
        trust.private_group.cache_clear()


def test_an_unknown_group_is_not_private():
    trust.private_group.cache_clear()
    assert not trust.private_group(987654, os.getuid())


def test_a_symlink_is_called_a_symlink(tmp_path):
    root = fake_checkpoint(tmp_path)
    shard = root / "step00000003" / "mp_rank_00_model_states.pt"
    target = tmp_path / "elsewhere.pt"
    shard.rename(target)
    shard.symlink_to(target)
    error = _refused(tmp_path)
    assert "symbolic link" in str(error) and "writable by every user" not in str(error)


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_a_file_of_another_user_is_refused(tmp_path):
    root = fake_checkpoint(tmp_path)
    os.chown(root / "step00000003" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 4242, 4242)
    assert "belongs to uid 4242" in str(_refused(tmp_path))


def test_load_checks_before_unpickling(tmp_path):
    root = fake_checkpoint(tmp_path)
    (root / "step00000003" / "dsforge_rng_rank00001.pt").unlink()

    class NeverLoads:
        def load_checkpoint(self, *args, **kwargs):
            raise AssertionError("unpickled an incomplete checkpoint")

    with pytest.raises(CheckpointError, match="CK4"):
        checkpoint.load(NeverLoads(), root, "step00000003", rank=0)
    check_safe_to_load(root, "step00000003")  # the files that are there are safe


def test_save_records_every_file_and_its_size(tmp_path, monkeypatch):
    """The marker lists what every rank wrote (listed by rank 0 after the barrier): the
    layout-free state and the RNG files, nothing of DeepSpeed's (the state is written once).
    A directory an earlier save of the same step left incomplete is emptied first: its files
    would be listed, and read on resume."""
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)

    class Engine:
        module = torch.nn.Linear(2, 2)

        def save_checkpoint(self, *args, **kwargs):
            raise AssertionError("DeepSpeed's engine files are not written")

    def write_snapshot(snapshot, directory, parts=None, progress=None):
        (directory / "dsforge_state").mkdir()
        (directory / "dsforge_state" / "rank00000.safetensors").write_bytes(b"x" * 7)

    monkeypatch.setattr(Engine.module, "chunks", [], raising=False)
    monkeypatch.setattr(checkpoint, "snapshot_state",
                        lambda *args, **kwargs: SimpleNamespace(copy=lambda staging: None))
    monkeypatch.setattr(checkpoint, "write_snapshot", write_snapshot)
    monkeypatch.setattr(checkpoint, "padded_vocab_of", lambda chunks: 128)
    root = tmp_path / "checkpoints"
    stale = root / "step00000003" / "dsforge_state" / "rank00001.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from a save that died")
    # What Checkpointer.save does on one rank (runtime/loop/checkpointer.py), barriers aside.
    snapshot = checkpoint.take_snapshot(Engine(), root, step=3, world_size=1, rank=0)
    snapshot.state.copy(None)
    checkpoint.write_files(snapshot)
    checkpoint.publish(root, 3, world_size=1, recipe=RECIPE)
    record = latest_complete(root)
    assert set(record["files"]) == {"dsforge_rng_rank00000.pt", "dsforge_state/rank00000.safetensors"}
    assert record["files"]["dsforge_state/rank00000.safetensors"] == 7 and not stale.exists()
    check_complete(root, record)
    # A complete one of another trajectory (`latest` set back by hand) claims nothing while
    # the step is saved again, and keeps none of its files.
    (root / "step00000003" / "from_another_layout.pt").write_bytes(b"old")
    again = checkpoint.take_snapshot(Engine(), root, step=3, world_size=1, rank=0)
    assert list((root / "step00000003").iterdir()) == []
    again.state.copy(None)
    checkpoint.write_files(again)
    checkpoint.publish(root, 3, world_size=1, recipe=RECIPE)
    assert "from_another_layout.pt" not in latest_complete(root)["files"]
