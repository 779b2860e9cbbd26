"""Experiment tracking (dsforge.runtime.loop.tracking) and rule X1 (dsforge.recipe.extras).

What the tracker writes is read back with each tool's own reader: TensorBoard's
EventAccumulator, and W&B's transaction log (run-ID.wandb, the file `wandb sync` uploads)
decoded into W&B's own Record protobufs. W&B runs offline, or online without credentials
(it fails before any network call), with HOME and every W&B directory inside tmp_path and the
HTTP(S) proxies pointed at a local trap that fails the test when reached.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsforge.job.run_dir import RunDir
from dsforge.recipe.extras import missing_extras
from dsforge.runtime.loop.metrics import StepRecord
from dsforge.runtime.loop.tracking import WANDB_ID_FILE, Tracker, open_tracker, step_scalars
from tests.conftest import REPO, make_recipe

TB_REASON = "needs the tensorboard package: pip install 'dsforge[tensorboard]' (the test extra has it)"
WANDB_REASON = "needs the wandb package: pip install 'dsforge[wandb]' (the test extra has it)"
GIB = 1 << 30


def record(step: int, loss: float, *, warmup: bool = False, loss_scale: float | None = None,
           mfu: float | None = None, hfu: float | None = None) -> StepRecord:
    # Values exact in float32: TensorBoard stores scalars as float32.
    return StepRecord(step=step, warmup=warmup, loss=loss, grad_norm=0.5 + step, lr=0.25,
                      step_time_s=0.125, tokens_per_s=1024.0 * (step + 1), tokens_per_s_per_gpu=512.0,
                      tflops_per_gpu=1.5, mfu=mfu, hfu=hfu, peak_memory_bytes=GIB * (step + 1),
                      memory_source="process peak RSS", loss_scale=loss_scale)


RECORDS = [record(0, 5.0, warmup=True), record(1, 4.0, loss_scale=1024.0, mfu=0.25, hfu=0.375),
           record(2, 3.0, loss_scale=2048.0, mfu=0.5, hfu=0.625)]


def test_step_scalars_leave_out_what_a_step_does_not_have():
    assert sorted(step_scalars(RECORDS[0])) == sorted([
        "train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/tflops_per_gpu",
        "perf/step_time_s", "memory/peak_bytes"])
    full = step_scalars(RECORDS[2])
    assert {k: full[k] for k in ("train/loss_scale", "perf/mfu", "perf/hfu")} == {
        "train/loss_scale": 2048.0, "perf/mfu": 0.5, "perf/hfu": 0.625}
    assert full["memory/peak_bytes"] == 3 * GIB and full["perf/tokens_per_s"] == 3072.0


# --- TensorBoard ---------------------------------------------------------------------------


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_events_hold_the_train_and_val_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason=TB_REASON)
    run_dir = RunDir(tmp_path)
    tracker = open_tracker(make_recipe("tracking.tensorboard=true"), run_dir)
    assert tracker.backends == ["tensorboard"]
    for r in RECORDS:
        tracker.log_step(r)
    tracker.log_eval(2, 2.5)
    tracker.close()
    scalars = tensorboard_scalars(run_dir.tensorboard)
    assert scalars["train/loss"] == [(0, 5.0), (1, 4.0), (2, 3.0)]  # the warmup step too
    assert scalars["val/loss"] == [(2, 2.5)]
    assert scalars["train/loss_scale"] == [(1, 1024.0), (2, 2048.0)]
    assert scalars["perf/hfu"] == [(1, 0.375), (2, 0.625)]
    assert scalars["memory/peak_bytes"] == [(s, float(GIB * (s + 1))) for s in range(3)]
    assert scalars["train/grad_norm"] == [(s, 0.5 + s) for s in range(3)]
    assert sorted(scalars) == sorted({*step_scalars(RECORDS[2]), "val/loss"})


def test_tensorboard_on_resume_shows_the_steps_trained_again_once(tmp_path):
    pytest.importorskip("tensorboard", reason=TB_REASON)
    recipe = make_recipe("tracking.tensorboard=true")
    run_dir = RunDir(tmp_path)
    first = open_tracker(recipe, run_dir)
    for step in range(4):  # a checkpoint after step 1, then a crash after step 3
        first.log_step(record(step, 10.0 + step))
    first.close()
    again = open_tracker(recipe, run_dir, resumed_at=2)
    for step in range(2, 5):
        again.log_step(record(step, 20.0 + step))
    again.close()
    assert tensorboard_scalars(run_dir.tensorboard)["train/loss"] == [
        (0, 10.0), (1, 11.0), (2, 22.0), (3, 23.0), (4, 24.0)]


def test_a_backend_that_cannot_open_is_told_and_training_goes_on(tmp_path):
    pytest.importorskip("tensorboard", reason=TB_REASON)
    run_dir = RunDir(tmp_path / "not-a-directory")
    run_dir.path.write_text("")
    told = []
    tracker = open_tracker(make_recipe("tracking.tensorboard=true"), run_dir, warn=told.append)
    assert tracker.backends == [] and len(told) == 1
    assert "tensorboard failed while opening it" in told[0] and "metrics.jsonl" in told[0]
    tracker.log_step(RECORDS[0])
    tracker.close()


# --- failures ------------------------------------------------------------------------------


class FakeBackend:
    def __init__(self, name: str, error: Exception | None = None):
        self.name, self.error = name, error
        self.logged: list[tuple[int, dict]] = []
        self.closed = 0

    def log(self, step, scalars):
        if self.error:
            raise self.error
        self.logged.append((step, scalars))

    def close(self):
        self.closed += 1


def test_a_failing_backend_is_told_once_switched_off_and_released(tmp_path):
    full = FakeBackend("tensorboard", OSError(28, "No space left on device"))
    fine = FakeBackend("wandb")
    told = []
    tracker = Tracker([full, fine], run_dir=RunDir(tmp_path), warn=told.append)
    for r in RECORDS:
        tracker.log_step(r)
    tracker.log_eval(2, 2.5)
    assert tracker.backends == ["wandb"]
    tracker.close()
    tracker.close()  # idempotent
    assert len(told) == 1
    assert "tensorboard failed while logging: OSError" in told[0] and "No space left" in told[0]
    assert str(tmp_path / "metrics.jsonl") in told[0]
    assert full.closed == 1 and fine.closed == 1
    assert [step for step, _ in fine.logged] == [0, 1, 2, 2] and fine.logged[-1][1] == {"val/loss": 2.5}


def test_a_failure_while_closing_is_told_and_the_other_backend_still_closes(tmp_path):
    class CloseFails(FakeBackend):
        def close(self):
            raise RuntimeError("wandb-core went away")

    other = FakeBackend("tensorboard")
    told = []
    Tracker([CloseFails("wandb"), other], run_dir=RunDir(tmp_path), warn=told.append).close()
    assert len(told) == 1 and "wandb failed while closing it" in told[0]
    assert other.closed == 1


# --- nothing asked ---------------------------------------------------------------------------

# A StepRecord's fields without importing metrics.py, which imports torch (seconds).
NO_OP_SCRIPT = """
import json, sys
from types import SimpleNamespace
from dsforge.job.run_dir import RunDir
from dsforge.runtime.loop.tracking import open_tracker
from tests.conftest import make_recipe

