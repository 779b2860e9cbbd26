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
