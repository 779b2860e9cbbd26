"""`dsforge run --max-restarts N`: a job that loses a rank comes back by itself.

When the job ends badly, `decide` reads the failure records its ranks wrote (job/failure.py)
and says whether starting it again can help. Retried, as passing faults of the machines: a rank
killed by a signal or lost without a word (its host or supervisor gone), a rank stopped from
outside, a hang its watchdog ended, a failed collective (NCCL, gloo, the rendezvous store), a
CUDA error. Not retried, because running again repeats them or because somebody asked for the
end: a refusal (nothing started), an exception in the code or the recipe, a failed build, an
out-of-memory, training that went bad (non-finite), a stop asked for (Ctrl-C, SIGTERM, SIGUSR1,
SIGHUP: a preemption still ends with 75 for the scheduler's requeue), `--timeout`, and the same
failure at the same step as an earlier attempt's.

A restart waits for the failed attempt's processes on this machine to be gone, sets its
records aside (RUN_DIR/attempts/N, job/run_dir.set_aside: its failures, heartbeats and pid
files, so the next attempt's are its own) and starts the same job word again with `resume`
from the newest complete checkpoint, exactly as `--resume` would (same layout: the losses equal
an uninterrupted run's), or from the start in the same run directory when no checkpoint was
complete (then everything the attempt wrote moves aside). The job word keeps its `started_at`,
so train.time_limit counts from the first start, and this process keeps the run directory's
lock throughout. Before each restart the caller checks again that the job fits (`prepare`): a
machine that lost a GPU, or a host the preflight cannot reach, refuses it. dsforge's stop
signals are caught from the first attempt to the last: one between two attempts ends the job
instead of the restart (75 with a complete checkpoint), one just before an attempt starts
stops that attempt as soon as it runs (launch/local.StopSignals).

A job that ends without its ranks' own summary after restarts (it failed for good, or was
stopped between attempts) gets the launcher's: RUN_DIR/summary.json with the restarts, each
cause and the final failure (`write_failed_summary`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import time
from dataclasses import dataclass
from typing import Callable, NoReturn

from dsforge.files import write_atomic
from dsforge.job.failure import Failure
from dsforge.job.run_dir import RunDir, set_aside
from dsforge.job.signals import EXIT_NONFINITE, EXIT_RESUMABLE
from dsforge.job.steps import step_text
from dsforge.job.who_failed import who_failed
from dsforge.job.word import JobSpec
from dsforge.launch.host_pool import AllocationShort, CannotLeaveOut, HostPool, HostsFailed
from dsforge.launch.local import EXIT_TIMEOUT, StopAsked, StopSignals, Stopped
from dsforge.launch.refusal import BadOptions, Refused
from dsforge.launch.start import STOPPED_CODES
from dsforge.lock import job_processes

Say = Callable[[str], None]

# Kinds of failure record a restart can get past.
RETRIED = ("killed", "stopped", "hang", "collective", "device")
# Why the others are not retried: said when a job with restarts left ends on one.
NOT_RETRIED = {
    "exception": "an exception repeats when the same code runs on the same data",
    "build": "a failed build repeats until its cause is fixed",
    "oom": "an out-of-memory repeats at the same sizes; the report above lists what fits",
    "nonfinite": "the training itself went bad; the same checkpoint and data would repeat it",
    "exited": "something inside a rank ended it with an error code, which repeats like an "
              "exception",
}
# How long the failed attempt's processes on this machine get to be gone before a restart.
GONE_WITHIN_S = 30.0


def _ended_by_choice(code: int) -> str | None:
    """Why an exit code of launch_and_watch means an end somebody chose, or None."""
    if code == EXIT_RESUMABLE:
        return ("the ranks stopped with a checkpoint on request (a signal or train.time_limit): "
                "resume it, or let the scheduler requeue it")
    if code == EXIT_NONFINITE:
        return NOT_RETRIED["nonfinite"]
    if code == EXIT_TIMEOUT:
        return "the job ran past --timeout"
    if code in STOPPED_CODES:  # 128 + the signal's number
        name = "Ctrl-C" if code == 130 else signal.Signals(code - 128).name
        return f"dsforge was stopped ({name})"
    return None


@dataclass(frozen=True)
class Verdict:
    retry: bool
    why: str  # the cause (retry) or why not (no retry)
    cause: Failure | None = None
    repeated: bool = False  # not retried only because the same failure came back
    leave_out: str | None = None  # the host the restart leaves out (launch/host_pool.py)


class NotRestarted(Exception):
    """The restart cannot go ahead; the message says why."""


def decide(code: int, run_dir: RunDir, earlier: list[dict],
           asked: StopAsked | None = None) -> Verdict:
    """Whether the attempt that ended with `code` is worth starting again, after the `earlier`
    restarts (their records, as `restart_record` made them); never after a stop somebody
    `asked` for, whatever the job then ended with."""
    if asked is not None and asked.signum is not None:
        return Verdict(False, f"{signal.Signals(asked.signum).name} asked dsforge to stop")
    chosen = _ended_by_choice(code)
    if chosen:
        return Verdict(False, chosen)
    found = who_failed(run_dir)
    # A rank's own error, even behind peers that NCCL's watchdog then aborted (SIGABRT).
    for record in found.records:
        if record.kind not in RETRIED:
            return Verdict(False, NOT_RETRIED.get(record.kind, f"a failure of kind {record.kind}"),
                           record)
    cause = found.first  # a record, or a rank lost without a word (its host or supervisor gone)
    if cause is None:
        return Verdict(False, f"no rank recorded a failure or went silent (the launcher's exit "
                              f"code {code}; its output is in {run_dir.job_log})")
    if any(_same(r, cause) for r in earlier):
        return Verdict(False, f"the same failure came back at {step_text(cause.step)} "
                              f"({cause.message}): not a passing fault", cause, repeated=True)
    return Verdict(True, cause.headline(), cause)


def _same(earlier: dict, cause: Failure) -> bool:
    """The same failure at the same step: kind, step and message alike but for numbers (ports,
    addresses, times and counters differ from one attempt to the next)."""
    def plain(message: str) -> str:
        return re.sub(r"\d+", "#", message)

    return (earlier["kind"], earlier["step"], plain(earlier["message"])) == \
        (cause.kind, cause.step, plain(cause.message))


def restart_record(attempt: int, cause: Failure, resumed_after: int | None,
                   records: RunDir, *, host: str | None = None,
                   left_out: list[dict] | None = None) -> dict:
    """One restart as the job word and summary.json keep it; `records`: where the failed
    attempt's records go (attempts/N); `host`: the failing rank's (with a hostfile);
    `left_out`: the hosts this restart left out, why, and the spare in each one's place."""
    return {"attempt": attempt, **_what_failed(cause), "host": host,
            "left_out": left_out or [], "resumed_after_step": resumed_after,
            "records": f"{records.path.parent.name}/{records.path.name}", "time": time.time()}


