"""The training loop (dsforge.runtime.loop.trainer.train_loop) against a Trainer stand-in that
records its calls (tests/unit/helpers/recording_trainer.py): resume, saves every n steps,
evaluation, and the rank's hooks."""

from __future__ import annotations

from dsforge.runtime.guard.preempt import Stopped
from dsforge.runtime.loop.bad_steps import Halted
from dsforge.runtime.loop.trainer import train_loop
from tests.unit.helpers.recording_trainer import RecordingTrainer


def test_train_loop_resumes_saves_every_n_and_runs_the_rank_hooks():
    trainer = RecordingTrainer(steps=7, every=3, start_step=2)
    drill = object()
    train_loop(trainer, before_step=lambda step: trainer.calls.append(("before", step)),
               after_steps=lambda: trainer.calls.append(("after",)), save_fault=drill)
    assert trainer.calls == [
        ("before", 2), ("step", 2), ("save", 3, drill), ("before", 3), ("step", 3),
        ("before", 4), ("step", 4), ("before", 5), ("step", 5), ("save", 6, drill),
        ("before", 6), ("step", 6), ("final save", 7, drill), ("published",), ("after",),
        ("finish",)]  # the save in flight published before the watchdog is disarmed
    plain = RecordingTrainer(steps=2, every=0, start_step=0)
    train_loop(plain)  # what tests/distributed/worker.py runs
    assert plain.calls == [("step", 0), ("step", 1), ("published",), ("finish",)]


def test_train_loop_evaluates_every_n_steps_and_after_the_last_before_saving():
    trainer = RecordingTrainer(steps=5, every=2, start_step=0, eval_every=2)
    hook = lambda step: None
    train_loop(trainer, before_step=hook)
    assert trainer.calls == [
        ("step", 0), ("step", 1), ("eval", 1, hook), ("save", 2, None), ("step", 2), ("step", 3),
        ("eval", 3, hook), ("save", 4, None), ("step", 4), ("eval", 4, hook),
        ("final save", 5, None), ("published",), ("finish",)]


class _GoesBad(RecordingTrainer):
    """Its training goes bad in step `bad` (the guard sets `halted` inside train_step)."""

    def __init__(self, bad: int, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def train_step(self, step):
        super().train_step(step)
        if step == self.bad:
            self.halted = Halted(step=step, what="non-finite loss", kind="nonfinite")


def test_a_step_that_went_bad_ends_the_loop_before_its_evaluation_and_save():
    trainer = _GoesBad(3, steps=6, every=2, start_step=0, eval_every=2)
    after = []
    ended = train_loop(trainer, after_step=after.append, stopper=_NeverStops())
    assert ended == trainer.halted and ended.step == 3
    assert trainer.calls[-4:] == [("step", 2), ("step", 3), ("published",),
                                  ("finish", "without its line")]
    assert after == [0, 1, 2, 3]  # the weights drill ran after every step, the bad one too


def test_a_save_refused_for_bad_weights_ends_the_loop_and_a_stop_says_it_saved_nothing():
    trainer = RecordingTrainer(steps=6, every=2, start_step=0)
    trainer.refused_saves = {4}
    original = trainer.save_checkpoint

    def save(steps_done, fault=None, final=False):
        written = original(steps_done, fault, final)
        if not written:
            trainer.halted = Halted(step=steps_done - 1, what="non-finite weights", kind="weights")
        return written

    trainer.save_checkpoint = save
    assert train_loop(trainer).kind == "weights"
    assert [c for c in trainer.calls if c[0] == "step"][-1] == ("step", 3)
    skipped = RecordingTrainer(steps=6, every=0, start_step=0)
    skipped.refused_saves = {2}  # the last step was bad: no checkpoint after it
    assert train_loop(skipped, stopper=_StopsAfter(2)) == Stopped(2, "SIGTERM", saved=False)


class _NeverStops:
    def note(self, kind, seconds):
        pass

    def agree(self, steps_done, next_evaluates):
        return None


class _StopsAfter(_NeverStops):
    def __init__(self, steps: int):
        self.steps = steps

    def agree(self, steps_done, next_evaluates):
        return Stopped(steps_done, "SIGTERM") if steps_done == self.steps else None
