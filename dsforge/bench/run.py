"""Run a study: validate every cell, run the valid ones as jobs, record every outcome.

Each cell and repeat is its own `dsforge` job (the launcher of launch/, its own process group,
reaped afterwards) with a wall-clock timeout. Outcomes: ok, oom, timeout, crashed (read from
the exit code and the ranks' failure records), or rejected (never started: an invalid recipe,
or, for a study on this machine, a job that does not fit it, as `dsforge run` would refuse it).

A cell's directory, OUT/cells/KEY/repeatN, has one owner at a time (dsforge/lock.py): a cell
whose lock another live bench holds, or whose earlier job still runs, is `busy` - not run and
not recorded. The owner empties the directory, runs the job, and writes the result to
RUN_DIR/result.json (atomically) before the database, so a result the database could not take
is imported by the next run instead of measured again. While another process holds the
database's lock the bench waits for it, saying so (db_timeout_s: as long as the study's cells
may run, or --db-timeout), and writes the row when the lock goes.

Rows already in the store are skipped; failed ones (oom/timeout/crashed) are run again with
`retry_failed`. Rejected cells are checked again on every run (no job starts for that): one
that dsforge now accepts runs, one still invalid keeps its row. Ctrl-C or SIGTERM while a cell
runs stops the study: the cell gets no row (Interrupted, with run_job's 130 or 128 + signal).

Each row carries the planner's prediction for its cell (`prediction`), the step time included
when the caller gives the step-time model and the cell ran on a GPU (`step_time_prediction`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsforge import lock
from dsforge.bench.store import EXIT_TRY_AGAIN, FAILED, BenchError, Row, Store, StoreLocked
from dsforge.bench.study import Cell, Study, expand, study_identity
from dsforge.cost.step_time import predicted_step_time
from dsforge.files import write_atomic
from dsforge.hardware import gpu_for_device_name
from dsforge.job import failure
from dsforge.job.metrics_file import median_breakdown, read_metrics
from dsforge.job.run_dir import RunDir
from dsforge.launch.commands import Placement, job_spec, launch_command
from dsforge.launch.diagnose import explain
from dsforge.launch.fit import Machine, device_for, device_run_problems, fit_problems
from dsforge.launch.local import free_port, run_job
from dsforge.launch.probe import probe
from dsforge.problems import RecipeError, errors
from dsforge.recipe import Resolved, resolve_file
from dsforge.recipe.loader import dump_recipe
from dsforge.recipe.tiny import tiny_resolved
from dsforge.translate.kernels import predicted_memory

# Exit codes of a launcher whose rank the kernel killed (SIGKILL, usually its OOM killer):
# the signal as Python reports it, as a shell does (128 + 9), and as the launchers do
# (sys.exit(-9), i.e. -9 & 0xff: dsforge's, launch/node.py, and DeepSpeed's).
_KILLED = (-9, 137, 247)
# run_job's codes when dsforge itself was stopped: SIGHUP, Ctrl-C (SIGINT), SIGTERM.
STOPPED = (129, 130, 143)

# The planner's step-time model (dsforge/cost/, a layer below bench): by default
# `predicted_step_time`, the default profile of a GPU; a caller may hand in another. Called
# with the cell's resolved recipe, the GPU's key (dsforge/hardware.py) and the GPUs per node;
# returns `StepTime.to_dict()`: each term and the total, in seconds per optimizer step.
StepTimeModel = Callable[[Resolved, str, int], dict]


class Interrupted(KeyboardInterrupt):
    """dsforge was stopped while a cell ran; the cell has no result. `code` is the exit status
    the study should end with (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, code: int, cell: Cell, repeat: int):
        super().__init__(code)
        self.code, self.cell, self.repeat = code, cell, repeat


@dataclass
class Outcome:
    """What a run of a study left undone: cells another owner held (not run, no row)."""

    busy: list[str] = field(default_factory=list)


def db_timeout_s(study: Study) -> float:
    """How long dsforge bench waits for another process's lock on its results database unless
    --db-timeout says: as long as the study's own cells may run, each cell and repeat's
    wall-clock limit (measure.timeout_s) times their number."""
    return study.measure.timeout_s * len(expand(study)) * study.measure.repeats


