"""Which checkpoints may be resumed: complete, untampered, of this run (torch-free).

`dsforge run --resume` checks before any rank starts; each rank checks again before it loads
(runtime/checkpoint/save_load.py). Everything DeepSpeed loads is a pickle, so before anything
is unpickled the checkpoint's files must belong to the current user and must not be writable
by others (`check_safe_to_load`). `latest` must hold a plain tag (stepNNNNNNNN) of a directory
beside it, the completion marker must be whole JSON, and every file listed in it must be there
with the size it was saved with (`check_complete`), so a resume is refused before any rank
starts rather than by ranks dying mid-load. Rule ids CK1-CK4: docs/validation.md.
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
import re
import stat
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

from dsforge.ckpt.format import COMPLETE, LATEST, STATE_DIR, rng_file
from dsforge.job.run_dir import RunDir
from dsforge.problems import Problem, shorten
from dsforge.schema import Recipe

# Recipe fields a resumed run may change. Everything else must match.
# Evaluation settings and where the data's indices are cached change no training step either,
# nor where the weights came from: the checkpoint's weights replace model.init_from's.
# The kernels, attention backend and the way experts run compute the same model with the same
# parameters (runtime/assemble/kernels.py, layers.py, grouped_moe.py).
# What the guard does with a bad step changes only steps it finds bad (runtime/guard/health.py).
# Compiling the layers runs the same operations (runtime/assemble/compile.py); float8 GEMMs keep
# the weights bf16 parameters and their dynamic scales no state (runtime/assemble/fp8.py), so a
# run may go between bf16 and fp8, compiled and eager.
# train.steps continues a run: the schedule then spans the new total unless
# train.lr_decay_steps holds it to the old one (`schedule_change` says which).
RESUMABLE_CHANGES = {"train.timing_warmup", "train.checkpoint_every", "train.checkpoint_async",
                     "train.checkpoint_staging_gb", "train.eval_every", "train.eval_iters",
                     "data.cache_dir", "train.time_limit", "train.keep_last",
                     "model.init_from", "model.kernels", "model.sdpa_backend",
                     "model.moe.experts", "model.compile", "train.fp8",
                     "train.steps", "train.lr_decay_steps", "train.on_nonfinite",
                     "train.max_consecutive_skips", "train.spike_factor", "train.spike_window",
                     "train.on_spike"}
# How the job is split may change on resume too (with the same global batch): the checkpoint's
# layout-free state (dsforge/ckpt) is read back onto the new layout.
LAYOUT_SECTIONS = ("parallel", "zero")
LAYOUT_FIELDS = {"train.micro_batch", "train.grad_accum"}


_TAG = re.compile(rb"step[0-9]{8}")
_MAX_MARKER_BYTES = 1 << 20  # the marker holds the resolved recipe: a few KB


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed; `problem` (when set) names the file, the rule, why
    and the fix."""

    def __init__(self, message: str | Problem):
        self.problem = message if isinstance(message, Problem) else None
        super().__init__(str(message))


def _refuse(rule: str, path: Path, message: str, fix: str) -> CheckpointError:
    return CheckpointError(Problem(rule=rule, fields={"file": str(path)}, message=message, fix=fix))


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def listing(directory: Path) -> dict[str, int]:
    """Every file of a checkpoint directory (relative path -> bytes), as the marker records it
    for check_complete."""
    return {str(path.relative_to(directory)): path.stat().st_size
            for path in sorted(directory.rglob("*"))
            if path.is_file() and path.name != COMPLETE and not path.name.endswith(".partial")}


def latest_complete(root: Path) -> dict[str, Any] | None:
    """The completion record of the newest published checkpoint, or None when nothing was
    published (reads `latest` and JSON only; CheckpointError when either is unusable)."""
    tag = newest_published(root)
    return None if tag is None else read_marker(root, tag)


def newest_published(root: Path) -> str | None:
    """The tag of the checkpoint a resume takes: the one `latest` names, or a newer one whose
    publish was cut short. Rank 0 publishes a save by writing its completion marker and then
    `latest` (runtime/checkpoint/save_load.publish); killed between the two, the save is
    complete and `latest` still names the one before. Such a marker was written after
    `latest` was. A `latest` written by hand to go back to an earlier checkpoint is newer than
    every marker, so going back still works."""
    tag = read_latest(root)
    since = (root / LATEST).stat().st_mtime_ns if tag is not None else -1
    step = int(tag[len("step"):]) if tag is not None else -1
    for newer, newer_tag in sorted(complete_checkpoints(root).items(), reverse=True):
        try:
            if newer > step and (root / newer_tag / COMPLETE).stat().st_mtime_ns > since:
                return newer_tag
        except OSError:
            continue
    return tag


