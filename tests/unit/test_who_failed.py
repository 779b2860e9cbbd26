"""One reading of who failed first and who went silent (job/who_failed.py), the same for the
failure report and the restart's decision; one walk of an exception's chain for the guard."""

from __future__ import annotations

from dsforge.job import failure
from dsforge.job.pids import write_pid
from dsforge.job.run_dir import RunDir
from dsforge.job.who_failed import finished_ranks, who_failed
from dsforge.launch.diagnose import failure_report
from dsforge.launch.restart import decide
from dsforge.runtime.guard.chain import exception_chain


def _started(run_dir: RunDir, *ranks: int) -> None:
    for rank in ranks:
        write_pid(run_dir, rank, "node-a", 100 + rank)


def test_a_rank_that_finished_its_part_is_not_silent_whichever_way_it_ended(tmp_path):
    """Done, stopped on request or halted: each wrote its rank summary; only rank 2 went
    silent, and the report and the restart both name it."""
    run_dir = RunDir(tmp_path)
    _started(run_dir, 0, 1, 2)
    for rank in (0, 1):
        run_dir.rank_summary(rank).write_text("{}")
    found = who_failed(run_dir)
    assert finished_ranks(run_dir) == {0, 1} and set(found.silent) == {2}
    assert "rank 2 (pid 102 on node-a)" in failure_report(run_dir, 1)
    assert "rank 0 (pid" not in failure_report(run_dir, 1)
    verdict = decide(1, run_dir, [])
    assert verdict.retry and verdict.cause == found.first and verdict.cause.rank == 2


def test_a_recorded_failure_comes_before_a_silent_rank_and_is_not_silent(tmp_path):
    """Even a record that only says its rank lost its peers: a silent rank may be one the
    launcher's teardown killed with its supervisor (issue 50 attributes a lost host)."""
    run_dir = RunDir(tmp_path)
    _started(run_dir, 0, 1)
    failure.write(run_dir, failure.Failure(rank=0, step=3, kind="collective",
                                           message="RuntimeError: Connection closed by peer"))
    found = who_failed(run_dir)
    assert set(found.silent) == {1} and found.first.rank == 0
    assert decide(1, run_dir, []).cause.rank == 0


def test_nothing_started_nothing_silent(tmp_path):
    found = who_failed(RunDir(tmp_path))
    assert found.first is None and found.silent == {} and found.records == []


def test_the_chain_is_walked_once_even_when_it_loops():
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer") from inner
    except ValueError as outer:
        caught = outer
    assert [type(e) for e in exception_chain(caught)] == [ValueError, KeyError]
    caught.__cause__.__context__ = caught  # a loop: each exception still comes once
    assert [type(e) for e in exception_chain(caught)] == [ValueError, KeyError]