tracker = open_tracker(make_recipe(), RunDir(sys.argv[1]))
tracker.log_step(SimpleNamespace(step=0, warmup=True, loss=1.0, grad_norm=None, lr=0.1,
                                 step_time_s=1.0, tokens_per_s=1.0, tokens_per_s_per_gpu=1.0,
                                 tflops_per_gpu=0.0, mfu=None, hfu=None, peak_memory_bytes=1,
                                 memory_source="test", ended_at=None, loss_scale=None,
                                 breakdown_s=None, attention_share=None, mfu_documents=None))
tracker.log_eval(0, 1.0)
tracker.close()
print(json.dumps({"backends": tracker.backends, "loaded": sorted(
    m for m in sys.modules if m.split(".")[0] in ("wandb", "tensorboard")
    or m.startswith("torch.utils.tensorboard"))}))
"""


def test_a_tracker_with_nothing_asked_imports_neither_package_and_writes_nothing(tmp_path):
    result = subprocess.run([sys.executable, "-c", NO_OP_SCRIPT, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"backends": [], "loaded": []}
    assert list(tmp_path.iterdir()) == []


# --- Weights & Biases -----------------------------------------------------------------


@pytest.fixture
def wandb_sandbox(tmp_path, monkeypatch):
    """W&B offline unless a recipe says otherwise, without credentials, with HOME and its
    config, cache and data directories under tmp_path, and every HTTP(S) proxy pointed at a
    local socket that no request may reach."""
    pytest.importorskip("wandb", reason=WANDB_REASON)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                 "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_API_KEY", "WANDB_ERROR_REPORTING", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)  # restored after the test: the tracker sets one
    trap = socket.create_server(("127.0.0.1", 0))
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{trap.getsockname()[1]}")
    yield
    trap.setblocking(False)
    try:
        connection, _ = trap.accept()
    except BlockingIOError:
        trap.close()
        return
    connection.close()
    trap.close()
    pytest.fail("something tried to reach the network (through the HTTP(S) proxy)")


def live_children() -> set[int]:
    """Ids of this process's descendants that still run (zombies excluded)."""
    try:
        import psutil
    except ImportError:
        return _proc_children(os.getpid())
    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _proc_children(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while being read
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, todo = set(), [pid]
    while todo:
        pid = todo.pop()
        kids = {child for child, parent in parents.items() if parent == pid}
        found |= kids
        todo.extend(kids)
    return found


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []  # ended meanwhile


def assert_no_new_children(before: set[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := live_children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind after close(): {left}"


def wandb_records(path: Path):
    """W&B's Record protobufs from a run-ID.wandb transaction log: a 7-byte header (":W&B",
    magic, version) then LevelDB's log format (32 KiB blocks of chunks with a 7-byte header:
    CRC, length, type; types FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, chunks = 7, []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        chunks.append(data[position + 7:position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(b"".join(chunks))
            chunks = []


def read_offline_run(run_dir: RunDir) -> dict:
    """Each offline run's id, config, history rows and final summary, in start order."""
    runs = []
    for log in sorted(run_dir.wandb.glob("offline-run-*/run-*.wandb")):
        run = {"history": [], "summary": {}, "metrics": {}}
        for r in wandb_records(log):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["project"], run["name"] = r.run.run_id, r.run.project, r.run.display_name
                run["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
            elif kind == "history":
                run["history"].append({_key(i): json.loads(i.value_json) for i in r.history.item})
            elif kind == "summary":
                run["summary"].update({_key(u): json.loads(u.value_json) for u in r.summary.update})
            elif kind == "metric":
                run["metrics"][r.metric.glob_name or r.metric.name] = r.metric.step_metric
        runs.append(run)
    return runs


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_the_logged_values_and_leaves_no_process(wandb_sandbox, tmp_path):
    recipe = make_recipe("tracking.wandb=true", "tracking.wandb_mode=offline",
                         "tracking.wandb_project=tests")
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    before = live_children()
    tracker = open_tracker(recipe, run_dir, warn=pytest.fail)
    assert tracker.backends == ["wandb"] and os.environ["WANDB_ERROR_REPORTING"] == "false"
    # wandb-core reports none of its own errors to Sentry (it sends them unless told so).
    assert any("--no-observability" in command_line(pid) for pid in live_children() - before)
    for r in RECORDS:
        tracker.log_step(r)
    tracker.log_eval(2, 2.5)
    tracker.close()
    assert_no_new_children(before)

    [run] = read_offline_run(run_dir)
    assert run["id"] == (run_dir.wandb / WANDB_ID_FILE).read_text().strip()
    assert (run["project"], run["name"]) == ("tests", recipe.name)
    assert run["config"]["train"]["seq_len"] == recipe.train.seq_len
    assert run["metrics"]["*"] == "step"  # every chart's x axis is the training step
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in run["history"]]
    assert rows == [{"step": r.step, **step_scalars(r)} for r in RECORDS] + [{"step": 2, "val/loss": 2.5}]
    assert run["summary"]["train/loss"] == 3.0 and run["summary"]["val/loss"] == 2.5
    assert run["summary"]["perf/hfu"] == 0.625 and run["summary"]["step"] == 2


def test_wandb_resumed_run_continues_the_same_run(wandb_sandbox, tmp_path):
    recipe = make_recipe("tracking.wandb=true", "tracking.wandb_mode=offline")
    run_dir = RunDir(tmp_path)
    before = live_children()
    first = open_tracker(recipe, run_dir, warn=pytest.fail)
    first.log_step(RECORDS[0])
    first.close()
    again = open_tracker(recipe, run_dir, resumed_at=1, warn=pytest.fail)
    again.log_step(RECORDS[1])
    again.close()
    assert_no_new_children(before)
    runs = read_offline_run(run_dir)
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]  # `wandb sync` uploads both, in order
    assert [row["step"] for run in runs for row in run["history"]] == [0, 1]



def test_wandb_online_without_a_login_is_told_and_leaves_nothing(wandb_sandbox, tmp_path):
    """No API key (HOME and W&B's directories are empty ones): W&B fails before any network
    call (the proxy trap sees none), and the tracker goes on without it."""
    before = live_children()
    told = []
    tracker = open_tracker(make_recipe("tracking.wandb=true", "tracking.wandb_mode=online"),
                           RunDir(tmp_path), warn=told.append)
    assert tracker.backends == [] and len(told) == 1
    assert "wandb failed while opening it" in told[0] and "metrics.jsonl" in told[0]
    tracker.log_step(RECORDS[0])
    tracker.close()
    assert_no_new_children(before)



ON_A_TERMINAL_SCRIPT = """
import json, sys
from pathlib import Path
from dsforge.job.run_dir import RunDir
from dsforge.runtime.loop.tracking import open_tracker
from tests.conftest import make_recipe

told = []
tracker = open_tracker(make_recipe("tracking.wandb=true"), RunDir(sys.argv[1]), warn=told.append)
tracker.close()
Path(sys.argv[2]).write_text(json.dumps({"backends": tracker.backends, "told": told}))
"""


def run_on_a_terminal(args: list[str], timeout_s: float) -> tuple[int | None, str]:
    """Runs args with stdin, stdout and stderr a pseudo-terminal, as a rank started from a
    shell has; (exit status or None when killed at timeout_s, what it wrote)."""
    master, slave = os.openpty()
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=REPO)
    os.close(slave)
    output, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed its end
                    break
                output += chunk
        else:
            proc.kill()
            proc.wait()
            return None, output.decode(errors="replace")
        return proc.wait(timeout=30), output.decode(errors="replace")
    finally:
        os.close(master)


def test_wandb_online_without_a_login_on_a_terminal_does_not_prompt(wandb_sandbox, tmp_path,
                                                                      monkeypatch):
    """W&B would ask for an API key here and hold the job; it must fail at once instead."""
    monkeypatch.delenv("WANDB_SILENT")  # W&B prompts only when not silent
    result = tmp_path / "result.json"
    status, output = run_on_a_terminal(
        [sys.executable, "-c", ON_A_TERMINAL_SCRIPT, str(tmp_path), str(result)], timeout_s=60)
    assert status == 0, output
    outcome = json.loads(result.read_text())
    assert outcome["backends"] == [] and len(outcome["told"]) == 1, output
    assert "No API key configured" in outcome["told"][0]


# --- rule X1 -------------------------------------------------------------------------------


def only_installed(monkeypatch, *installed: str) -> None:
    """find_spec finds tensorboard and wandb only when named here; other packages as they are."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("tensorboard", "wandb"):
            return object() if name in installed else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_extras_names_the_package_and_the_pip_command(monkeypatch):
    only_installed(monkeypatch)
    problems = missing_extras(make_recipe("tracking.tensorboard=true", "tracking.wandb=true"))
    assert [(p.rule, p.fields, p.severity) for p in problems] == [
        ("X1", {"tracking.tensorboard": True}, "error"), ("X1", {"tracking.wandb": True}, "error")]
    assert "tensorboard package" in problems[0].message
    assert problems[0].fix == "pip install 'dsforge[tensorboard]', or set tracking.tensorboard: false"
    assert problems[1].fix == "pip install 'dsforge[wandb]', or set tracking.wandb: false"
    assert str(problems[1]).startswith("[X1] tracking.wandb=True: needs the wandb package")


def test_missing_extras_only_for_what_is_asked_and_missing(monkeypatch):
    only_installed(monkeypatch, "tensorboard")
    assert [p.fields for p in missing_extras(
        make_recipe("tracking.tensorboard=true", "tracking.wandb=true"))] == [{"tracking.wandb": True}]
    assert missing_extras(make_recipe("tracking.tensorboard=true")) == []
    only_installed(monkeypatch)
    assert missing_extras(make_recipe()) == []  # nothing asked, nothing needed


def test_the_step_breakdown_is_logged_per_phase():
    phases = {"data": 0.001, "forward": 0.05, "backward": 0.06, "other": 0.014}
    with_breakdown = dataclasses.replace(RECORDS[1], breakdown_s=phases)
    scalars = step_scalars(with_breakdown)
    assert {k: v for k, v in scalars.items() if k.startswith("time/")} == {
        "time/data_s": 0.001, "time/forward_s": 0.05, "time/backward_s": 0.06, "time/other_s": 0.014}
    assert not any(k.startswith("time/") for k in step_scalars(RECORDS[1]))
