"""Spawn a CPU/gloo world of N ranks that trains several layouts, with a hard timeout.

Each rank runs tests/distributed/worker.py in one process session; on timeout or failure the
whole session is killed (no rank outlives the test). Results are the reporter rank's
metrics.jsonl per layout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsforge.launch.local import free_port
from tests.conftest import REPO


class WorldFailed(AssertionError):
    pass


def run_world(world_size: int, cases: dict[str, list[str]], *, recipe: Path, out: Path,
              timeout_s: float = 420.0, step_timeout_s: float = 120.0,
              resume_from: dict[str, str] | None = None, resume_step: int | None = None,
              recipes: dict[str, Path] | None = None) -> dict[str, list[dict]]:
    """Train every case (name -> overrides) on `world_size` ranks; returns metrics per case.
    resume_from[name] = an earlier case whose checkpoints case `name` resumes from: its newest,
    or with `resume_step` the one after that step, as if the earlier run had stopped there (a
    run that finishes saves its last step too); recipes[name] = the recipe of case `name` when
    it is not `recipe`."""
    resume_from, recipes = resume_from or {}, recipes or {}
    spec = {"recipe": str(recipe), "out": str(out), "timeout_s": step_timeout_s,
            "cases": [{"name": n, "overrides": o, "resume_from": resume_from.get(n),
                       "resume_step": resume_step if n in resume_from else None,
                       "recipe": str(recipes[n]) if n in recipes else None}
                      for n, o in cases.items()]}
    spec_path = out / f"world{world_size}.json"
    out.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs = [_start_rank(rank, world_size, port, spec_path, out) for rank in range(world_size)]
    _wait(procs, timeout_s, out)
    return {name: _metrics(out / name) for name in cases}


def _start_rank(rank: int, world: int, port: int, spec_path: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    log = open(out / f"rank{rank}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "tests.distributed.worker", str(spec_path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


def _wait(procs: list[subprocess.Popen], timeout_s: float, out: Path) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                reason = "a rank failed" if failed else f"timed out after {timeout_s:.0f}s"
                raise WorldFailed(f"{reason}:\n{_logs(out)}")
            time.sleep(0.2)
        if any(p.returncode != 0 for p in procs):
            raise WorldFailed(f"a rank failed:\n{_logs(out)}")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _logs(out: Path) -> str:
    texts = []
    for log in sorted(out.glob("rank*.log")):
        lines = log.read_text(errors="replace").splitlines()
        texts.append(f"--- {log.name} (last 30 lines)\n" + "\n".join(lines[-30:]))
    return "\n".join(texts)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