def complete_checkpoints(root: Path) -> dict[int, str]:
    """step -> tag of every directory under `root` that holds a readable completion marker
    for its own name, oldest first."""
    found = {}
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        try:
            if not _TAG.fullmatch(os.fsencode(entry.name)) or not stat.S_ISDIR(entry.lstat().st_mode):
                continue
            record = read_marker(root, entry.name)
        except (CheckpointError, OSError):
            continue
        if tag_for(record["step"]) == entry.name:
            found[record["step"]] = entry.name
    return found


def read_latest(root: Path) -> str | None:
    """The tag `latest` names (CK1): a plain stepNNNNNNNN, so it can only name a directory
    beside it, never ../../another-run/checkpoints/..."""
    pointer = root / LATEST
    try:
        info = pointer.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise _refuse("CK1", pointer, f"is a {_kind(info)}, not a file holding a tag",
                      f"remove it and write the tag of a complete checkpoint under {root} into "
                      "a plain file (e.g. step00000006)")
    with open(pointer, "rb") as f:
        data = f.read(64)
    if not _TAG.fullmatch(data.strip()):
        raise _refuse("CK1", pointer,
                      f"holds {shorten(data[:24])}{'...' if len(data) > 24 else ''}, not the "
                      "tag of a checkpoint in this directory "
                      "(stepNNNNNNNN: no path, nothing else)",
                      f"write the tag of a complete checkpoint under {root} into it "
                      f"(a directory with {COMPLETE}), or start a new run")
    return data.strip().decode()


def read_marker(root: Path, tag: str) -> dict[str, Any]:
    """The completion record of checkpoint `tag` (CK3): whole JSON with its step, tag, world
    size, recipe and (since dsforge records them) the files and their sizes."""
    directory, pointer = root / tag, root / LATEST
    try:
        info = directory.lstat()
    except FileNotFoundError:
        raise _refuse("CK1", pointer, f"names {tag}, which does not exist under {root}",
                      "write the tag of a complete checkpoint into it, or start a new run") from None
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse("CK1", pointer, f"names {tag}, which is a {_kind(info)}, not a checkpoint "
                      "directory", "write the tag of a complete checkpoint into it")
    marker = directory / COMPLETE
    try:
        info = marker.lstat()
    except FileNotFoundError:
        raise _refuse("CK3", marker, f"is missing: latest names {tag}, whose save never finished",
                      "write the tag of an earlier complete checkpoint into latest, or start a "
                      "new run") from None
    fix = ("the marker is written last and atomically by dsforge, so this one was changed "
           "afterwards: restore it, or write an earlier complete checkpoint's tag into latest")
    if not stat.S_ISREG(info.st_mode):
        raise _refuse("CK3", marker, f"is a {_kind(info)}, not a file", fix)
    if info.st_size > _MAX_MARKER_BYTES:
        raise _refuse("CK3", marker, f"is {info.st_size:,} bytes, far more than a marker", fix)
    try:
        record = json.loads(marker.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse("CK3", marker, f"is not whole JSON ({shorten(str(exc))}): cut short?",
                      fix) from None
    problem = _marker_problem(record, tag)
    if problem:
        raise _refuse("CK3", marker, problem, fix)
    return record


def _marker_problem(record: Any, tag: str) -> str:
    """What is wrong with a parsed completion record, or ''."""
    if not isinstance(record, dict):
        return "does not hold a JSON object"
    if record.get("tag") != tag:
        return f"records tag {shorten(record.get('tag'))}, not {tag}"
    for key, minimum in (("step", 0), ("world_size", 1)):
        value = record.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            return f"records {key} {shorten(value)}, not a whole number >= {minimum}"
    recipe = record.get("recipe")
    if not isinstance(recipe, dict) or not all(isinstance(v, (dict, type(None)))
                                               for k, v in recipe.items() if k != "name"):
        return "does not record the recipe as sections of fields"
    files = record.get("files", {})
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and _inside(name) and isinstance(size, int)
            for name, size in files.items()):
        return "does not record its files as relative paths inside the checkpoint with sizes"
    return ""


