#!/usr/bin/env python3
"""The dsforge GPU kit's driver (benchmarks/gpu/README.md).

    python3 benchmarks/gpu/kit.py [--dry-run] [--out DIR] [--gpu KEY] [--budget S] MEASUREMENT...
    python3 benchmarks/gpu/kit.py --list            # selections, measurements, estimates
    python3 benchmarks/gpu/kit.py --check-wheels    # what build_kit.sh built

MEASUREMENT is a name from kit_plan.MEASUREMENTS, a selection (kit_plan.SELECTIONS:
`essential`, `levers`, `sweeps`) or `all`. On the GPU machine (run.sh calls this) the steps run
one after another from the repository root: install the carried wheels, check the environment,
then the measurements, each within what is left of the command's budget (a step that no
longer fits is skipped and says so). The steps run with the machine's environment as a user
has it: the kit sets nothing dsforge itself does not (TORCH_CUDA_ARCH_LIST stays as the image
sets it). Everything lands in --out (the device tool's $OUT) as a results folder ready to commit
(kit_records.pack_out): table.md, results.json, peers.json and peers.png where peers ran, each
run's summary, manifest, recipe and metrics.jsonl, and records.tar.gz with the rest (kit.log,
logs, plans, bench databases); machine paths written as <checkout>, <home>, <work>, <out>.
torch_extensions.tar.gz comes back when DeepSpeed built ops (carry it to the next command).
The table is printed last.

--dry-run needs no GPU: it checks the wheels and pins, every recipe and study the measurements
use (valid for one GPU, fitting the H100 and H200 by dsforge's memory model, no two runs
alike), each selection's estimated duration against its limit (the essential one within one
command of 8 minutes, install and environment included), prints the exact commands with the
basis of each estimate, and renders the table from invented inputs (GEMMs measured on the CPU
at tiny shapes). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[1]
for _path in (str(KIT), str(REPO)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import corpus as kit_corpus
import kit_checks
import kit_fake
import kit_peers
import kit_plan
import kit_records
import kit_results
import kit_steps
import kit_table
import kit_wheels
from kit_plan import CALL_BUDGET_S, MEASUREMENTS, PLANNED_GPUS, SELECTIONS
from kit_steps import Context, Step

DEFAULT_WORK = Path(kit_records.DEFAULT_WORK)
EXTENSION_CACHE = kit_wheels.WHEELS / "cache" / "torch_extensions.tar.gz"
RETURN_FILE_LIMIT = 16 * 1024**2  # the device tool's limit per returned file
SAMPLED = ("pytest", "run", "bench", "adam")  # steps whose peak GPU memory nvidia-smi records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kit.py", description=__doc__.splitlines()[0])
    parser.add_argument("measurements", nargs="*", metavar="MEASUREMENT")
    parser.add_argument("--dry-run", action="store_true", help="check and print; no GPU needed")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or DEFAULT_WORK / "out"))
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scratch folder")
    parser.add_argument("--gpu", choices=PLANNED_GPUS, help="plan for this GPU [detected; "
                                                            "h100 in a dry run]")
    parser.add_argument("--budget", type=float, default=CALL_BUDGET_S,
                        help="seconds this command may take before steps are skipped "
                             f"[{CALL_BUDGET_S}; the essential command: {kit_plan.ESSENTIAL_BUDGET_S}]")
    parser.add_argument("--wheels", type=Path, default=kit_wheels.WHEELS)
    parser.add_argument("--imports", action="store_true",
                        help="dry run: also import dsforge's runtime (deepspeed, megatron-core) "
                             "and check every distribution it loads is carried or in the image")
    parser.add_argument("--list", action="store_true", help="list the selections and measurements")
    parser.add_argument("--check-wheels", action="store_true", help="check the wheels folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.command = shlex.join(["bash", "benchmarks/gpu/run.sh", *(sys.argv[1:] if argv is None else argv)])
    kit_plan.use_corpus(args.wheels / "corpus" / kit_corpus.NAME)
    if args.list:
        plan_on_any_corpus()
        print("\n".join(list_lines()))
        return 0
    if args.check_wheels:
        lines, problems = kit_checks.wheel_check(args.wheels)
        print("\n".join(lines))
        return 1 if problems else 0
    try:
        measurements = kit_plan.select(args.measurements)
    except ValueError as exc:
        print(f"kit.py: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(measurements, args)
    return execute(measurements, args)


def plan_on_any_corpus() -> None:
    """The stand-in where the corpus is not built here: a recipe resolves only on a data file
    that exists, and no estimate depends on the text the runs read."""
    if not kit_corpus.built(kit_plan.corpus()):
        kit_plan.use_corpus(kit_corpus.stand_in())


def list_lines() -> list[str]:
    lines = []
    for selection, names in SELECTIONS.items():
        seconds = "; ".join(f"~{kit_steps.selection_seconds(selection, g) / 60:.1f} min on {g}"
                            for g in PLANNED_GPUS)
        lines.append(f"{selection} ({seconds}, install and environment included): {' '.join(names)}")
        lines += [f"  {n}: {MEASUREMENTS[n].about}" for n in names]
    return lines


# ---------------------------------------------------------------------------------------------
# Dry run


def command_lines(steps: list[Step]) -> list[str]:
    lines = []
    for s in steps:
        head = f"# {s.name} ({s.kind}; ~{s.expected_s:.0f} s, limit {s.timeout_s:.0f} s; {s.basis})"
        if s.kind == "skip":
            lines.append(f"# {s.name}: skipped: {s.note}")
        elif s.kind == "plan":
            lines += [f"# {s.name}: {s.note}; equivalent to", shlex.join(s.argv)]
        else:
            lines += [head + (f"; {s.note}" if s.note else ""), shlex.join(s.argv)]
    return lines


def fake_table(steps: list[Step], gpu: str, selected: list[str]) -> str:
    """The table from invented run/test/study inputs, this CPU's environment and GEMMs measured
    on the CPU at tiny shapes."""
    import gemm
    import probe_env

    with tempfile.TemporaryDirectory(prefix="dsforge-kit-dry-") as tmp:
        work = Path(tmp)
        records = kit_fake.write_fake_inputs(steps, work, gpu)
        records.update({s.name: {"status": "fake", "seconds": s.expected_s} for s in steps
                        if s.kind in ("install", "env")})
        facts = probe_env.collect(quick=True)
        (work / "env.json").write_text(json.dumps(facts))
        if "gemm" in selected:
            measured = gemm.run(list(kit_steps.gemm_recipes()), gpu, tiny=True, reps=2, warmup=1)
            (work / "gemm.json").write_text(json.dumps(measured))
        return kit_table.render(kit_results.collect(steps, records, work, gpu), fake=True)


def dry_run(measurements: list[kit_plan.Measurement], args: argparse.Namespace) -> int:
    gpu = args.gpu or "h100"
    names = [m.name for m in measurements]
    print(f"dsforge GPU kit: dry run for {gpu} ({' '.join(names)}); no GPU is used and nothing "
          "is measured")
    problems = []
    corpus_lines, stand_in = kit_checks.corpus_check(names)
    print("\n".join(corpus_lines))
    if stand_in is not None:
        kit_plan.use_corpus(stand_in)
    checks = [lambda: kit_checks.wheel_check(args.wheels), kit_checks.spec_check,
              kit_checks.selection_check]
    checks += [kit_checks.import_check] if args.imports else []
    for check in checks:
        lines, found = check()
        print("\n".join(lines))
        problems += found
    ctx = Context(gpu=gpu, python="python3", work=args.work)
    steps = kit_steps.steps(measurements, ctx)
    print(f"commands on the {gpu} machine, from the repository root "
          f"(~{sum(s.expected_s for s in steps):.0f} s):")
    print("\n".join(command_lines(steps)))
    print(fake_table(steps, gpu, names))
    print("\n".join([f"dry run: {len(problems)} problem(s)", *(f"  problem: {p}" for p in problems)])
          if problems else "dry run: ok")
    return 1 if problems else 0


# ---------------------------------------------------------------------------------------------
# On the GPU machine


class Log:
    """Prints and keeps a copy in OUT/kit.log."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")