def final_failure(attempt: int, code: int, verdict: Verdict) -> dict:
    """The failure a job with restarts ended on, as summary.json keeps it: the keys of a
    restart's cause (None where no record names one: --timeout, a stop), the exit code, and
    why it was not restarted."""
    return {"attempt": attempt, **_what_failed(verdict.cause), "exit_code": code,
            "not_restarted": verdict.why, "time": time.time()}


def _what_failed(cause: Failure | None) -> dict:
    return {"kind": cause.kind if cause else None, "cause": cause.headline() if cause else None,
            "message": cause.message if cause else None, "step": cause.step if cause else None}


def write_failed_summary(run_dir: RunDir, restarts: list[dict], final: dict) -> None:
    """summary.json of a job that ended for good after `restarts`, with the keys the ranks'
    summary has for them (runtime/loop/reporter.py) and `failure`: `final_failure`'s. No
    medians: the last attempt's ranks did not finish (their steps are in metrics.jsonl)."""
    summary = {"restarts": len(restarts), "restart_causes": restarts, "failure": final}
    write_atomic(run_dir.summary, json.dumps(summary, indent=2) + "\n")


def _end(code: int, verdict: Verdict, restarts: list[dict], run_dir: RunDir, *,
         summarised: bool = False) -> NoReturn:
    """End the job with `code` (_Ended); after restarts and without the ranks' own summary
    (`summarised`: they stopped with a checkpoint, or halted), with the launcher's."""
    if restarts and not summarised:
        write_failed_summary(run_dir, restarts, final_failure(len(restarts) + 1, code, verdict))
    raise _Ended(code)


