"""Who failed first and who went silent: one reading of an attempt's records, for the failure
report (launch/diagnose.py) and the restart's decision (launch/restart.py).

A rank started when it wrote its pid file (job/pids.py) and finished when it wrote its rank
summary (RUN_DIR/ranks/rankNNNNN.json: it got through its part, done, stopped on request or
halted together with its peers). A rank that started, did not finish and recorded no failure
went silent: killed or stopped from outside without a word, or gone with its host or its
supervisor (which records its rank's death, runtime/guard/supervise.py). Both readers take the
records and the silent ranks from here; the likely cause is the first record (job/failure.py
`read_all`'s order), else the first silent rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.job import failure
from dsforge.job.failure import Failure
from dsforge.job.heartbeat import read_all as read_heartbeats
from dsforge.job.pids import started_ranks
from dsforge.job.run_dir import RunDir


@dataclass(frozen=True)
class Findings:
    """What an attempt's ranks left: their failure records, likely cause first, and the
    ranks that went silent (rank -> "host pid", from their pid files)."""

    records: list[Failure]
    silent: dict[int, str]
    run_dir: RunDir

    @property
    def first(self) -> Failure | None:
        """The likely cause: the first record, else the first silent rank as a record of its
        own; None when no rank failed or went silent."""
        if self.records:
            return self.records[0]
        if not self.silent:
            return None
        rank = min(self.silent)
        beat = read_heartbeats(self.run_dir).get(rank)
        host = self.silent[rank].partition(" ")[0]
        return Failure(rank=rank, step=beat[0] if beat else -1, kind="killed",
                       message=f"ended on {host} without a record (its host or its supervisor "
                               "is gone)")


def finished_ranks(run_dir: RunDir) -> set[int]:
    """Ranks that got through their part (their rank summary exists)."""
    return {rank for rank in started_ranks(run_dir) if run_dir.rank_summary(rank).exists()}


def who_failed(run_dir: RunDir) -> Findings:
    records = failure.read_all(run_dir)
    recorded, finished = {r.rank for r in records}, finished_ranks(run_dir)
    silent = {rank: where for rank, where in started_ranks(run_dir).items()
              if rank not in recorded and rank not in finished}
    return Findings(records=records, silent=silent, run_dir=run_dir)