class SmiSampler:
    """The peak of nvidia-smi's memory.used while a step runs (every 200 ms): the job's
    reserved memory plus its CUDA context and NCCL buffers, next to dsforge's
    max_memory_allocated. Read-only: it changes nothing on the card."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.peak_mib: int | None = None
        self.proc = self.thread = None

    def __enter__(self) -> SmiSampler:
        if self.enabled:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used",
                                          "--format=csv,noheader,nounits", "-lms", "200"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.thread = threading.Thread(target=self._read, daemon=True)
            self.thread.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.peak_mib = max(self.peak_mib or 0, int(line.strip()))

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.thread.join(timeout=5)

    @property
    def peak_bytes(self) -> int | None:
        return None if self.peak_mib is None else self.peak_mib * 1024**2


def detect_gpu(log: Log) -> str:
    from dsforge.hardware import gpu_for_device_name

    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else ""
    gpu = gpu_for_device_name(out.splitlines()[0]) if out else None
    if gpu is not None and gpu.key in PLANNED_GPUS:
        return gpu.key
    log(f"kit: GPU {out or '(none found)'!r} is not one the kit plans for; planning as h100")
    return "h100"


def step_environment(work: Path) -> dict[str, str]:
    """The working tree's dsforge first on the path (for the ranks DeepSpeed starts too),
    unbuffered output, DeepSpeed's JIT builds in the work folder. Nothing else: the machine's
    environment stays as a user has it (issue 21: no fix inside the kit that dsforge itself
    does not apply; TORCH_CUDA_ARCH_LIST is the image's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"),
               DSFORGE_RUNS=str(work / "runs"))
    return env