def bench_study(study: Study, recipe_path: Path, out_dir: Path, *, retry_failed: bool = False,
                tiny: bool = False, check_fit: bool = True, db_timeout: float | None = None,
                log: Callable[[str], None] = print,
                step_time_model: StepTimeModel = predicted_step_time) -> int:
    """`dsforge bench`: run_study with its store in OUT/results.db, as an exit status:
    0 when every cell has a result; EXIT_TRY_AGAIN (75) when cells were busy or the database
    stayed locked for longer than `db_timeout` seconds [db_timeout_s(study)] (nothing finished
    is lost: run the study again); 130 / 143 when stopped by Ctrl-C / SIGTERM (the cell in
    flight has no row); 2 for an unusable database or OUT."""
    try:
        wait_s = db_timeout_s(study) if db_timeout is None else db_timeout
        store = Store(out_dir / "results.db", timeout_s=wait_s,
                      waiting=lambda line: log(f"dsforge bench: {line}"))
    except BenchError as exc:  # a lock held since before it opened: StoreLocked, 75
        log(f"dsforge bench: {exc}")
        return exc.exit_code
    try:
        outcome = run_study(study, recipe_path, store, out_dir, retry_failed=retry_failed,
                            tiny=tiny, check_fit=check_fit, log=log, step_time_model=step_time_model)
    except Interrupted as stop:
        log(f"dsforge bench: stopped while {_label(stop.cell)} repeat {stop.repeat} ran; it has "
            "no result and runs when the study is run again")
        return stop.code
    except KeyboardInterrupt:
        log("dsforge bench: interrupted")
        return 130
    except StoreLocked as exc:
        kept = RunDir(out_dir / "cells" / "KEY" / "repeatN").bench_result  # a pattern, not a cell
        log("dsforge bench: " + str(StoreLocked(
            f"{exc.message}; each finished result is kept in its cell directory ({kept}) and "
            "imported when the study runs again", argument=exc.argument, value=exc.value,
            fix=exc.fix)))
        return exc.exit_code
    except BenchError as exc:
        log(f"dsforge bench: {exc}")
        return exc.exit_code
    finally:
        store.close()
    if outcome.busy:
        log(f"dsforge bench: {len(outcome.busy)} cell repeat(s) not run because another process "
            "owns them (see above); run the study again once it is done")
        return EXIT_TRY_AGAIN
    return 0


def run_study(study: Study, recipe_path: Path, store: Store, out_dir: Path, *,
              retry_failed: bool = False, tiny: bool = False, check_fit: bool = True,
              log: Callable[[str], None] = print,
              step_time_model: StepTimeModel = predicted_step_time) -> Outcome:
    """Every cell and repeat that has no finished row for this study's base; raises
    Interrupted when stopped, RecipeError if the base recipe does not load."""
    cells = expand(study, base=study_identity(study, recipe_path))
    try:
        (out_dir / "cells").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"cannot write the cells' directories: {exc.strerror or exc}",
                         argument="--out", value=out_dir) from None
    log(f"study {study.name}: {len(cells)} cells x {study.measure.repeats} repeats")
    outcome, kept = Outcome(), 0
    for index, cell in enumerate(cells, start=1):
        for repeat in range(study.measure.repeats):
            where = f"[{index}/{len(cells)}] {_label(cell)} repeat {repeat}"
            previous = _import_saved(study, cell, repeat, store, out_dir, log, where)
            if previous is not None and not _run_again(previous, retry_failed):
                kept += 1
                continue
            try:
                row = run_cell(study, recipe_path, cell, repeat, out_dir, tiny=tiny,
                               check_fit=check_fit, step_time_model=step_time_model)
            except lock.Busy as busy:
                outcome.busy.append(where)
                log(f"{where}: busy, not run ({busy})")
                continue
            if previous is not None and previous.status == row.status == "rejected" \
                    and previous.reason == row.reason:
                continue  # still invalid, for the same reasons
            store.write(row)
            log(f"{where}: {row.status}" + (f" ({row.reason})" if row.reason else ""))
    if kept:
        log(f"study {study.name}: {kept} cell repeat(s) already had a result and were not run "
            "again" + ("" if retry_failed else " (--retry-failed runs the failed ones again)"))
    return outcome


def _run_again(previous: Row, retry_failed: bool) -> bool:
    return previous.status == "rejected" or (retry_failed and previous.status in FAILED)


def _import_saved(study: Study, cell: Cell, repeat: int, store: Store, out_dir: Path,
                  log: Callable[[str], None], where: str) -> Row | None:
    """The cell's row, after importing its saved result if the store lacks it (a database
    that was locked, or a bench killed between the two writes)."""
    previous = store.get(study.name, cell.key, repeat)
    run_dir = cell_dir(out_dir, cell, repeat)
    saved = saved_result(run_dir, study.name, cell.key, repeat)
    if saved is not None and (previous is None or (previous.finished or 0) < saved.finished):
        store.write(saved)
        log(f"{where}: {saved.status} (imported from {run_dir.bench_result})")
        return saved
    return previous


