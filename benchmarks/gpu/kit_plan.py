"""What the kit measures on one GPU, and the exact commands that measure it.

A measurement (MEASUREMENTS) is a named list of runs, studies or one script; CALLS groups them
into device-tool calls of at most 10 minutes each, and every call starts with the install and
environment steps. `steps(...)` turns a selection into Steps: command lines run from the
repository root, each with an estimated duration (`expected_s`, a guess until a GPU has run
them) and a hard limit (`timeout_s`). Runs that dsforge's memory model says do not fit the GPU
become `skip` steps with the reason: the kit spends no device time on them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kit_wheels import REPO, dsforge_version, read_pins

from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.hardware import gpu_by_key
from dsforge.estimate.memory import estimate_memory
from dsforge.recipe import Resolved, resolve_file

GiB = 1024**3
PLANNED_GPUS = ("h100", "h200")  # the kinds the device tool lends
CALL_BUDGET_S = 560  # a device-tool command may run 600 s; 40 s stay for the table and archive
# The first training job on a fresh machine JIT-compiles DeepSpeed's FusedAdam with nvcc
# (an estimate; a carried build cache may make it ~0, see README).
JIT_BUILD_S = 90.0
KIT_DIR = "benchmarks/gpu"


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One `dsforge run` on one GPU."""
    label: str  # unique; names the run directory
    recipe: str  # relative to the repository root
    overrides: tuple[str, ...] = ()
    gpus: tuple[str, ...] = PLANNED_GPUS  # the GPUs it is planned for
    expected_s: float = 35.0
    timeout_s: float = 300.0

    def all_overrides(self, gpu: str) -> tuple[str, ...]:
        return (*self.overrides, f"cluster.gpu={gpu}")


@dataclass(frozen=True, kw_only=True)
class StudySpec:
    """One `dsforge bench` study, then `dsforge report` on its results."""
    label: str
    study: str  # relative to the repository root
    expected_s: float
    timeout_s: float


@dataclass(frozen=True, kw_only=True)
class Measurement:
    name: str
    call: int  # the device-tool call it belongs to
    about: str
    runs: tuple[RunSpec, ...] = ()
    studies: tuple[StudySpec, ...] = ()
    script: str | None = None  # "gpu-tests" or "gemm"
    expected_s: float = 0.0  # for a script
    timeout_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Step:
    name: str  # unique in a call; names its log file
    kind: str  # install | env | pytest | gemm | plan | run | bench | report | skip
    argv: tuple[str, ...] = ()
    expected_s: float = 0.0
    timeout_s: float = 0.0
    spec: RunSpec | StudySpec | None = None
    measurement: str = ""
    required: bool = False  # the call stops when it fails
    note: str = ""  # why a step is skipped, or what an in-process step does


@dataclass(frozen=True, kw_only=True)
class Context:
    gpu: str  # key in dsforge.estimate.hardware
    python: str  # the interpreter the commands use
    work: Path  # scratch folder for run directories and logs


def _sweep(size: str, recipe: str, cells: tuple[tuple[str, int], ...], expected_s: float,
           timeout_s: float) -> tuple[RunSpec, ...]:
    return tuple(RunSpec(label=f"{size}-{ac}-mb{mb}", recipe=recipe,
                         overrides=(f"train.activation_checkpointing={ac}", f"train.micro_batch={mb}"),
                         expected_s=expected_s, timeout_s=timeout_s) for ac, mb in cells)


_AC_X_MB = tuple((ac, mb) for ac in ("none", "selective", "full") for mb in (1, 2))
_SEVEN_B = "recipes/7b_1gpu.yaml"
_SHORT = ("train.steps=8", "train.timing_warmup=3")