def installed(step: Step) -> bool:
    """Are the versions the install step names already installed?"""
    from importlib.metadata import PackageNotFoundError, version

    wanted = [a.split("==") for a in step.argv if "==" in a]
    try:
        return all(version(name) == pinned for name, pinned in wanted)
    except PackageNotFoundError:
        return False


def run_command(argv: tuple[str, ...], log_path: Path, env: dict, timeout: float) -> int:
    """The command in its own process group, output to `log_path`; 124 after `timeout` (its
    group gets SIGTERM - dsforge then stops its job - and SIGKILL 30 s later)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return 124


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_plan(step: Step, ctx: Context) -> dict:
    """`dsforge plan --json` for the run, computed in this process (megatron-core imported
    once, not once per run), with the planner's step time on the GPU's profile as shipped
    (`step_time`, as bench stores with each cell): written before the run starts."""
    from dsforge.cost.step_time import predicted_step_time
    from dsforge.plan import build_plan

    try:
        resolved = kit_steps.resolve_run(step.spec, ctx.gpu)
        plan = {**build_plan(resolved, device="cuda"),
                "step_time": predicted_step_time(resolved, ctx.gpu, gpus_per_node=1)}
    except Exception as exc:  # recorded, and the run still goes ahead
        return {"status": "failed", "note": f"{type(exc).__name__}: {exc}"}
    path = ctx.work / "plans" / f"{step.spec.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2) + "\n")
    return {"status": "ok"}


def write_peer_shape(step: Step, ctx: Context) -> None:
    """The model the peer builds, from its dsforge run's recipe; an earlier output removed."""
    measurement = MEASUREMENTS[step.measurement]
    spec = next(r for r in measurement.runs if r.label == step.spec.matches)
    kit_peers.write_shape(step.spec, spec, ctx.gpu, ctx.work)
    kit_steps.peer_paths(step.spec, ctx.work)[1].unlink(missing_ok=True)


def run_step(step: Step, ctx: Context, env: dict, deadline: float, log: Log) -> dict:
    if step.kind == "skip":
        return {"status": "skipped", "note": step.note}
    if step.kind == "install" and installed(step):
        return {"status": "ok", "note": "already installed"}
    if step.kind == "plan":
        return run_plan(step, ctx)
    left = deadline - time.monotonic()
    if left < step.expected_s:
        return {"status": "skipped", "note": f"not enough time left in this command (~{step.expected_s:.0f} s "
                                             f"needed, {left:.0f} s left)"}
    if step.kind == "run":  # an earlier command's run on this machine: dsforge wants it empty
        shutil.rmtree(ctx.work / "runs" / step.spec.label, ignore_errors=True)
    if step.kind == "search":  # --measure would reuse an earlier command's finished trials
        shutil.rmtree(ctx.work / kit_steps.LOOP_OUT, ignore_errors=True)
    if step.kind == "peer":
        write_peer_shape(step, ctx)
    if step.kind == "bench":  # an earlier command's cells would count as finished
        shutil.rmtree(ctx.work / "bench" / step.spec.label, ignore_errors=True)
        kit_steps.write_study(step.spec, ctx.work)
    log_path = ctx.work / "logs" / f"{step.name}.log"
    started = time.monotonic()
    with SmiSampler(step.kind in SAMPLED) as smi:
        code = run_command(step.argv, log_path, env, min(step.timeout_s, left))
    record = {"status": "ok" if code == 0 else "timeout" if code == 124 else f"failed ({code})",
              "seconds": time.monotonic() - started, "returncode": code,
              "smi_peak_bytes": smi.peak_bytes}
    if code != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        log("\n".join(f"    | {line}" for line in tail))
    return record