def cell_dir(out_dir: Path, cell: Cell, repeat: int) -> RunDir:
    """One repeat of a cell runs in a run directory of its own, under OUT."""
    return RunDir(out_dir / "cells" / cell.key / f"repeat{repeat}")


def saved_result(run_dir: RunDir, study: str, key: str, repeat: int) -> Row | None:
    """RUN_DIR/result.json if it is a complete result of this study, cell and repeat."""
    try:
        row = Row(**json.loads(run_dir.bench_result.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return row if (row.study, row.cell, row.repeat) == (study, key, repeat) and row.finished else None


def _label(cell: Cell) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell.axes.items())


def run_cell(study: Study, recipe_path: Path, cell: Cell, repeat: int, out_dir: Path, *,
             tiny: bool = False, check_fit: bool = True,
             step_time_model: StepTimeModel = predicted_step_time) -> Row:
    """One repeat of one cell: `rejected` without a job if its recipe is invalid, or if
    `check_fit` and its job, on this machine, does not fit it (`fit_refusal`); otherwise
    its job, run while this process owns the cell's directory. Raises lock.Busy if another
    owner holds it and Interrupted if dsforge is stopped meanwhile. The row's prediction has
    the step time of `step_time_model` where the cell ran on a GPU (step_time_prediction)."""
    base = dict(study=study.name, cell=cell.key, repeat=repeat, axes=cell.axes)
    try:
        resolved = resolve_cell(study, recipe_path, cell, tiny)
    except RecipeError as exc:
        reason = "; ".join(str(p) for p in errors(exc.problems))
        return Row(**base, status="rejected", reason=reason, finished=time.time())
    device = "cpu" if tiny else study.device
    refusal = fit_refusal(resolved, device) if check_fit and study.hostfile is None else None
    if refusal:
        return Row(**base, status="rejected", reason=refusal, finished=time.time())
    run_dir = cell_dir(out_dir, cell, repeat)
    with lock.hold_directory(run_dir.path, what=f"dsforge bench {study.name} cell {cell.key} repeat {repeat}"):
        shutil.rmtree(run_dir.path, ignore_errors=True)  # an earlier attempt's files
        run_dir.path.mkdir(parents=True)
        started = time.monotonic()
        code = launch_cell(study, resolved, run_dir, device=device)
        if code in STOPPED:
            raise Interrupted(code, cell, repeat)
        status, reason = classify(code, run_dir)
        manifest = _read_json(run_dir.manifest)
        step = step_time_prediction(resolved, device=device, tiny=tiny, manifest=manifest,
                                    model=step_time_model)
        row = Row(**base, status=status, reason=reason, seconds=time.monotonic() - started,
                  recipe=dump_recipe(resolved.recipe), manifest=manifest,
                  figures=figures(run_dir) if status == "ok" else None,
                  prediction=prediction(resolved, step, device=ranks_device(manifest, device)),
                  finished=time.time())
        write_atomic(run_dir.bench_result, json.dumps(dataclasses.asdict(row)))
    return row


def fit_refusal(resolved: Resolved, device: str) -> str | None:
    """Why this machine cannot run the cell's job, as `dsforge run` would refuse it
    (launch/fit.py: more ranks than GPUs, a rank's memory over its GPU's, CPU ranks over the
    host's available memory, kernels, float8 or compiling its ranks cannot run), or None. Checked before each cell: CPU ranks share the host's
    memory, and a job larger than it takes that memory from everything else on the machine
    until the kernel kills something. A hostfile's hosts are not probed here."""
    probed = probe()
    machine = Machine.from_probe("this machine", probed)
    device = device_for(device, machine)
    refusals = errors(fit_problems(resolved, machine, device=device)
                      + device_run_problems(resolved, device, probed))
    if not refusals:
        return None
    # Without the fixes: they point at `dsforge run`'s ways forward, which a row does not have.
    return "does not fit this machine: " + "; ".join(str(dataclasses.replace(p, fix="")) for p in refusals)


def resolve_cell(study: Study, recipe_path: Path, cell: Cell, tiny: bool = False) -> Resolved:
    resolved = resolve_file(recipe_path, cell.overrides, world_size=study.world_size,
                            hostfile=study.hostfile, world_size_from="the study's world_size")
    return tiny_resolved(resolved, cell.overrides) if tiny else resolved


def launch_cell(study: Study, resolved: Resolved, run_dir: RunDir, device: str) -> int:
    """The cell's job; it ends if this bench dies (launch/keeper.py, job/owner.py), and
    its local processes carry the run directory (job word and DSFORGE_JOB_DIR) so the next
    owner of the cell can tell whether it still runs (dsforge/lock.py)."""
    run_dir = run_dir.absolute()
    job = job_spec(resolved, run_dir, device=device, step_timeout_s=study.measure.step_timeout_s,
                   census=True)
    placement = Placement(world_size=resolved.layout.world_size, hostfile=study.hostfile,
                          master_port=free_port())
    return run_job(launch_command(placement, job), timeout_s=study.measure.timeout_s,
                   env={**os.environ, lock.JOB_DIR_ENV: str(run_dir)}, log_path=run_dir.job_log)


def classify(code: int, run_dir: RunDir) -> tuple[str, str | None]:
    """ok / diverged / timeout / oom / crashed from the launcher's exit code and the ranks'
    failure records (job/failure.py): diverged when the training went bad (a non-finite loss
    or gradient, runtime/guard/health.py); a hang ended by a rank's watchdog is a timeout of
    one step; a rank killed by SIGKILL (usually the kernel's OOM killer) is oom, whatever its
    peers then recorded about the broken connection."""
    first = failure.first(run_dir)
    if first is not None and first.kind == "nonfinite":  # the ranks stopped together, exit 0
        return "diverged", one_line(first.headline())
    if code == 0 and run_dir.summary.exists():
        return "ok", None
    if code == 124:
        return "timeout", "exceeded the cell's wall-clock limit"
    if first is not None and first.kind in ("hang", "oom"):
        return {"hang": "timeout", "oom": "oom"}[first.kind], one_line(explain(first, run_dir))
    recorded_kill = first is not None and first.kind == "killed" and \
        first.message.startswith("killed by SIGKILL")
    if recorded_kill:
        return "oom", one_line(explain(first, run_dir))
    if code in _KILLED:
        return "oom", (f"a rank was killed by SIGKILL (launcher exit code {code}), usually the "
                       f"kernel's out-of-memory killer; see {run_dir.job_log}")
    if first is not None:
        return "crashed", one_line(explain(first, run_dir))
    return "crashed", f"exit code {code}; see {run_dir.job_log}"


# Terminal control sequences, and a progress bar as tqdm draws it
# ("desc:  40%|####      | 4/10 [00:01<00:02, 3.1it/s]"): never part of a reason.
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
_PROGRESS = re.compile(r"(?:^[^|]*?:[ \t]*)?\d{1,3}%\|[^|]*\|(?:[ \t]*[\d.]+[kMG]?/[\d.]+[kMG]?)?"
                       r"(?:[ \t]*\[[^\]]*\])?")
REASON_CHARS = 500


def one_line(text: str) -> str:
    """`text` as a reason: no escape sequences or progress bars, one line, at most
    REASON_CHARS characters."""
    pieces = (_PROGRESS.sub("", piece).strip() for piece in re.split(r"[\r\n]+", _ESCAPES.sub("", text)))
    line = re.sub(r"\s{2,}", " ", " ".join(piece for piece in pieces if piece))
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


def figures(run_dir: RunDir) -> dict:
    """Measured figures of one repeat: per-step times of the measured steps, throughput,
    MFU/HFU medians, the first step's and the last step's loss (did it learn), peak memory max over ranks, measured bubble per pipeline stage, the
    reporting rank's step breakdown (median seconds per phase; None without one)."""
    records, _ = read_metrics(run_dir.metrics)
    measured = [r for r in records if not r["warmup"]]
    ranks = [_read_json(p) for p in run_dir.rank_summaries()]
    bubbles: dict[int, list[float]] = {}
    for r in ranks:
        if r["bubble_share"] is not None:
            bubbles.setdefault(r["pp_rank"], []).append(r["bubble_share"])
    median = lambda key: statistics.median(r[key] for r in measured) if all(r[key] is not None for r in measured) else None
    return {
        "step_times_s": [r["step_time_s"] for r in measured],
        "tokens_per_s": median("tokens_per_s"), "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"),
        "mfu": median("mfu"), "hfu": median("hfu"), "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        "memory_source": ranks[0]["memory_source"],
        "bubble_share_by_stage": {str(k): statistics.median(v) for k, v in sorted(bubbles.items())},
        "breakdown_s": median_breakdown(r.get("breakdown_s") for r in measured),
        "tensor_bytes": largest_census(r.get("tensor_bytes") for r in ranks),
        **{f"tensor_bytes_{point}": largest_census(r.get(f"tensor_bytes_{point}") for r in ranks)
           for point in CENSUS_POINTS},
    }


