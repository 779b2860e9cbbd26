"""Checkpoints that are complete or invisible, and resume that is exact.

Layout under RUN_DIR/checkpoints/:
  stepNNNNNNNN/                DeepSpeed's engine checkpoint (model, ZeRO-partitioned
                               optimizer, scheduler), one directory per saved step, plus
                               dsforge_rng_rankNNNNN.pt (each rank's RNG states),
                               dsforge_experts_rankNNNNN.pt (expert weights, with expert
                               parallelism), dsforge_state/ (the layout-free state that a
                               resume on another layout reads: dsforge/ckpt, layout_free.py)
                               and, written last, dsforge_complete.json (step, resolved
                               recipe, world size, every file and its size)
  latest                       the tag of the newest complete checkpoint
`latest` moves (atomic rename) only after every rank has finished writing and rank 0 has
written the completion marker, so a crash during a save leaves the previous checkpoint as
latest. Data needs no state: step t always reads the same samples (runtime/data.py).

Everything DeepSpeed loads is a pickle, so before anything is unpickled the checkpoint's files
must belong to the current user and must not be writable by others (`check_safe_to_load`).
`latest` must hold a plain tag (stepNNNNNNNN) of a directory beside it, the completion marker
must be whole JSON, and every file listed in it must be there with the size it was saved with
(`check_complete`), so a resume is refused before any rank starts rather than by ranks dying
mid-load. Rule ids CK1-CK4: docs/validation.md.
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
import random
import re
import stat
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsforge.ckpt.format import COMPLETE, STATE_DIR
from dsforge.ckpt.reader import StateError, open_state
from dsforge.files import write_atomic
from dsforge.problems import Problem, shorten
from dsforge.recipe.schema import Recipe
from dsforge.runtime.layout_free import load_state, write_state

LATEST = "latest"

# Recipe fields a resumed run may change. Everything else must match, train.steps included:
# it is the horizon of the learning-rate schedule that the checkpoint restores.
# Evaluation settings and where the data's indices are cached change no training step either,
# nor where the weights came from: the checkpoint's weights replace model.init_from's.
# The kernels and attention backend compute the same model (runtime/kernels.py, layers.py).
RESUMABLE_CHANGES = {"train.timing_warmup", "train.checkpoint_every", "train.eval_every",
                     "train.eval_iters", "data.cache_dir", "train.time_limit", "train.keep_last",
                     "model.init_from", "model.kernels", "model.sdpa_backend"}
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


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def save(engine, root: Path, *, step: int, recipe: dict[str, Any], world_size: int, rank: int,
         fault=None) -> None:
    """Write the checkpoint of the state after `step` steps on every rank; rank 0 publishes it."""
    tag = tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"dsforge_step": step},
                           save_latest=False)
    torch.save(_rng_state(), root / tag / f"dsforge_rng_rank{rank:05d}.pt")
    write_state(engine, engine.module.chunks, root / tag, rank=rank, world_size=world_size,
                step=step, padded_vocab_size=_padded_vocab(engine.module.chunks))
    experts = _expert_weights(engine.module)
    if experts:
        torch.save(experts, root / tag / f"dsforge_experts_rank{rank:05d}.pt")
    if fault is not None:
        fault(rank, step)  # a drill: die with the files written but not published
    torch.distributed.barrier()  # every rank has finished writing
    if rank == 0:
        write_atomic(root / tag / COMPLETE, json.dumps(
            {"step": step, "tag": tag, "world_size": world_size, "recipe": recipe,
             "files": _listing(root / tag)}, indent=2))
        write_atomic(root / LATEST, tag)
    torch.distributed.barrier()


def _listing(directory: Path) -> dict[str, int]:
    """Every file of a checkpoint directory (relative path -> bytes), as the marker records it
    for check_complete."""
    return {str(path.relative_to(directory)): path.stat().st_size
            for path in sorted(directory.rglob("*"))
            if path.is_file() and path.name != COMPLETE and not path.name.endswith(".partial")}


def latest_complete(root: Path) -> dict[str, Any] | None:
    """The completion record of the newest published checkpoint, or None when nothing was
    published (reads `latest` and JSON only; CheckpointError when either is unusable)."""
    tag = read_latest(root)
    return None if tag is None else read_marker(root, tag)


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
                      "(a directory with dsforge_complete.json), or start a new run")
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
    group is the user's private group (see _private_group)."""
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
        if info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid, uid):
            raise _refuse("CK2", path, f"is writable by group {_group_name(info.st_gid)}, which "
                          "is not your private group: its other members could have replaced it",
                          f"chmod -R g-w {root} if you trust its contents")