MEASUREMENTS: dict[str, Measurement] = {m.name: m for m in (
    Measurement(name="gpu-tests", call=1, script="gpu-tests", expected_s=150, timeout_s=360,
                about="pytest tests/gpu: the smoke recipe in bf16 through NCCL on one rank, and "
                      "bf16 against fp32 loss (the first run also JIT-builds DeepSpeed's FusedAdam)"),
    Measurement(name="gemm", call=1, script="gemm", expected_s=60, timeout_s=180,
                about="bf16 GEMM and flash-attention throughput at the 1B/3B/7B shapes against "
                      "the planner's compute_efficiency (dsforge/search/profile.py)"),
    Measurement(name="zero", call=1,
                studies=(StudySpec(label="zero-1b", study=f"{KIT_DIR}/studies/zero_1b.yaml",
                                   expected_s=140, timeout_s=360),),
                about="dsforge bench: ZeRO 0-3 on the 1B model (dp 1), predicted vs measured "
                      "memory and the live-tensor census; dsforge report"),
    Measurement(name="mfu-1b", call=3, about="~1.2B model: activation checkpointing none/selective/"
                                              "full x micro-batch 1/2, seq 4096",
                runs=_sweep("1b", f"{KIT_DIR}/recipes/1b_1gpu.yaml", _AC_X_MB, 35, 240)),
    Measurement(name="mfu-3b", call=3, about="~3.2B model: checkpointing none/selective/full at "
                                              "micro-batch 1, full at 2, seq 4096",
                runs=_sweep("3b", f"{KIT_DIR}/recipes/3b_1gpu.yaml",
                            (("none", 1), ("selective", 1), ("full", 1), ("full", 2)), 45, 300)),
    Measurement(name="mfu-7b", call=2,
                about="Llama-2 7B: on an H200 recipes/7b_1gpu.yaml (ZeRO 3 on one GPU, full checkpointing) "
                      "at micro-batch 1 and 2; on an H100 with the optimizer offloaded to the CPU",
                runs=(RunSpec(label="7b-full-mb1", recipe=_SEVEN_B, overrides=_SHORT, gpus=("h200",),
                              expected_s=100, timeout_s=300),
                      RunSpec(label="7b-full-mb2", recipe=_SEVEN_B,
                              overrides=(*_SHORT, "train.micro_batch=2"), gpus=("h200",),
                              expected_s=110, timeout_s=300),
                      RunSpec(label="7b-offload-selective-mb1",
                              recipe=f"{KIT_DIR}/recipes/7b_1gpu_offload.yaml", gpus=("h100",),
                              expected_s=240, timeout_s=420))),
)}
# In the order to run them: correctness and memory first, then the 7B anchor, then the sweeps
# (the call most worth losing if device time runs short).
CALLS: dict[int, tuple[str, ...]] = {1: ("gpu-tests", "gemm", "zero"), 2: ("mfu-7b",),
                                     3: ("mfu-1b", "mfu-3b")}


def select(names: list[str]) -> list[Measurement]:
    """Measurement names, `callN` for a call's measurements or `all`, in the order given,
    each once. ValueError names what is unknown."""
    chosen: list[str] = []
    for name in names:
        if name == "all":
            expanded = [m for call in sorted(CALLS) for m in CALLS[call]]
        elif name.startswith("call") and name[4:].isdigit() and int(name[4:]) in CALLS:
            expanded = list(CALLS[int(name[4:])])
        elif name in MEASUREMENTS:
            expanded = [name]
        else:
            known = ", ".join([*MEASUREMENTS, *(f"call{c}" for c in CALLS), "all"])
            raise ValueError(f"unknown measurement {name!r}; known: {known}")
        chosen += [n for n in expanded if n not in chosen]
    if not chosen:
        raise ValueError("name at least one measurement (or callN, or all)")
    return [MEASUREMENTS[n] for n in chosen]


def resolve_run(spec: RunSpec, gpu: str) -> Resolved:
    """The run's recipe as `dsforge run --world-size 1` resolves it (RecipeError if invalid)."""
    return resolve_file(REPO / spec.recipe, spec.all_overrides(gpu), world_size=1)


def prediction(resolved: Resolved) -> dict:
    """What `dsforge plan --json` says about memory and FLOPs (the same functions)."""
    r = resolved.recipe
    memory = estimate_memory(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout)
    flops = flops_per_token(r.model, r.train.seq_len, r.train.activation_checkpointing)
    return {"memory_bytes": memory.to_dict(), "flops_per_token": flops.model,
            "hardware_flops_per_token": flops.hardware}


def fit_note(resolved: Resolved, gpu: str) -> str | None:
    """None if the run fits the GPU by dsforge's memory model, else why not."""
    total = prediction(resolved)["memory_bytes"]["total"]
    card = gpu_by_key(gpu)
    if total <= card.memory_bytes:
        return None
    return (f"predicted {total / GiB:.1f} GiB per GPU > {card.memory_bytes / GiB:.1f} GiB on "
            f"the {card.name}")


def steps(measurements: list[Measurement], ctx: Context) -> list[Step]:
    """Every step of one call: install and environment first, then each measurement's."""
    out = setup_steps(ctx)
    for m in measurements:
        if m.script == "gpu-tests":
            out.append(_pytest_step(m, ctx))
        elif m.script == "gemm":
            out.append(_gemm_step(m, ctx))
        for spec in m.runs:
            out += run_steps(spec, m.name, ctx)
        for study in m.studies:
            out += study_steps(study, m.name, ctx)
    return _with_jit_build(out)


def _with_jit_build(out: list[Step]) -> list[Step]:
    """The first training job pays for the FusedAdam build."""
    for index, step in enumerate(out):
        if step.kind in ("pytest", "run", "bench"):
            timeout = step.timeout_s + JIT_BUILD_S
            argv = _job_timeout(step.argv, timeout) if step.kind == "run" else step.argv
            out[index] = dataclasses.replace(step, expected_s=step.expected_s + JIT_BUILD_S,
                                             timeout_s=timeout, argv=argv)
            break
    return out