def newest_complete_step(run_dir: RunDir) -> int | None:
    """The step the newest complete checkpoint follows, or None without one. Raises
    CheckpointError when `latest` is damaged or untrustworthy (ckpt/trust.py)."""
    from dsforge.ckpt.trust import latest_complete

    record = latest_complete(run_dir.checkpoints)
    return None if record is None else record["step"]


Start = Callable[[], int]  # runs one attempt of the job, returns its exit code


def run_with_restarts(job: JobSpec, first: Start, *, max_restarts: int,
                      prepare: Callable[[JobSpec], Start], say: Say,
                      asked: StopAsked | None = None, hosts: HostPool | None = None) -> int:
    """Run the `first` attempt of `job`; after a failure worth retrying, start it again from
    its newest complete checkpoint, up to `max_restarts` times. `prepare(job)` checks that the
    job still fits (raising Refused, BadOptions or NotRestarted when it does not; HostsFailed
    when hosts in use fail its preflight) and gives its start. `asked`: the stops asked for
    while the attempts ran (the starts note them); a stop asked for between attempts ends it
    too. `hosts`: a hostfile's hosts, whose failing ones are left out (launch/host_pool.py).
    Returns the last attempt's exit code."""
    asked = asked or StopAsked()
    restarts: list[dict] = []
    go = first
    with StopSignals(asked):  # noted between the attempts too: none may find dsforge defenceless
        try:
            while True:
                code = go()
                if code == 0 or max_restarts == 0:
                    _said_done(code, restarts, job.directory, say)
                    return code
                job, go = _next_attempt(job, code, restarts, max_restarts, prepare, say, asked,
                                        hosts)
        except _Ended as ended:
            return ended.code