def _inside(name: str) -> bool:
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _kind(info: os.stat_result) -> str:
    if stat.S_ISLNK(info.st_mode):
        return "symbolic link"
    if stat.S_ISDIR(info.st_mode):
        return "directory"
    return "regular file" if stat.S_ISREG(info.st_mode) else "special file"


def check_safe_to_load(root: Path, tag: str) -> None:
    """Refuse checkpoints written by another user, holding symbolic links, or writable by
    others (CK2), before anything is unpickled. Group-writable files are refused unless the
    group is the user's private group (see private_group)."""
    uid = os.getuid()
    pointer = root / LATEST
    latest = [pointer] if pointer.is_symlink() or pointer.exists() else []
    for path in [root, *latest, root / tag, *sorted((root / tag).rglob("*"))]:
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            raise _refuse("CK2", path, "is a symbolic link; dsforge does not follow links out "
                          "of a checkpoint", "replace it with the file itself if you trust it")
        if info.st_uid != uid:
            raise _refuse("CK2", path, f"belongs to uid {info.st_uid}, not to you (uid {uid}); "
                          "dsforge does not unpickle other users' checkpoints",
                          "copy the checkpoint into a run directory of your own if you trust it")
        if info.st_mode & stat.S_IWOTH:
            raise _refuse("CK2", path, "is writable by every user; anyone could have replaced it",
                          f"chmod -R o-w {root} if you trust its contents")
        if info.st_mode & stat.S_IWGRP and not private_group(info.st_gid, uid):
            raise _refuse("CK2", path, f"is writable by group {_group_name(info.st_gid)}, which "
                          "is not your private group: its other members could have replaced it",
                          f"chmod -R g-w {root} if you trust its contents")


@lru_cache(maxsize=None)
def private_group(gid: int, uid: int) -> bool:
    """Whether only user `uid` belongs to group `gid`: it is the user's primary group, lists
    no other member, and is no other account's primary group (the user-private-group scheme,
    where umask 002 makes files group-writable). Unknown groups or users are not private."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    if user.pw_gid != gid or set(group.gr_mem) - {user.pw_name}:
        return False
    return not any(other.pw_gid == gid and other.pw_uid != uid for other in pwd.getpwall())


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def check_complete(root: Path, record: dict[str, Any]) -> None:
    """CK4: every file checkpoint `record` was saved with is there with its recorded size
    (DeepSpeed's model and optimizer states for every rank, dsforge's RNG and expert files),
    so a resume is refused before any rank starts. A marker that lists no files (dsforge
    before it recorded them) is checked for one non-empty RNG file per rank and no empty file."""
    directory = root / record["tag"]
    if "files" in record:
        expected = dict(record["files"])
    else:
        expected = {rng_file(rank): None for rank in range(record["world_size"])}
        expected.update({name: None for name in listing(directory)})
    wrong = []
    for name, size in expected.items():
        try:
            actual = (directory / name).lstat().st_size
        except FileNotFoundError:
            wrong.append(f"{name} (missing)")
            continue
        if actual == 0 or (size is not None and actual != size):
            wrong.append(f"{name} ({actual} bytes, saved with {size})" if size is not None
                         else f"{name} (empty)")
    if wrong:
        shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise _refuse("CK4", directory,
                      f"{len(wrong)} of the {len(expected)} files this checkpoint was saved with "
                      f"are missing or changed: {shown}",
                      "restore them, or write the tag of an earlier complete checkpoint into "
                      f"{root / LATEST}, or start a new run")


def recipe_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'section.field: saved -> current' for every difference a resume must not have."""
    return [line for name, line in _differences(saved, current)
            if name not in RESUMABLE_CHANGES and not _is_layout(name)]


def layout_changes(saved: dict[str, Any], current: dict[str, Any], saved_world: int,
                   world: int) -> list[str]:
    """The differences in how the job is split (LAYOUT_SECTIONS, LAYOUT_FIELDS, world size)."""
    changes = [line for name, line in _differences(saved, current) if _is_layout(name)]
    if saved_world != world:
        changes.append(f"world size: {saved_world} in the checkpoint, {world} now")
    return changes


