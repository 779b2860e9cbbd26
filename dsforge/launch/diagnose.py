"""What `dsforge run` says when a job fails: who failed first, who said nothing, and where.

Sources, most specific first (read once, job/who_failed.py): the ranks' failure records
(job/failure.py: exception, build, oom, hang, with tracebacks; killed or stopped from outside,
by their supervisors, the first failure before the peers that then lost or waited for them);
the ranks that went silent (started, neither finished nor recorded a failure): ended from
outside without a word, the usual cause when their peers then fail on a broken connection; the
launcher's own exit line for the code it saw (dsforge's on one machine, DeepSpeed's on a
hostfile's hosts; a negative code is the signal that ended a rank); and each rank's last
heartbeat. A failure the record explains (a build's cause and fix; an out-of-memory's measured
peak, set against the memory model's prediction and the changes predicted to fit) is one line,
its traceback left in the job log; any other shows the end of its traceback.
"""

from __future__ import annotations

import re
import signal

from dsforge.estimate.memory_fixes import HEADROOM, estimate, fit_limit, memory_fixes
from dsforge.job import failure
from dsforge.job.failure import needed_bytes
from dsforge.job.heartbeat import read_all, summarize
from dsforge.job.run_dir import RunDir
from dsforge.job.steps import step_text
from dsforge.job.who_failed import who_failed
from dsforge.problems import RecipeError
from dsforge.recipe import Resolved, resolve_file
from dsforge.translate.kernels import dense_document_mask, fused_loss
from dsforge.units import format_bytes

# Both launchers log "... exits with return code = N" for the first rank they saw fail:
# dsforge's (launch/node.py) and deepspeed/launcher/launch.py (0.19.8), whose line names the
# last rank's command, so only N is trusted here.
_LAUNCHER_EXIT = re.compile(r"exits with return code = (-?\d+)")


def launcher_exit_codes(log_text: str) -> list[int]:
    return [int(code) for code in _LAUNCHER_EXIT.findall(log_text)]


def describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code}: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def failure_report(run_dir: RunDir, code: int) -> str:
    log = run_dir.job_log
    log_text = log.read_text(errors="replace") if log.exists() else ""
    found = who_failed(run_dir)
    records, silent = found.records, found.silent
    lines = [f"dsforge: job failed ({describe_code(code)})"]
    if silent and records:
        lines += _silent_lines(silent, run_dir, launcher_exit_codes(log_text))
    if records:
        lines += _record_lines(records, run_dir)
    elif silent:
        lines += _silent_lines(silent, run_dir, launcher_exit_codes(log_text))
    else:  # no rank got as far as its supervisor (e.g. Python could not import dsforge)
        lines += _log_tail(log_text)
    lines.append(f"  every rank's output and the engines' logs: {log}")
    return "\n".join(lines + [summarize(run_dir)])


LOG_TAIL_LINES = 12


def _log_tail(log_text: str) -> list[str]:
    """The job log's last lines, for a job whose ranks failed before they could record why."""
    tail = [line for line in log_text.splitlines() if line.strip()][-LOG_TAIL_LINES:]
    if not tail:
        return ["  no rank started, and the job log is empty"]
    return ["  no rank got as far as recording a failure; the job log ends:"] + \
        ["    " + line for line in tail]


def _silent_lines(silent: dict[int, str], run_dir: RunDir, codes: list[int]) -> list[str]:
    beats = read_all(run_dir)
    seen = f"; the launcher saw {', '.join(describe_code(c) for c in codes)}" if codes else ""
    lines = [f"  ranks that stopped without reporting an error (killed or stopped from outside?{seen}):"]
    for rank, where in sorted(silent.items())[:16]:
        host, _, pid = where.partition(" ")
        beat = beats.get(rank)
        last = f", last progress {beat[1]:.0f}s ago at {step_text(beat[0])}" if beat else ""
        lines.append(f"    rank {rank} (pid {pid} on {host}){last}")
    return lines


