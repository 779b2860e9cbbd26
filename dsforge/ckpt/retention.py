"""train.keep_last: keep the newest N complete checkpoints, delete the older ones.

Rank 0 prunes right after it published a checkpoint as `latest`. It deletes only what it can
prove is an older complete checkpoint: a plain directory named stepNNNNNNNN whose completion
marker reads (runtime/checkpoint/save_load.py `read_marker`) with a step below the one `latest` names.
Never the checkpoint `latest` names, never a directory without its marker (a save in progress
or one that died), never anything else under checkpoints/ (DeepSpeed's zero_to_fp32.py and
zero_to_torch.py, the `latest` file). The marker goes first, so a deletion cut short leaves an
incomplete directory that no resume takes, not a damaged "complete" one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from dsforge.ckpt.format import COMPLETE
from dsforge.ckpt.trust import (CheckpointError, complete_checkpoints, read_latest, read_marker,
                                tag_for)


def to_delete(root: Path, keep_last: int) -> list[str]:
    """The tags pruning would delete (oldest first): complete checkpoints older than the one
    `latest` names, beyond the newest keep_last (which count `latest`). None when keep_last is
    0 or nothing is published. By `latest` itself: a newer save whose publish was cut short
    (trust.newest_published, which a resume takes) is newer still, and never deleted."""
    if keep_last <= 0:
        return []
    try:
        latest = read_latest(root)
        latest_step = read_marker(root, latest)["step"] if latest else None
    except (CheckpointError, OSError):
        return []  # latest unreadable: delete nothing
    if latest_step is None:
        return []
    older = sorted(step for step in complete_checkpoints(root) if step < latest_step)
    keep = keep_last - 1  # latest is one of the kept
    return [tag_for(step) for step in (older[:-keep] if keep else older)]


def prune(root: Path, keep_last: int, warn: Callable[[str], None] | None = None) -> list[str]:
    """Delete what `to_delete` names; returns the tags deleted. A failure to delete one is
    reported through `warn` and does not stop training."""
    deleted = []
    for tag in to_delete(root, keep_last):
        directory = root / tag
        try:
            (directory / COMPLETE).unlink()
            shutil.rmtree(directory)
        except OSError as exc:
            if warn is not None:
                warn(f"train.keep_last: could not delete {directory}: {exc}")
            continue
        deleted.append(tag)
    return deleted
