"""The rank entry point's pure parts (dsforge.runtime.rank): the injected-fault spec and the CPU
threads each rank gets."""

from __future__ import annotations

import os

import pytest

from dsforge.runtime.guard.drills import parse_fault
from dsforge.runtime.rank import threads_per_rank


def test_fault_spec():
    assert parse_fault(None) is None and parse_fault("hang:1:3") == ("hang", 1, 3)
    with pytest.raises(ValueError):
        parse_fault("boom:1:3")


def test_ranks_share_the_cpus_unless_the_user_chose():
    cpus = len(os.sched_getaffinity(0))
    assert threads_per_rank({"LOCAL_SIZE": "1"}) == cpus
    assert threads_per_rank({"LOCAL_SIZE": str(cpus * 4)}) == 1
    assert threads_per_rank({"LOCAL_SIZE": "2"}) == max(1, cpus // 2)
    assert threads_per_rank({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}) is None


@pytest.mark.parametrize("kind", ["collective", "device"])
def test_passing_drills_fail_once_per_run_directory_with_their_kind(tmp_path, kind):
    """What a restart gets past: the record says collective or device, and the next attempt
    (the marker left in the run directory) trains on."""
    import torch

    from dsforge.job.run_dir import RunDir, set_aside
    from dsforge.runtime.guard.drills import passing_fault
    from dsforge.runtime.guard.record import record_for

    run_dir, cpu = RunDir(tmp_path), torch.device("cpu")
    fault = parse_fault(f"{kind}:1:4")
    passing_fault(fault, 0, 4, run_dir, cpu)  # another rank
    passing_fault(fault, 1, 3, run_dir, cpu)  # another step
    with pytest.raises(RuntimeError) as caught:
        passing_fault(fault, 1, 4, run_dir, cpu)
    record = record_for(caught.value, rank=1, step=4, detail="")
    assert record.kind == kind and "step 5" in record.message, record.message
    set_aside(run_dir, everything=True)  # a restart from the start (no checkpoint yet)
    passing_fault(fault, 1, 4, run_dir, cpu)  # the restart: gone


def test_the_passing_drills_are_kinds_a_restart_gets_past():
    from dsforge.launch.restart import RETRIED
    from dsforge.runtime.guard.drills import PASSING_KINDS

    assert set(PASSING_KINDS) <= set(RETRIED)


@pytest.mark.parametrize("eval_at", [7, 10])
def test_stop_eval_fires_before_the_first_validation_batch_from_its_step_on(monkeypatch, eval_at):
    """stop-eval:0:7 with validation after step 7, or only after step 10: the supervisor gets
    SIGUSR1 before that validation's first batch (a second call for one step), once."""
    import signal

    from dsforge.runtime.guard import drills

    sent = []
    monkeypatch.setattr(drills.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    drill = drills.StopDrill(parse_fault("stop-eval:0:7"), 0, owner="", request=None)
    for step in range(5, 12):
        drill.before(step)  # the step starts
        if step == eval_at:
            drill.before(step)  # its first validation batch
            assert sent == [(os.getppid(), signal.SIGUSR1)]
            drill.before(step)
    assert len(sent) == 1