def _record_lines(records: list[failure.Failure], run_dir: RunDir) -> list[str]:
    """The likely cause (the first record) and its traceback's end, but for the line that
    repeats its headline's message."""
    first = records[0]
    if first.explained:
        lines = [f"  first failure: {explain(first, run_dir)}; traceback in {run_dir.job_log}"]
    else:
        lines = [f"  first failure: {first.headline()}"]
        tail = first.detail.rstrip().splitlines()[-12:]
        lines += ["    " + line for line in tail if line.strip() != first.message.strip()]
    hung = [r for r in records if r.kind == "hang"]
    if len(hung) > 1:  # usually one rank is elsewhere and the rest wait for it in a collective
        lines.append("  where each stuck rank was:")
        lines += [f"    rank {r.rank}: {r.innermost_call()}" for r in hung]
    return lines


def explain(record: failure.Failure, run_dir: RunDir) -> str:
    """The record in one line; an out-of-memory also with what the memory model predicted for
    the run's recipe (RUN_DIR/recipe.yaml, as the ranks resolved it) and what would fit."""
    if record.kind != "oom" or not record.memory:
        return record.headline()
    resolved = run_recipe(run_dir)
    if resolved is None:
        return f"{record.headline()}; no prediction: {run_dir.recipe} cannot be resolved"
    return f"{record.headline()}; {memory_advice(record.memory, resolved)}"


def run_recipe(run_dir: RunDir) -> Resolved | None:
    try:
        return resolve_file(run_dir.recipe)
    except (OSError, RecipeError):
        return None


def memory_advice(memory: dict, resolved: Resolved) -> str:
    """The memory model's peak for `resolved` against what a rank measured when it ran out,
    and the changes predicted to fit (estimate/memory_fixes.py)."""
    r = resolved.recipe
    kinds = {"fused_loss": fused_loss(r.model, tp=resolved.layout.tp, device="cuda",  # a GPU ran out
                                      per_token_loss=r.data.eod_mask_loss),
             "document_mask": dense_document_mask(r, device="cuda")}
    peak = estimate(resolved, **kinds)
    where = f"pipeline rank {peak.pipeline_rank}, " if resolved.layout.pp > 1 else ""
    said = f"the memory model predicts {format_bytes(peak.total)} ({where}at the {peak.peak_moment})"
    capacity, needed = memory["capacity"], needed_bytes(memory)
    limit = fit_limit(capacity=capacity, predicted=peak.total, needed=needed)
    if peak.total <= limit:
        return f"{said}, which fits: the rest went {_outside_the_model(memory)}"
    beyond = needed - peak.total
    if limit <= 0:  # one allocation larger than the device: no layout change makes room
        return (f"{said}, but the rank needed {format_bytes(needed)}, {format_bytes(beyond)} beyond it "
                f"and more than the device holds: look at the allocation in the traceback")
    less = f", less the {format_bytes(beyond)} measured beyond the prediction" if beyond > 0 else ""
    under = f"{format_bytes(limit)} ({1 - HEADROOM:.0%} of {format_bytes(capacity)}{less})"
    fixes = memory_fixes(resolved, limit, **kinds)
    if not fixes:
        return (f"{said}; no change of activation checkpointing, micro-batch or ZeRO stage is "
                f"predicted under {under}: `dsforge plan --search` finds layouts that fit "
                "(tp, pp, more GPUs)")
    shown = "; or ".join(f"{fix.overrides()} ({format_bytes(fix.predicted)})" for fix in fixes)
    return f"{said}. Fix, each predicted under {under}: {shown}"


def _outside_the_model(memory: dict) -> str:
    if memory.get("reserved") is not None:  # CUDA: torch's caching allocator
        return ("outside it (another process on the GPU, or fragmentation: "
                f"{format_bytes(memory['reserved'])} reserved). Fix: check nvidia-smi, or set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    return ("outside it (other processes on the host). Fix: free the host's memory, or run fewer "
            "ranks on it")