def _job_timeout(argv: tuple[str, ...], timeout_s: float) -> tuple[str, ...]:
    """A run's argv with dsforge's own --timeout 30 s inside the step's limit, so dsforge
    stops its job (and says so) before the kit has to."""
    changed = list(argv)
    changed[changed.index("--timeout") + 1] = f"{timeout_s - 30:.0f}"
    return tuple(changed)


def install_requirements() -> list[str]:
    """What the install step asks pip for; pip takes the rest from the wheels folder as
    needed (packages the image already has at suitable versions stay as they are)."""
    pins = {p.name: p.version for p in read_pins()}
    return [f"dsforge=={dsforge_version()}", f"deepspeed=={pins['deepspeed']}",
            f"megatron-core=={pins['megatron-core']}"]


def setup_steps(ctx: Context) -> list[Step]:
    install = (ctx.python, "-m", "pip", "install", "--no-index", "--find-links",
               f"{KIT_DIR}/wheels", *install_requirements())
    return [Step(name="install", kind="install", argv=install, expected_s=40, timeout_s=240,
                 required=True, note="skipped when these versions are already installed"),
            Step(name="env", kind="env", expected_s=20, timeout_s=120, required=True,
                 argv=(ctx.python, f"{KIT_DIR}/probe_env.py", "--out", str(ctx.work / "env.json")))]


def _pytest_step(m: Measurement, ctx: Context) -> Step:
    argv = (ctx.python, "-m", "pytest", "tests/gpu", "-v", "-rA", "-p", "no:cacheprovider",
            "--basetemp", str(ctx.work / "pytest"), "--junitxml", str(ctx.work / "gpu-tests.xml"))
    return Step(name=m.name, kind="pytest", argv=argv, expected_s=m.expected_s,
                timeout_s=m.timeout_s, measurement=m.name)


def gemm_recipes() -> tuple[str, ...]:
    return (f"{KIT_DIR}/recipes/1b_1gpu.yaml", f"{KIT_DIR}/recipes/3b_1gpu.yaml", _SEVEN_B)


def _gemm_step(m: Measurement, ctx: Context) -> Step:
    argv = [ctx.python, f"{KIT_DIR}/gemm.py", "--gpu", ctx.gpu, "--out", str(ctx.work / "gemm.json")]
    for recipe in gemm_recipes():
        argv += ["--recipe", recipe]
    return Step(name=m.name, kind="gemm", argv=tuple(argv), expected_s=m.expected_s,
                timeout_s=m.timeout_s, measurement=m.name)


def run_steps(spec: RunSpec, measurement: str, ctx: Context) -> list[Step]:
    """The plan (in-process) and the run; a skip if it is not planned for this GPU or does
    not fit it."""
    if ctx.gpu not in spec.gpus:
        return []
    note = fit_note(resolve_run(spec, ctx.gpu), ctx.gpu)
    if note is not None:
        return [Step(name=spec.label, kind="skip", spec=spec, measurement=measurement, note=note)]
    sets = [word for item in spec.all_overrides(ctx.gpu) for word in ("--set", item)]
    plan = (ctx.python, "-m", "dsforge", "plan", spec.recipe, "--world-size", "1", "--device",
            "cuda", "--json", *sets)
    run = (ctx.python, "-m", "dsforge", "run", spec.recipe, "--world-size", "1", "--run-dir",
           str(ctx.work / "runs" / spec.label), "--timeout", "0", *sets)
    return [Step(name=f"{spec.label}.plan", kind="plan", argv=plan, spec=spec, expected_s=1,
                 measurement=measurement,
                 note=f"in-process (dsforge.plan.build_plan), written to "
                      f"{ctx.work / 'plans' / spec.label}.json"),
            Step(name=spec.label, kind="run", argv=_job_timeout(run, spec.timeout_s), spec=spec,
                 expected_s=spec.expected_s, timeout_s=spec.timeout_s, measurement=measurement)]


def study_steps(spec: StudySpec, measurement: str, ctx: Context) -> list[Step]:
    out = ctx.work / "bench" / spec.label
    bench = (ctx.python, "-m", "dsforge", "bench", spec.study, "--out", str(out))
    report = (ctx.python, "-m", "dsforge", "report", str(out / "results.db"))
    return [Step(name=spec.label, kind="bench", argv=bench, spec=spec, expected_s=spec.expected_s,
                 timeout_s=spec.timeout_s, measurement=measurement),
            Step(name=f"{spec.label}.report", kind="report", argv=report, spec=spec,
                 expected_s=10, timeout_s=120, measurement=measurement)]


def call_seconds(call: int, gpu: str, python: str = "python3") -> float:
    """The estimated duration of a device-tool call on `gpu`."""
    ctx = Context(gpu=gpu, python=python, work=Path("/tmp/dsforge-gpu-kit"))
    return sum(s.expected_s for s in steps(select([f"call{call}"]), ctx))

