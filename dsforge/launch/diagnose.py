"""What `dsforge run` says when a job fails: who failed first, who said nothing, and where.

Sources, most specific first: the ranks' failure records (runtime/failure.py: exception, oom,
hang, with tracebacks); the ranks that neither recorded a failure nor reported completion
although they started (RUN_DIR/ranks/rankNNNNN.pid): killed or stopped from outside, the usual
cause when their peers then fail on a broken connection; DeepSpeed's launcher's own exit line
for the code it saw (a negative code is the signal that ended a rank); and each rank's last
heartbeat.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from dsforge.launch.run_dir import JOB_LOG
from dsforge.runtime import failure
from dsforge.runtime.heartbeat import read_all, summarize
# deepspeed/launcher/launch.py (0.19.8) logs "<cmd> exits with return code = N" for the first
# rank it saw fail (its <cmd> is the last rank's command, so only N is trusted here).
_LAUNCHER_EXIT = re.compile(r"exits with return code = (-?\d+)")


def pid_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank:05d}.pid"


def write_pid(run_dir: Path, rank: int, host: str, pid: int) -> None:
    path = pid_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{host} {pid}\n")


def started_ranks(run_dir: Path) -> dict[int, str]:
    """rank -> "host pid" for every rank that got as far as starting."""
    found = {}
    for path in sorted((Path(run_dir) / "ranks").glob("rank*.pid")):
        try:
            found[int(path.stem[4:])] = path.read_text().strip()
        except (OSError, ValueError):
            continue
    return found


def launcher_exit_codes(log_text: str) -> list[int]:
    return [int(code) for code in _LAUNCHER_EXIT.findall(log_text)]


def describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code}: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def failure_report(run_dir: Path, code: int, done_ranks: set[int]) -> str:
    run_dir = Path(run_dir)
    log = run_dir / JOB_LOG
    log_text = log.read_text(errors="replace") if log.exists() else ""
    records = failure.read_all(run_dir)
    recorded = {r.rank for r in records}
    lines = [f"dsforge: job failed ({describe_code(code)})"]
    silent = {rank: where for rank, where in started_ranks(run_dir).items()
              if rank not in recorded and rank not in done_ranks}
    if silent and records:
        lines += _silent_lines(silent, run_dir, launcher_exit_codes(log_text))
    if records:
        lines += _record_lines(records)
    elif silent:
        lines += _silent_lines(silent, run_dir, launcher_exit_codes(log_text))
    lines.append(f"  every rank's output and the engines' logs: {log}")
    return "\n".join(lines + [summarize(run_dir)])


def _silent_lines(silent: dict[int, str], run_dir: Path, codes: list[int]) -> list[str]:
    beats = read_all(run_dir)
    seen = f"; DeepSpeed's launcher saw {', '.join(describe_code(c) for c in codes)}" if codes else ""
    lines = [f"  ranks that stopped without reporting an error (killed or stopped from outside?{seen}):"]
    for rank, where in sorted(silent.items())[:16]:
        host, _, pid = where.partition(" ")
        beat = beats.get(rank)
        last = f", last progress {beat[1]:.0f}s ago at step {beat[0]}" if beat else ""
        lines.append(f"    rank {rank} (pid {pid} on {host}){last}")
    return lines


def _record_lines(records: list[failure.Failure]) -> list[str]:
    first = records[0]
    lines = [f"  first failure: {first.headline()}"]
    lines += ["    " + line for line in first.detail.rstrip().splitlines()[-12:]]
    hung = [r for r in records if r.kind == "hang"]
    if len(hung) > 1:  # usually one rank is elsewhere and the rest wait for it in a collective
        lines.append("  where each stuck rank was:")
        lines += [f"    rank {r.rank}: {r.innermost_call()}" for r in hung]
    return lines