# Where a measured run also takes the census inside a step (runtime/loop/step.py): when the step's
# last backward ends (before ZeRO reduces it), before `engine.step()`, and when the torch
# optimizer steps inside it (DeepSpeed's fp32 gradient made).
CENSUS_POINTS = ("backward", "step", "optimizer")


def largest_census(censuses) -> dict | None:
    """The live-tensor census holding the most (runtime/loop/tensor_census.py); None if there is none."""
    present = [c for c in censuses if c]
    return max(present, key=lambda c: c["total"]) if present else None


def ranks_device(manifest: dict | None, device: str) -> str:
    """The device type the cell's ranks ran on ("cpu" | "cuda"): the manifest's, else the
    study's device with `auto` read as no GPU."""
    recorded = ((manifest or {}).get("device") or {}).get("type")
    return recorded or ("cuda" if device == "cuda" else "cpu")


def prediction(resolved: Resolved, step_time: dict | None = None, *, device: str = "cpu") -> dict:
    """What `dsforge plan` predicts for the cell on `device` (memory per GPU, with the
    kernels the ranks run there; bubble; FLOPs per token), with `step_time`
    (step_time_prediction's keys) added."""
    from dsforge.estimate.bubble import bubble_fraction, bubble_share_of_step
    from dsforge.estimate.flops import flops_per_token

    r, lay = resolved.recipe, resolved.layout
    memory = predicted_memory(resolved, device)
    flops = flops_per_token(r.model, r.train.seq_len, r.train.activation_checkpointing)
    return {"memory_bytes": memory.to_dict(), "layout": dataclasses.asdict(lay),
            "bubble_fraction": bubble_fraction(lay.pp, lay.vpp, lay.num_microbatches),
            "bubble_share_of_step": bubble_share_of_step(lay.pp, lay.vpp, lay.num_microbatches),
            "flops_per_token": flops.model, "hardware_flops_per_token": flops.hardware,
            **(step_time or {})}


