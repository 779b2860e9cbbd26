"""A rank's checkpoints during a run: resuming from the newest complete one, saving after a
step, and pruning the oldest (train.keep_last). The format, the files and the trust checks are
runtime/checkpoint/save_load.py's and ckpt/'s; this part decides when a save may happen and
says what went wrong in the user's terms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dsforge.ckpt.trust import CheckpointError, latest_complete, resumed_changes
from dsforge.job.console import RankConsole
from dsforge.job.run_dir import RunDir
from dsforge.recipe import Resolved
from dsforge.runtime.checkpoint import save_load
from dsforge.runtime.guard import health
from dsforge.runtime.guard.record import passing_kind
from dsforge.runtime.loop.bad_steps import Halted


@dataclass(frozen=True)
class Resumed:
    """What a resumed run continued: the manifest's `resumed`."""

    after_step: int  # steps done in the checkpoint: the first step this run trains
    checkpoint: str  # its tag
    changes: list[str]  # the recipe's changes since it was written (ckpt/trust.py)


class Checkpointer:
    def __init__(self, engine, resolved: Resolved, *, run_dir: RunDir, device: torch.device,
                 console: RankConsole, rank: int):
        self.engine, self.resolved, self.run_dir = engine, resolved, run_dir
        self.device, self.console, self.rank = device, console, rank

    def resume(self) -> Resumed:
        """Load the newest complete checkpoint into the engine (on this layout or, through the
        layout-free state, on another) and continue its learning-rate schedule."""
        root = self.run_dir.checkpoints
        record = latest_complete(root)
        if record is None:
            raise CheckpointError(f"no complete checkpoint under {root}")
        recipe = asdict(self.resolved.recipe)
        step = save_load.load(self.engine, root, record["tag"], self.rank, recipe=recipe,
                              world_size=self.resolved.layout.world_size,
                              say=self.console.say if self.rank == 0 else None)
        line = save_load.continue_schedule(self.engine, self.resolved.recipe.train,
                                           record["recipe"].get("train") or {})
        if line and self.rank == 0:
            self.console.say(line)
        return Resumed(after_step=step, checkpoint=record["tag"],
                       changes=resumed_changes(record["recipe"], recipe))

    def save(self, steps_done: int, *, after_bad_step: bool, fault=None) -> bool | Halted:
        """The checkpoint of `steps_done` steps, then the pruning: True when written; False
        right after a bad step (its update was dropped: a resume must not start inside a run
        of bad steps); `Halted` when a weight on some rank is not finite (the run stops there).
        Every rank calls it; `fault` is the drill that dies while saving."""
        if after_bad_step:
            if self.rank == 0:
                self.console.say(f"dsforge: no checkpoint after step {steps_done}: the update "
                                 "of its last step was skipped (non-finite); `latest` stays")
            return False
        bad_ranks = health.ranks_where(not health.weights_finite(self.engine.module), self.device)
        if bad_ranks:
            return Halted(step=steps_done - 1, kind="weights", ranks=bad_ranks,
                          what=f"non-finite weights before the save of step {steps_done}"
                               "; the checkpoint was not written")
        self._write(steps_done, fault)
        self._prune()
        return True

    def _write(self, steps_done: int, fault) -> None:
        root = self.run_dir.checkpoints
        try:
            save_load.save(self.engine, root, step=steps_done, recipe=asdict(self.resolved.recipe),
                           world_size=self.resolved.layout.world_size, rank=self.rank,
                           fault=fault)
        except (OSError, RuntimeError) as exc:
            if passing_kind(exc) == "collective":
                # A peer died or left while the ranks waited for each other's files: not this
                # rank's disk. `dsforge run` names the rank that was lost (job/who_failed.py).
                raise CheckpointError(
                    f"lost a peer rank while saving the checkpoint of step {steps_done}; the "
                    f"previous complete checkpoint stays the latest ({_first_line(exc)})") from exc
            # torch's serializer reports a full disk as "basic_ios::clear", without a path.
            raise CheckpointError(
                f"could not write the checkpoint of step {steps_done} under {root}: {exc}. Is the "
                f"disk full? (df -h {root}); the previous complete checkpoint stays the latest"
            ) from exc

    def _prune(self) -> None:
        """With train.keep_last, rank 0 deletes the complete checkpoints beyond the newest
        keep_last (ckpt/retention.py)."""
        keep_last = self.resolved.recipe.train.keep_last
        if keep_last and self.rank == 0:
            from dsforge.ckpt.retention import prune

            prune(self.run_dir.checkpoints, keep_last,
                  warn=lambda text: self.console.say(f"dsforge: warning: {text}"))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
