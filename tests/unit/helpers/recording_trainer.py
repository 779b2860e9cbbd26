"""A Trainer stand-in for train_loop (dsforge.runtime.loop.trainer): test_trainer.py drives the
loop with it, test_preempt.py subclasses it for the stop agreement."""

from __future__ import annotations

from types import SimpleNamespace

from dsforge.runtime.loop.save_interval import SaveInterval


class RecordingTrainer:
    """What train_loop uses of a Trainer, recording the calls."""

    def __init__(self, *, steps: int, every: int, start_step: int, eval_every: int = 0):
        train = SimpleNamespace(steps=steps, checkpoint_every=every, eval_every=eval_every,
                                keep_last=0)
        self.resolved = SimpleNamespace(recipe=SimpleNamespace(train=train))
        self.start_step, self.calls = start_step, []
        self.halted = None  # set by a test's train_step: the training went bad
        self.refused_saves: set[int] = set()  # steps_done whose save_checkpoint returns False
        # No save measured; its save in flight published before the watchdog is disarmed.
        self.checkpointer = SimpleNamespace(slowest_s=None,
                                            finish=lambda: self.calls.append(("published",)))
        self.save_interval = SaveInterval(self.resolved, device="cpu", first_timed_step=0,
                                          say=None)

    def train_step(self, step):
        self.calls.append(("step", step))

    def save_checkpoint(self, steps_done, fault=None, final=False):
        self.calls.append(("final save" if final else "save", steps_done, fault))
        return steps_done not in self.refused_saves

    def evaluate(self, step, before_batch=None):
        self.calls.append(("eval", step, before_batch))

    def finish(self, closing_line=True):
        self.calls.append(("finish",) if closing_line else ("finish", "without its line"))