@lru_cache(maxsize=None)
def _private_group(gid: int, uid: int) -> bool:
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
        expected = {f"dsforge_rng_rank{rank:05d}.pt": None for rank in range(record["world_size"])}
        expected.update({name: None for name in _listing(directory)})
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
            if old != new:
                differences.append((f"{section}.{key}",
                                    f"{section}.{key}: {old!r} in the checkpoint, {new!r} now"))
    return differences


def _defaults(section: str) -> dict[str, Any]:
    """The recipe section's fields that have a default, with it (as JSON would hold it)."""
    section_class = typing.get_type_hints(Recipe)[section]
    return {f.name: json.loads(json.dumps(f.default)) for f in dataclasses.fields(section_class)
            if f.default is not dataclasses.MISSING}


def check_resumable(run_dir: Path, recipe: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The completion record a run of `recipe` on `world_size` ranks can resume from: the
    newest complete checkpoint in `run_dir`, safe to load, of this same model, data and
    schedule. The record's "layout_changes" lists how the layout differs (empty: the same)."""
    root = checkpoint_root(run_dir)
    record = latest_complete(root)
    if record is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    check_safe_to_load(root, record["tag"])
    check_complete(root, record)
    differences = recipe_differences(record["recipe"], recipe)
    if differences:
        raise CheckpointError("the recipe differs from the checkpoint's in more than the layout "
                              "(parallel.*, zero.*, train.micro_batch, train.grad_accum may "
                              "change; the rest must not):\n  " + "\n  ".join(differences))
    changes = layout_changes(record["recipe"], recipe, record["world_size"], world_size)
    if changes and not (root / record["tag"] / STATE_DIR).is_dir():
        raise CheckpointError(
            f"{root / record['tag']} was saved before dsforge checkpoints kept a layout-free "
            "state, so it resumes only on the layout that wrote it:\n  " + "\n  ".join(changes)
            + "\nresume it once on its own layout and let it save, then change the layout")
    return {**record, "layout_changes": changes}


def load(engine, root: Path, tag: str, rank: int, *, recipe: dict[str, Any] | None = None,
         world_size: int | None = None, say=None) -> int:
    """Restore engine and RNG state; returns the number of steps already done. When `recipe`
    and `world_size` split the job differently from the checkpoint's, the layout-free state
    is read onto this layout (runtime/layout_free.py) and `say` (rank 0's console, or None)
    is told how."""
    record = read_marker(root, tag)
    check_safe_to_load(root, tag)
    check_complete(root, record)
    changes = [] if recipe is None else layout_changes(record["recipe"], recipe,
                                                       record["world_size"], world_size)
    if changes:
        return _load_on_new_layout(engine, root, tag, record, changes, say)
    _, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None or "dsforge_step" not in client:
        raise CheckpointError(f"{root / tag}: DeepSpeed found no dsforge state in the checkpoint")
    rng = torch.load(root / tag / f"dsforge_rng_rank{rank:05d}.pt", weights_only=True)
    _set_rng_state(rng)
    _restore_expert_weights(engine.module, root / tag / f"dsforge_experts_rank{rank:05d}.pt")
    return int(client["dsforge_step"])


def _load_on_new_layout(engine, root: Path, tag: str, record: dict[str, Any],
                        changes: list[str], say) -> int:
    try:
        notes = load_state(engine, engine.module.chunks, open_state(root / tag))
    except StateError as exc:
        raise CheckpointError(f"cannot resume {root / tag} on a new layout: {exc}") from exc
    # RNG streams belong to ranks; on another layout rank r is another part of the model. No
    # training step draws random numbers (no dropout; data is indexed by step), so the
    # seeded streams of this job serve as well.
    if say is not None:
        say(f"dsforge: continuing {tag} on a new layout ({'; '.join(changes)})")
        for note in notes:
            say(f"dsforge: note: {note}")
    return int(record["step"])


def _padded_vocab(chunks) -> int:
    """The vocabulary the model was built with: dsforge passes Megatron the padded size."""
    return int(chunks[0].vocab_size)


def _expert_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Expert weights of this rank. DeepSpeed writes model weights from data-parallel rank 0
    only, but with expert parallelism the data-parallel ranks hold different experts (and
    DeepSpeed's own expert files exist only for its own MoE layer class)."""
    from dsforge.runtime.grads import is_expert

    return {name: p.detach().cpu().clone() for name, p in module.named_parameters() if is_expert(p)}


def _restore_expert_weights(module: torch.nn.Module, path: Path) -> None:
    """The optimizer's fp32 copies come back from each rank's own ZeRO file; the weights the
    next forward uses must come from the rank's own expert file too."""
    if not path.exists():
        return
    saved = torch.load(path, weights_only=True)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)


def _rng_state() -> dict[str, Any]:
    """Every RNG a rank uses, as tensors and plain values (loadable with weights_only=True)."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
