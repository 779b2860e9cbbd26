"""A rank's checkpoints during a run: resuming from the newest complete one, saving after a
step, and pruning the oldest (train.keep_last). The format, the files and the trust checks are
runtime/checkpoint/save_load.py's and ckpt/'s; this part decides when a save may happen, who
writes it and when it is published, and says what went wrong in the user's terms.

With `train.checkpoint_async` a save hardly stops training: a background writer
(runtime/checkpoint/writer.py) copies each rank's state into host memory while the next step's
forward and backward run (the optimizer step waits for the copy: runtime/checkpoint/staging.py)
and then writes the files while the next steps train. At most one save is in flight. It is
published (the completion marker, then `latest`, then the pruning) once every rank has written
its files: each step's all-reduce carries whether a rank is still writing
(runtime/guard/health.py `reduce_step`), so no collective is added. A save the run must end on
(the last step's, a stop's) is written in the training thread after the one in flight is
published; a run that ends otherwise (halted, or stopped right after a periodic save)
publishes the one in flight first (`finish`). A rank that fails leaves its save unpublished:
invisible.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from dsforge.ckpt.trust import (CheckpointError, latest_complete, listing, resumed_changes,
                                tag_for)
from dsforge.job.console import RankConsole
from dsforge.job.run_dir import RunDir
from dsforge.recipe import Resolved
from dsforge.runtime.checkpoint import save_load
from dsforge.runtime.checkpoint.staging import Staging, StepGate, staging_budget
from dsforge.runtime.checkpoint.stream_file import Progress
from dsforge.runtime.checkpoint.writer import BackgroundWriter
from dsforge.runtime.guard import health
from dsforge.runtime.guard.record import passing_kind
from dsforge.runtime.guard.watchdog import waiting_for
from dsforge.runtime.loop.bad_steps import Halted
from dsforge.units import format_bytes


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
        self.writer = BackgroundWriter() if resolved.recipe.train.checkpoint_async else None
        # A background save's host buffers, kept from one save to the next (at most one in
        # flight: a snapshot is written before the next is taken); made at the first save.
        self.staging: Staging | None = None
        self._gate: StepGate | None = None  # holds the optimizer until the save is copied
        self.in_flight: int | None = None  # steps_done of the save not yet published
        self._started: float | None = None  # when the save in flight was started (monotonic)
        self._budget: int | None = None  # bytes a save may stage (staging.staging_budget)
        self._said_parts = False
        self._progress = Progress()  # the bytes of the newest save on this rank's disk
        self.slowest_s: float | None = None  # the longest save yet, snapshot to published
        self.saves: list[dict] = []  # what each save of this rank cost (`measured`)

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

    def save(self, steps_done: int, *, after_bad_step: bool, fault=None,
             final: bool = False) -> bool | Halted:
        """The checkpoint of `steps_done` steps: True when written, or (in the background)
        being written; False right after a bad step (its update was dropped: a resume must
        not start inside a run of bad steps); `Halted` when a weight on some rank is not finite
        (the run stops there). `final`: the run ends on it, so it is written and published
        before this returns. Every rank calls it; `fault` is the drill that dies, or signals,
        while saving."""
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
        stopped = time.monotonic()
        self.finish()  # at most one in flight: the one before is published first
        with self._saving(steps_done):
            self._started = time.monotonic()
            snapshot = self._snapshot(steps_done)
            in_background = self.writer is not None and not final
            cost = {"step": steps_done, "bytes": snapshot.state.nbytes,
                    "in_background": in_background}
            self.saves.append(cost)
            self._progress = Progress()
            staging = self._staging()
            if not in_background:
                with waiting_for(f"its disk to take the checkpoint of step {steps_done}",
                                 self._progress):
                    self._stage_and_write(snapshot, staging, fault, cost, on_copied=None)
                self._wait_for_peers(steps_done)
                self._publish(steps_done)
            else:  # copied and written by the writer; the optimizer's next step waits for the copy
                gate = self._gate = StepGate(snapshot.state.optimizer, steps_done,
                                             progress=self._progress)
                self.writer.submit(lambda: self._stage_and_write(snapshot, staging, fault, cost,
                                                                 on_copied=gate.open))
                self.in_flight = steps_done
            cost["stall_s"] = time.monotonic() - stopped  # the training thread's wait, so far
        return True

    def measured(self) -> dict | None:
        """What this rank's saves cost (summary.json's `checkpoints`), the saves written in the
        background and those written in the training loop apart: how many, the medians of the
        loop's stall (its wait for the save before included), the snapshot and the write, the
        bytes a save and the rate its files were written at."""
        written = [c for c in self.saves if "write_s" in c]
        if not written:
            return None
        return {where: _medians([c for c in written if c["in_background"] == background])
                for where, background in (("background", True), ("foreground", False))}

    def writing(self) -> bool:
        """Whether this rank has not (successfully) written its files of the save in flight:
        its part of each step's all-reduce."""
        return self.in_flight is not None and not self.writer.succeeded()

    def after_step(self, ranks_writing: int) -> None:
        """After each step's all-reduce (`ranks_writing`: the ranks whose `writing()` was
        true): this rank's writer's error is raised here; once no rank is writing, the save in
        flight is published."""
        self._close_gate()
        if self.in_flight is None:
            return
        with self._saving(self.in_flight):
            if not self.writer.busy():
                self.writer.wait()  # raises what the writer raised
            if ranks_writing == 0:
                self._publish(self.in_flight)

    def finish(self) -> None:
        """The save in flight written on every rank and published (a collective: every rank
        calls it at the same point, before a save and when the run ends)."""
        if self.in_flight is None:
            return
        step = self.in_flight
        with self._saving(step):
            with waiting_for(f"its checkpoint writer to write the checkpoint of step {step} "
                             "(a slow or hung disk?)", self._progress):
                self.writer.wait()
            self._close_gate()
            self._wait_for_peers(step)
            self._publish(step)

    def _wait_for_peers(self, steps_done: int) -> None:
        """Until every rank's files of the save are on disk; its deadline moves on while the
        checkpoint's files grow (a peer that writes more than this rank, or more slowly)."""
        directory = self.run_dir.checkpoints / tag_for(steps_done)
        with waiting_for(f"the other ranks to write the checkpoint of step {steps_done}",
                         lambda: sum(listing(directory).values())):
            torch.distributed.barrier()

    @contextlib.contextmanager
    def _saving(self, steps_done: int) -> Iterator[None]:
        """What goes wrong while saving, in the user's terms: a peer lost while the ranks
        waited for each other is not this rank's disk (`dsforge run` names the rank that was
        lost, job/who_failed.py)."""
        try:
            yield
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, CheckpointError) or passing_kind(exc) == "device":
                raise
            if passing_kind(exc) == "collective":
                raise CheckpointError(
                    f"lost a peer rank while saving the checkpoint of step {steps_done}; the "
                    f"previous complete checkpoint stays the latest ({_first_line(exc)})") from exc
            raise self._disk_error(steps_done, exc) from exc

    def _snapshot(self, steps_done: int) -> save_load.Snapshot:
        return save_load.take_snapshot(self.engine, self.run_dir.checkpoints, step=steps_done,
                                       world_size=self.resolved.layout.world_size,
                                       rank=self.rank)

    def _close_gate(self) -> None:
        """Once the save in flight is copied: its gate off the optimizer, and the time the
        optimizer step waited for the copy into the save's stall."""
        if self._gate is not None and self._gate.copied.is_set():
            self._gate.close()
            self.saves[-1]["stall_s"] += self._gate.waited_s
            self._gate = None

    def _staging(self) -> Staging:
        """Where the snapshot is copied: a background save's buffers, kept from one save to
        the next, or (a run that saves in the foreground) buffers of this save only, so no
        host memory stays held between saves. The budget is taken at the first save."""
        if self._budget is None:
            self._budget = staging_budget(self.resolved.recipe.train.staging_bytes,
                                          local_ranks=int(os.environ.get("LOCAL_SIZE", 1)))
        if self.writer is None:
            return Staging(self._budget)
        if self.staging is None:
            self.staging = Staging(self._budget)
        return self.staging

    def _stage_and_write(self, snapshot: save_load.Snapshot, staging: Staging, fault,
                         cost: dict, on_copied) -> None:
        """Copy the snapshot into host memory (whole, or in parts each written before the next
        is copied) and write its files; `on_copied()` once all is copied (the optimizer may
        step then), and whatever happens."""
        started = time.monotonic()

        def copied() -> None:
            cost["snapshot_s"] = time.monotonic() - started
            if on_copied is not None:
                on_copied()

        state = snapshot.state
        try:
            parts = None
            if staging.holds(state.nbytes):
                state.copy(staging)
                copied()
            else:
                self._say_parts(state.nbytes, staging.budget_bytes)
                parts = staging.parts(state.tensors, state.ready, copied)
            self._write(snapshot, fault, cost, parts)
        finally:
            if on_copied is not None:
                on_copied()

    def _say_parts(self, nbytes: int, budget: int) -> None:
        if self.rank == 0 and not self._said_parts:
            self._said_parts = True
            self.console.say(
                f"dsforge: a save stages rank 0's {format_bytes(nbytes)} of state in parts of "
                f"{format_bytes(budget)} (train.checkpoint_staging_gb): the optimizer step "
                "waits until all but the last part are written")

    def _write(self, snapshot: save_load.Snapshot, fault, cost: dict, parts) -> None:
        """The snapshot's files (in the training thread, or the writer's: no collective);
        their time into `cost` (with the parts' copies, where it is staged in parts)."""
        started = time.monotonic()
        try:
            save_load.write_files(snapshot, fault, parts=parts, progress=self._progress)
        except (OSError, RuntimeError) as exc:
            raise self._disk_error(snapshot.step, exc) from exc
        cost["write_s"] = time.monotonic() - started

    def _disk_error(self, steps_done: int, exc: BaseException) -> CheckpointError:
        # torch's serializer reports a full disk as "basic_ios::clear", without a path.
        root = self.run_dir.checkpoints
        return CheckpointError(
            f"could not write the checkpoint of step {steps_done} under {root}: {exc}. Is the "
            f"disk full? (df -h {root}); the previous complete checkpoint stays the latest")

    def _publish(self, steps_done: int) -> None:
        """Rank 0 writes the marker and moves `latest`, then prunes; every rank forgets the save
        in flight (they all know every rank's files are written)."""
        if self.rank == 0:
            save_load.publish(self.run_dir.checkpoints, steps_done,
                              world_size=self.resolved.layout.world_size,
                              recipe=asdict(self.resolved.recipe))
            self._prune()
        self.in_flight = None
        seconds = time.monotonic() - self._started
        self.slowest_s = max(seconds, self.slowest_s or 0.0)

    def _prune(self) -> None:
        """With train.keep_last, rank 0 deletes the complete checkpoints beyond the newest
        keep_last (ckpt/retention.py)."""
        keep_last = self.resolved.recipe.train.keep_last
        if keep_last:
            from dsforge.ckpt.retention import prune

            prune(self.run_dir.checkpoints, keep_last,
                  warn=lambda text: self.console.say(f"dsforge: warning: {text}"))


def _medians(costs: list[dict]) -> dict | None:
    if not costs:
        return None
    median = {key: statistics.median(c[key] for c in costs)
              for key in ("stall_s", "snapshot_s", "write_s")}
    nbytes = costs[-1]["bytes"]
    rate = nbytes / median["write_s"] / 1e9 if median["write_s"] > 0 else None
    return {"saves": len(costs), **median, "bytes": nbytes, "write_gbps": rate}


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