def restore_extension_cache(work: Path, log: Log) -> None:
    """A carried build of DeepSpeed's ops (an earlier command's torch_extensions.tar.gz), with
    every file made newer than the sources just installed so ninja keeps them."""
    if not EXTENSION_CACHE.is_file():
        return
    target = work / "torch_extensions"
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(EXTENSION_CACHE) as archive:
        archive.extractall(target, filter="data")
    now = time.time()
    for path in target.rglob("*"):
        os.utime(path, (now, now))
    log(f"kit: restored DeepSpeed's op builds from {EXTENSION_CACHE.relative_to(REPO)}")


def write_outputs(steps: list[Step], records: dict, ctx: Context, out: Path, command: str) -> str:
    """OUT as a packed results folder (kit_records.pack_out): table.md, results.json,
    peers.json and its chart, each run's summary, manifest, recipe and metrics, the rest in
    records.tar.gz, machine paths written as <checkout>, <home>, <work>, <out>. Rewritten after
    every step, so a command cut short still returns what it measured; returns the table."""
    result = kit_results.collect(steps, records, ctx.work, ctx.gpu)
    result["command"] = command
    table = kit_table.render(result)
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "table.md").write_text(table)
    if result["peers"]:
        (out / "peers.json").write_text(json.dumps(result["peers"], indent=2) + "\n")
        kit_peers.chart(result["peers"], out / "peers.png")
    pack(ctx, out, final=False)
    return table


def pack(ctx: Context, out: Path, final: bool) -> None:
    kit_records.pack_out(out, ctx.work, kit_records.default_places(REPO, ctx.work, out), final=final)


def save_extension_cache(work: Path, out: Path, log: Log) -> None:
    built = work / "torch_extensions"
    if not any(built.rglob("*.so")):
        return
    target = out / "torch_extensions.tar.gz"
    with tarfile.open(target, "w:gz") as archive:
        archive.add(built, arcname=".")
    if target.stat().st_size > RETURN_FILE_LIMIT:
        target.unlink()
        log("kit: DeepSpeed's op builds are over 16 MiB; not returned")


def execute(measurements: list[kit_plan.Measurement], args: argparse.Namespace) -> int:
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "kit.log")
    if not kit_corpus.built(kit_plan.corpus()):
        log(f"kit: no corpus at {kit_plan.corpus()} (every run trains on it): run bash "
            "benchmarks/gpu/build_kit.sh here and carry benchmarks/gpu/wheels")
        return 2
    ctx = Context(gpu=args.gpu or detect_gpu(log), python=sys.executable, work=args.work)
    steps = kit_steps.steps(measurements, ctx)
    env, records = step_environment(args.work), {}
    log(f"kit: {len(steps)} steps for {ctx.gpu} ({' '.join(m.name for m in measurements)}), "
        f"budget {args.budget:.0f} s, work folder {args.work}")
    for index, step in enumerate(steps):
        record = run_step(step, ctx, env, start + args.budget, log)
        records[step.name] = record
        log(f"[{time.monotonic() - start:5.0f} s] {step.name}: {record['status']}"
            + (f" ({record['note']})" if record.get("note") else ""))
        if step.kind == "install" and record["status"] == "ok":
            restore_extension_cache(args.work, log)
        if step.required and record["status"] != "ok":
            for later in steps[index + 1:]:
                records[later.name] = {"status": "not run", "note": f"{step.name} failed"}
            break
        write_outputs(steps, records, ctx, args.out, args.command)
    save_extension_cache(args.work, args.out, log)
    log(write_outputs(steps, records, ctx, args.out, args.command))
    pack(ctx, args.out, final=True)  # kit.log into the archive: nothing is logged after this
    if (args.out / kit_records.ARCHIVE).stat().st_size > RETURN_FILE_LIMIT:
        print(f"kit: {kit_records.ARCHIVE} is over the 16 MiB the device tool returns; it will "
              "not come back", flush=True)
    return 0 if all(r["status"] in ("ok", "skipped") for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
