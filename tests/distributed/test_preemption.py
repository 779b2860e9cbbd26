"""Preempted, time-limited and signalled jobs stop with a complete checkpoint and resume exactly.

In one world of 2 ranks (tests/distributed/legs_worker.py: the real Trainer and train_loop,
the imports paid once), a straight run of 10 steps, and one run stopped four times and resumed
each time, one rank signalling itself at a chosen moment (the other learns of it only from the
per-step agreement):
1. train.time_limit: 1 s, long past after the first step: stops after step 1;
2. SIGTERM to rank 0 while it trains step 3 (0-based): stops after step 4 with its own save;
3. SIGUSR1 to rank 1 while it saves the periodic checkpoint of step 6 in the foreground
   (train.checkpoint_async: false): that save completes and is the one the run stops with;
4. SIGTERM to rank 1 during the evaluation after step 8: stops after step 8;
5. the last resume trains to step 10.
The other periodic saves are written in the background. Its losses and validation losses equal
the straight run's bitwise; both keep their newest two complete checkpoints (train.keep_last:
2).

Through `dsforge run` and its launcher: SIGTERM to dsforge while a rank saves reaches
the ranks by pid, the save completes, the job exits 75 and says so; a second SIGTERM stops a
job at once, with no half checkpoint as latest and nothing left running.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from dsforge.ckpt.retention import complete_checkpoints
from dsforge.ckpt.trust import read_latest
from tests.conftest import REPO
from tests.distributed.legs_worker import run_legs
from tests.distributed.test_checkpoint import TEXT, _losses, _val_losses
from tests.distributed.test_run import _job_processes, dsforge
from tests.distributed.test_signals import _kill_leftovers, _wait_for_training

TINY = REPO / "recipes" / "tiny.yaml"
COMMON = [f"data.source={TEXT}", "train.steps=10", "train.checkpoint_every=3",
          "train.keep_last=2", "train.eval_every=4", "train.eval_iters=1"]
LEGS = [  # (run, extra overrides, resume, signal) -> the expected stop
    ("straight", [], False, None, None),
    ("stopped", ["train.time_limit=1"], False, None, [1, "time limit"]),
    ("stopped", [], True, [0, "step", 3, "SIGTERM"], [4, "SIGTERM"]),
    # a save in the foreground: a signal while a background writer writes lands in the step
    # after the save, or the one after that, whichever the writer's speed decides
    ("stopped", ["train.checkpoint_async=false"], True, [1, "save", 6, "SIGUSR1"], [6, "SIGUSR1"]),
    ("stopped", [], True, [1, "eval", 7, "SIGTERM"], [8, "SIGTERM"]),
    ("stopped", [], True, None, None),
]


def _world(out, legs, timeout_s=300):
    return run_legs(out, TINY, [{"run": run, "overrides": COMMON + extra, "resume": resume,
                                 "signal": sig} for run, extra, resume, sig, _ in legs],
                    timeout_s=timeout_s)


def test_stopped_four_times_and_resumed_equals_one_run(tmp_path):
    stops = _world(tmp_path, LEGS)
    assert stops == [expected for *_, expected in LEGS]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert len(_losses(straight)) == 10
    assert _losses(stopped) == _losses(straight)  # bitwise, all ten steps
    assert [step for step, _ in _val_losses(stopped)] == [3, 7, 9]
    assert _val_losses(stopped) == _val_losses(straight)
    # keep_last: the newest two complete checkpoints (the last step's is saved too)
    for run_dir, kept in ((stopped, ["step00000009", "step00000010"]),
                          (straight, ["step00000009", "step00000010"])):
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert names == ["latest", *kept], names


def test_sigterm_to_dsforge_during_a_save_exits_resumable(tmp_path):
    """Rank 1 sends SIGTERM to `dsforge run` while it writes the checkpoint of step 4 (in the
    foreground: a background writer's signal lands in a later step)."""
    run_dir = tmp_path / "run"
    result = dsforge("run", str(TINY), "--set", "train.steps=8", "--set",
                     "train.checkpoint_every=2", "--set", "train.keep_last=1",
                     "--set", "train.checkpoint_async=false", "--run-dir",
                     str(run_dir), env={"DSFORGE_INJECT_FAULT": "stop-save:1:4"}, timeout=180)
    assert result.returncode == 75, result.stderr[-3000:]
    assert "SIGTERM received; every rank saves a checkpoint after its current step" in result.stderr
    assert ("stopped after step 4 (SIGTERM) with a complete checkpoint: resumable, exit code 75; "
            f"continue with --resume --run-dir {run_dir}") in result.stderr
    root = run_dir / "checkpoints"
    assert read_latest(root) == "step00000004" and list(complete_checkpoints(root)) == [4]
    assert len(_losses(run_dir)) == 4
    assert not _job_processes(run_dir)


def test_a_second_sigterm_stops_the_job_at_once(tmp_path):
    """The second SIGTERM comes as soon as dsforge says it passed the first one on, while the
    ranks finish their step or save."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dsforge", "run", str(TINY), "--set",
                             "train.steps=100000", "--set", "train.checkpoint_every=100000",
                             "--run-dir", str(run_dir)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    try:
        _wait_for_training(run_dir, proc)
        reader.start()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not any("every rank saves a checkpoint" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-2000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        proc.kill()
    stderr = "".join(lines)
    assert proc.returncode == 143, stderr[-2000:]
    assert "every rank saves a checkpoint" in stderr
    assert "SIGTERM received; stopping every rank" in stderr
    root = run_dir / "checkpoints"
    latest = read_latest(root) if root.exists() else None
    assert latest is None or int(latest[4:]) in complete_checkpoints(root)  # never half a one
    left = _job_processes(run_dir)
    _kill_leftovers(left)
    assert not left