def _is_layout(name: str) -> bool:
    return name.split(".")[0] in LAYOUT_SECTIONS or name in LAYOUT_FIELDS


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, str]]:
    # The saved recipe went through JSON: compare like with like (a blend's tuple is a list).
    saved, current = json.loads(json.dumps(saved)), json.loads(json.dumps(current))
    differences = []
    for section in ("model", "parallel", "zero", "train", "data"):
        # A field the saving dsforge did not have yet held its default there.
        written = {**_defaults(section), **(saved.get(section) or {})}
        for key in sorted(set(saved.get(section) or {}) | set(current.get(section) or {})):
            old, new = written.get(key), (current.get(section) or {}).get(key)
            differences += _changed(f"{section}.{key}", old, new)
    return differences


def _changed(name: str, old: Any, new: Any) -> list[tuple[str, str]]:
    """(name, line) for a field that differs; a sub-section (model.moe) field by field."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [change for key in sorted(set(old) | set(new))
                for change in _changed(f"{name}.{key}", old.get(key), new.get(key))]
    return [] if old == new else [(name, f"{name}: {old!r} in the checkpoint, {new!r} now")]


def _defaults(section: str) -> dict[str, Any]:
    """The recipe section's fields that have a default, with it (as JSON would hold it)."""
    section_class = typing.get_type_hints(Recipe)[section]
    return {f.name: json.loads(json.dumps(f.default)) for f in dataclasses.fields(section_class)
            if f.default is not dataclasses.MISSING}


def check_resumable(run_dir: RunDir, recipe: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The completion record a run of `recipe` on `world_size` ranks can resume from: the
    newest complete checkpoint in `run_dir`, safe to load, of this same model, data and
    schedule. The record's "layout_changes" lists how the layout differs (empty: the same)."""
    root = run_dir.checkpoints
    record = latest_complete(root)
    if record is None:
        raise CheckpointError(
            f"no complete checkpoint under {root}: the run saved none to continue from (it "
            "ran with train.checkpoint_every: 0, or ended before its first save); start it "
            "again in a new --run-dir (or with --resume-or-start in this one), with "
            "train.checkpoint_every: N to make it resumable")
    check_safe_to_load(root, record["tag"])
    check_complete(root, record)
    differences = recipe_differences(record["recipe"], recipe)
    if differences:
        raise CheckpointError(
            "the recipe differs from the checkpoint's in more than may change on resume (the "
            "layout: parallel.*, zero.*, train.micro_batch, train.grad_accum; and "
            + ", ".join(sorted(RESUMABLE_CHANGES)) + "; docs/checkpoints.md):\n  "
            + "\n  ".join(differences))
    steps = (recipe.get("train") or {}).get("steps")
    if steps is not None and record["step"] >= steps:
        raise CheckpointError(
            f"{run_dir} has finished: its newest checkpoint is after step {record['step']} and "
            f"train.steps is {steps}, so nothing is left to train; continue it with a larger "
            f"total (--set train.steps=N, N > {record['step']}), export it (dsforge export "
            f"{run_dir} --to OUT) or start a new run")
    changes = layout_changes(record["recipe"], recipe, record["world_size"], world_size)
    if changes and not (root / record["tag"] / STATE_DIR).is_dir():
        raise CheckpointError(
            f"{root / record['tag']} was saved before dsforge checkpoints kept a layout-free "
            "state, so it resumes only on the layout that wrote it:\n  " + "\n  ".join(changes)
            + "\nresume it once on its own layout and let it save, then change the layout")
    return {**record, "layout_changes": changes,
            "changes": resumed_changes(record["recipe"], recipe)}


def resumed_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What a resume changes besides the layout ('train.steps: 10 in the checkpoint, 20 now'),
    and what that does to the learning-rate schedule."""
    lines = [line for name, line in _differences(saved, current) if name in RESUMABLE_CHANGES]
    schedule = schedule_change(saved.get("train") or {}, current.get("train") or {})
    return lines + ([schedule] if schedule else [])


def schedule_change(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """How the learning-rate schedule's length changes on resume (the train sections as
    dicts), or None. The scheduler's state is only the step it is at: the new length applies
    from the resumed step on, as Megatron-LM's --override-opt_param-scheduler and torchtitan do."""
    before = saved.get("lr_decay_steps") or saved.get("steps")
    after = current.get("lr_decay_steps") or current.get("steps")
    if before == after or current.get("lr_decay") == "constant":
        return None
    return (f"the learning-rate schedule now decays over {after} steps instead of {before}, "
            f"from the resumed step on; set train.lr_decay_steps: {before} to keep the old decay")