class _Ended(Exception):
    """The job ends with `code`, its reason said and its summary written."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Over(Exception):
    """No restart after all (the job no longer fits, its processes outlived the wait, ...),
    said already; `why` for the summary, `code` the job's exit code when not the attempt's."""

    def __init__(self, why: str, code: int | None = None):
        super().__init__(why)
        self.why, self.code = why, code


def _next_attempt(job: JobSpec, code: int, restarts: list[dict], max_restarts: int,
                  prepare: Callable[[JobSpec], Start], say: Say, asked: StopAsked,
                  hosts: HostPool | None) -> tuple[JobSpec, Start]:
    """The restarted job and its start, with the restart appended to `restarts` and said; or
    _Ended. A stop before the restart is said ends the job instead; one after it stops the
    attempt as soon as its launcher runs (launch/local.StopSignals)."""
    verdict = _verdict(code, job.directory, restarts, max_restarts, asked, hosts)
    if not verdict.retry:
        say(f"dsforge: not restarted: {verdict.why}")
        _end(_code_after_a_stop(code, job.directory, asked), verdict, restarts, job.directory,
             summarised=code in (EXIT_RESUMABLE, EXIT_NONFINITE))
    try:
        with StopSignals(asked) as signals:
            signals.arm()
            following, go, line = _restart(job, verdict, restarts, max_restarts, prepare,
                                           say, signals, hosts)
    except _Over as over:
        _end(code if over.code is None else over.code, dataclasses.replace(verdict, why=over.why),
             restarts, job.directory)
    except Stopped as stop:
        name = signal.Signals(stop.signum).name
        resumable = _has_checkpoint(job.directory)
        say(f"dsforge: {name} received before the restart: not restarted" +
            (f"; resumable, exit code {EXIT_RESUMABLE}" if resumable else ""))
        _end(EXIT_RESUMABLE if resumable else 128 + stop.signum,
             dataclasses.replace(verdict, why=f"{name} received before the restart"),
             restarts, job.directory)
    except KeyboardInterrupt:  # between two attempts: nothing of the job runs
        say("dsforge: interrupted before the restart")
        _end(130, dataclasses.replace(verdict, why="interrupted before the restart"), restarts,
             job.directory)
    restarts.append(following.restarts[-1])
    say(line)
    return following, go


def _code_after_a_stop(code: int, run_dir: RunDir, asked: StopAsked) -> int:
    """A failed attempt's code; but a stop asked for after it failed (while its report was
    said) ends the job as any stop between attempts does: resumable (75) with a checkpoint."""
    failed = code not in (EXIT_RESUMABLE, EXIT_NONFINITE, EXIT_TIMEOUT, *STOPPED_CODES)
    if asked.signum is not None and failed and _has_checkpoint(run_dir):
        return EXIT_RESUMABLE
    return code


def _verdict(code: int, run_dir: RunDir, restarts: list[dict], max_restarts: int,
             asked: StopAsked, hosts: HostPool | None) -> Verdict:
    """`decide`, with the failing host counted (left out once it has failed enough, before the
    same failure twice ends the job) and the budget of restarts."""
    verdict = decide(code, run_dir, restarts, asked)
    if hosts is not None and verdict.cause is not None and (verdict.retry or verdict.repeated):
        host = hosts.blame(verdict.cause)
        if host is not None:
            verdict = Verdict(True, verdict.cause.headline(), verdict.cause, leave_out=host)
    if verdict.retry and len(restarts) == max_restarts:
        return Verdict(False, f"--max-restarts {max_restarts} is used up; the last failure is "
                              "the one reported above", verdict.cause)
    return verdict


def _restart(job: JobSpec, verdict: Verdict, restarts: list[dict], max_restarts: int,
             prepare: Callable[[JobSpec], Start], say: Say, signals: StopSignals,
             hosts: HostPool | None) -> tuple[JobSpec, Start, str]:
    """`_restarted`'s, or _Over with the reason said."""
    from dsforge.ckpt.trust import CheckpointError

    try:
        _wait_gone(job.directory)
        return _restarted(job, verdict, restarts, max_restarts, prepare, signals, hosts)
    except (Refused, BadOptions, CheckpointError, NotRestarted, HostsFailed) as exc:
        why = _refusal_text(exc)
        say(f"dsforge: not restarted: {why}")
        raise _Over(why) from None
    except AllocationShort as short:
        raise _requeue_without(job.directory, short, say) from None


def _requeue_without(run_dir: RunDir, short: AllocationShort, say: Say) -> _Over:
    """Under Slurm, nodes the allocation cannot do without were left out: with a complete
    checkpoint the job ends resumable (75) and names them in RUN_DIR/requeue_exclude, for
    `dsforge sbatch`'s script to requeue the job excluding them (Slurm's ExcNodeList)."""
    nodes = ",".join(short.hosts)
    if not _has_checkpoint(run_dir):
        why = f"{short}; no checkpoint is complete to requeue the job from"
        say(f"dsforge: not restarted: {why}")
        return _Over(why)
    write_atomic(run_dir.requeue_exclude, nodes + "\n")
    why = f"{short}: ends resumable for a requeue without {nodes}"
    say(f"dsforge: not restarted in this allocation: {short}; exit code {EXIT_RESUMABLE}, "
        f"for a requeue without {nodes} (dsforge sbatch's script asks Slurm for it; "
        f"{run_dir.requeue_exclude.name} names them)")
    return _Over(why, EXIT_RESUMABLE)


