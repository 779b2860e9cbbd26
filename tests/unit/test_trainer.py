"""The training loop (dsforge.runtime.loop.trainer.train_loop) against a Trainer stand-in that
records its calls (tests/unit/helpers/recording_trainer.py): resume, saves every n steps,
evaluation, and the rank's hooks."""

from __future__ import annotations

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
        ("before", 6), ("step", 6), ("save", 7, drill), ("after",), ("finish",)]  # and the last
    plain = RecordingTrainer(steps=2, every=0, start_step=0)
    train_loop(plain)  # what tests/distributed/worker.py runs
    assert plain.calls == [("step", 0), ("step", 1), ("finish",)]


def test_train_loop_evaluates_every_n_steps_and_after_the_last_before_saving():
    trainer = RecordingTrainer(steps=5, every=2, start_step=0, eval_every=2)
    hook = lambda step: None
    train_loop(trainer, before_step=hook)
    assert trainer.calls == [
        ("step", 0), ("step", 1), ("eval", 1, hook), ("save", 2, None), ("step", 2), ("step", 3),
        ("eval", 3, hook), ("save", 4, None), ("step", 4), ("eval", 4, hook), ("save", 5, None),
        ("finish",)]