def step_time_prediction(resolved: Resolved, *, device: str, manifest: dict | None,
                         model: StepTimeModel = predicted_step_time, tiny: bool = False) -> dict:
    """The planner's step time for the cell on the GPU it ran on, as stored in its prediction:
    `step_time_s` (the total), `step_time_terms` (StepTime.to_dict()) and `step_time_profile`
    (which GPU's default profile, why that GPU, GPUs per node). Where there is no GPU profile
    to predict with, `step_time_s` is None and `step_time_why` says why: a CPU cell (`device`
    cpu, `tiny`, or a manifest that says the ranks ran on CPU) has none, and no CPU figure is
    made up. The GPU: the one the manifest names when dsforge/hardware.py knows it, else the
    recipe's cluster.gpu."""
    ran_on = (manifest or {}).get("device") or {}
    if tiny or device == "cpu" or ran_on.get("type") == "cpu":
        how = "--tiny" if tiny else "the study's device: cpu" if device == "cpu" else "no GPU was found"
        return _no_step_time(f"the cell ran on CPU ({how}): the step-time model has GPU profiles "
                             "only (dsforge/cost/profile.py), so there is no CPU prediction")
    name = ran_on.get("name") if ran_on.get("type") == "cuda" else None
    gpu = gpu_for_device_name(name) if name else None
    named = resolved.recipe.cluster.gpu if resolved.recipe.cluster else None
    if gpu is not None:
        key = gpu.key
        source = f"the device the cell ran on ({name})"
        if named and named != key:
            source += f"; the recipe's cluster.gpu is {named}"
    elif named:
        key = named
        source = "the recipe's cluster.gpu" + (f" ({name} is not in dsforge/hardware.py)" if name else "")
    else:
        unknown = f"the device {name} is not in dsforge/hardware.py" if name else "no device was recorded"
        return _no_step_time(f"no GPU profile: {unknown} and the recipe names no cluster.gpu")
    slots = resolved.topology.node_slots
    per_node = max(slots) if slots else resolved.layout.world_size  # one machine
    terms = model(resolved, key, per_node)
    return {"step_time_s": terms["total"], "step_time_terms": terms,
            "step_time_profile": {"gpu": key, "gpus_per_node": per_node, "profile": "default",
                                  "source": source}}


def _no_step_time(why: str) -> dict:
    return {"step_time_s": None, "step_time_why": why}


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None