def _wait_gone(run_dir: RunDir, within_s: float = GONE_WITHIN_S) -> None:
    """Until no process of the failed attempt runs on this machine (dsforge/lock.py finds them
    by the run directory): a restart must not count their memory against the fit, or meet them
    in the run directory. NotRestarted if they outlive `within_s`."""
    deadline = time.monotonic() + within_s
    while job_processes(run_dir.path):
        if time.monotonic() > deadline:
            raise NotRestarted(f"processes of the failed attempt still run after {within_s:.0f}s "
                               f"(PIDs {', '.join(map(str, job_processes(run_dir.path)))})")
        time.sleep(0.2)


def _has_checkpoint(run_dir: RunDir) -> bool:
    from dsforge.ckpt.trust import CheckpointError

    try:
        return newest_complete_step(run_dir) is not None
    except CheckpointError:
        return False


def _restarted(job: JobSpec, verdict: Verdict, restarts: list[dict], max_restarts: int,
               prepare: Callable[[JobSpec], Start], signals: StopSignals,
               hosts: HostPool | None) -> tuple[JobSpec, Start, str]:
    """The next attempt of `job` (its job word carries the restart's record last), its start
    once `prepare` found that it fits, and the line that says it; the failed attempt's records
    set aside whole: a signal from then on is noted, not raised, and stops the next attempt as
    soon as its launcher runs. The hosts left out (the failing one, hosts in use that fail the
    preflight) are replaced by spares first, each one tried in turn."""
    attempt, cause = len(restarts) + 1, verdict.cause
    after = newest_complete_step(job.directory)
    records = job.directory.next_attempt()
    failed_on = hosts.host_of(cause.rank) if hosts is not None else None
    if verdict.leave_out is not None:
        _leave_out(hosts, verdict.leave_out, attempt)
    while True:
        left = [e for e in (hosts.left_out if hosts else []) if e["attempt"] == attempt]
        record = restart_record(attempt, cause, after, records, host=failed_on, left_out=left)
        following = dataclasses.replace(job, resume=after is not None,
                                        restarts=[*restarts, record], launched_at=time.time())
        try:
            go = prepare(following)
            break
        except HostsFailed as failed:
            leaving = [h for h in failed.hosts if hosts is not None and hosts.blame_preflight(h)]
            if not leaving:
                raise
            for host in leaving:
                _leave_out(hosts, host, attempt)
    signals.disarm()
    kept = set_aside(job.directory, everything=after is None)
    where = "from the start" if after is None else f"from the checkpoint after step {after}"
    swaps = "".join(f"; {e['replaced_by']} in place of {e['host']} ({e['why']})"
                    if e["replaced_by"] else f"; without {e['host']} ({e['why']})" for e in left)
    return following, go, (f"dsforge: restarting ({attempt} of {max_restarts}) {where}{swaps}; "
                           f"the failed attempt's records are in {kept}")


def _leave_out(hosts: HostPool, host: str, attempt: int) -> None:
    try:
        hosts.leave_out(host, hosts.why(host), attempt)
    except CannotLeaveOut as exc:
        if hosts.in_allocation:
            raise hosts.short(host, str(exc)) from None
        raise NotRestarted(str(exc)) from None


def _said_done(code: int, restarts: list[dict], run_dir: RunDir, say: Say) -> None:
    if code == 0 and restarts:
        say(f"dsforge: finished after {len(restarts)} restart{'s' if len(restarts) > 1 else ''} "
            f"(each cause in {run_dir.summary}, restart_causes)")


def _refusal_text(exc: Exception) -> str:
    if isinstance(exc, HostsFailed):  # hosts that failed the preflight and stay in use
        exc = exc.refused
    return exc.line() if isinstance(exc, Refused) else str(exc)
