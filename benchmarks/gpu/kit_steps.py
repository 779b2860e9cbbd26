"""Each measurement of kit_plan as the steps of one command on the GPU machine.

`steps(...)` turns measurements into Steps: command lines run from the repository root, each
with an estimated duration (`expected_s`) whose basis is written beside it (kit_plan's
`Estimate`s) and a hard limit (`timeout_s`). Runs that dsforge's memory model says do not fit
the GPU become `skip` steps with the reason: the kit spends no device time on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.memory import estimate_memory
from dsforge.hardware import gpu_by_key
from dsforge.recipe import Resolved, resolve_file
from dsforge.translate.kernels import choose_kernels
from dsforge.units import GiB
from kit_plan import (END_S, ENV, INSTALL, KIT_DIR, MOE, ONE_B, PLANNED_GPUS, REPORT, SEVEN_B, THREE_B,
                      Estimate, Measurement, PeerSpec, RunSpec, StudySpec, corpus,
                      data_overrides, select)
from kit_records import DEFAULT_WORK
from kit_wheels import REPO, dsforge_version, read_pins


@dataclass(frozen=True, kw_only=True)
class Step:
    name: str  # unique in a command; names its log file
    # install | env | pytest | gemm | adam | calibrate | search | plan | run | bench | report |
    # peer | skip
    kind: str
    argv: tuple[str, ...] = ()
    expected_s: float = 0.0
    basis: str = ""  # where expected_s comes from
    timeout_s: float = 0.0
    spec: RunSpec | StudySpec | PeerSpec | None = None
    measurement: str = ""
    required: bool = False  # the command stops when it fails
    note: str = ""  # why a step is skipped, or what an in-process step does


@dataclass(frozen=True, kw_only=True)
class Context:
    gpu: str  # key in dsforge.hardware
    python: str  # the interpreter the commands use
    work: Path  # scratch folder for run directories and logs


def resolve_run(spec: RunSpec, gpu: str) -> Resolved:
    """The run's recipe as `dsforge run --world-size 1` resolves it (RecipeError if invalid)."""
    return resolve_file(REPO / spec.recipe, spec.all_overrides(gpu), world_size=1)


def prediction(resolved: Resolved) -> dict:
    """What `dsforge plan --json` says about memory and FLOPs on the kit's GPU (the same
    functions), with the kernels its ranks run there: the install step carries liger-kernel,
    so `model.kernels: auto` is Liger's, whether or not this machine has it."""
    r = resolved.recipe
    fused = resolved.layout.tp == 1 and choose_kernels(
        r.model, device="cuda", liger_available=True).impl == "liger"
    memory = estimate_memory(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout,
                             fused_loss=fused)
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


def tokens_read(spec: RunSpec) -> int:
    """Tokens a run reads from the corpus: steps x global batch x sequence length."""
    train = resolve_run(spec, PLANNED_GPUS[-1]).recipe.train
    return train.steps * train.global_batch * train.seq_len


def run_estimate(spec: RunSpec, steps: int) -> Estimate:
    """Start-up, `steps` steps, the end; measured only if every part is."""
    parts = [spec.start, spec.step, *([spec.extra] if spec.extra else [])]
    seconds = spec.start.seconds + steps * spec.step.seconds + END_S + \
        (spec.extra.seconds if spec.extra else 0.0)
    kind = "measured" if all(p.measured for p in parts) else "guess"
    detail = f"start-up {spec.start.seconds:.0f} s ({_kind(spec.start)}) + {steps} x " \
             f"{spec.step.seconds:g} s ({_kind(spec.step)}) + {END_S} s end (a guess)"
    if spec.extra:
        detail += f" + {spec.extra.seconds:.0f} s ({spec.extra.basis})"
    return Estimate(seconds, f"{kind}: {detail}")


def _kind(estimate: Estimate) -> str:
    return "measured" if estimate.measured else "guess"


def steps(measurements: list[Measurement], ctx: Context) -> list[Step]:
    """Every step of one command: install and environment first, then each measurement's."""
    out = setup_steps(ctx)
    for m in measurements:
        if m.script is not None:
            calibrated = any(s.kind == "calibrate" for s in out)
            out.append(script_step(m, ctx, calibrated))
        for spec in m.runs:
            out += run_steps(spec, m.name, ctx)
        for study in m.studies:
            out += study_steps(study, m.name, ctx)
        for peer in m.peers:
            out += peer_steps(peer, m, ctx)
    return out


PEER_SCRIPTS = {"loop": f"{KIT_DIR}/peer_loop.py"}  # torchtitan 0.3.0: README, "Why not torchtitan"


def peer_paths(peer: PeerSpec, work: Path) -> tuple[Path, Path]:
    """The shape file the kit writes before the peer runs (kit_peers.write_shape) and the
    peer's output."""
    return work / "peers" / f"{peer.label}.model.json", work / "peers" / f"{peer.label}.json"


def peer_steps(peer: PeerSpec, m: Measurement, ctx: Context) -> list[Step]:
    """The peer's run with the job of its dsforge run: nothing where that is not planned here."""
    if ctx.gpu not in peer.gpus:
        return []
    spec = next(r for r in m.runs if r.label == peer.matches)
    train = resolve_run(spec, ctx.gpu).recipe.train
    shape, out = peer_paths(peer, ctx.work)
    argv = (ctx.python, PEER_SCRIPTS[peer.framework], "--model", str(shape), "--data", str(corpus()),
            "--seq-len", str(train.seq_len), "--micro-batch", str(train.micro_batch),
            "--global-batch", str(train.global_batch), "--steps", str(train.steps),
            "--warmup", str(train.timing_warmup), "--lr", f"{train.lr:g}",
            "--lr-warmup-steps", str(train.warmup_steps), "--weight-decay", f"{train.weight_decay:g}",
            "--grad-clip", f"{train.grad_clip:g}", "--compile", peer.compile, "--out", str(out))
    parts = [peer.start, peer.step, *([peer.extra] if peer.extra else [])]
    seconds = peer.start.seconds + train.steps * peer.step.seconds + END_S + \
        (peer.extra.seconds if peer.extra else 0.0)
    kind = "measured" if all(p.measured for p in parts) else "guess"
    basis = f"{kind}: start-up {peer.start.seconds:.0f} s + {train.steps} x {peer.step.seconds:g} s" \
            + (f" + {peer.extra.seconds:.0f} s ({peer.extra.basis})" if peer.extra else "")
    return [Step(name=peer.label, kind="peer", argv=argv, spec=peer, expected_s=seconds,
                 basis=basis, timeout_s=peer.timeout_s, measurement=m.name,
                 note=f"{peer.framework} on {peer.matches}'s job")]


def install_requirements() -> list[str]:
    """What the install step asks pip for; pip takes the rest from the wheels folder as
    needed (packages the image already has at suitable versions stay as they are).
    liger-kernel and torchao by name: dsforge's `gpu` extra, so `model.kernels: auto` picks
    Liger's kernels and train.fp8 finds torchao on the GPU as after a user's
    `pip install 'dsforge[gpu]'`."""
    pins = {p.name: p.version for p in read_pins()}
    return [f"dsforge=={dsforge_version()}", f"deepspeed=={pins['deepspeed']}",
            f"megatron-core=={pins['megatron-core']}", f"liger-kernel=={pins['liger-kernel']}",
            f"torchao=={pins['torchao']}"]


def setup_steps(ctx: Context) -> list[Step]:
    install = (ctx.python, "-m", "pip", "install", "--no-index", "--find-links",
               f"{KIT_DIR}/wheels", *install_requirements())
    return [Step(name="install", kind="install", argv=install, expected_s=INSTALL.seconds,
                 basis=INSTALL.basis, timeout_s=240, required=True,
                 note="skipped when these versions are already installed"),
            Step(name="env", kind="env", expected_s=ENV.seconds, basis=ENV.basis, timeout_s=120,
                 required=True,
                 argv=(ctx.python, f"{KIT_DIR}/probe_env.py", "--out", str(ctx.work / "env.json")))]


def script_step(m: Measurement, ctx: Context, calibrated: bool = False) -> Step:
    """`calibrated`: a calibrate step runs earlier in the same command (the loop starts from
    its profile)."""
    argv = {"gpu-tests": _pytest_argv, "gemm": _gemm_argv, "adam-step": _adam_argv,
            "calibrate": _calibrate_argv,
            "calibrate-moe": lambda c: _calibrate_argv(c, MOE, CALIBRATED_MOE),
            "search": lambda c: loop_argv(c, calibrated)}[m.script](ctx)
    kind = {"gpu-tests": "pytest", "gemm": "gemm", "adam-step": "adam",
            "calibrate": "calibrate", "calibrate-moe": "calibrate-moe",
            "search": "search"}[m.script]
    return Step(name=m.name, kind=kind, argv=argv, expected_s=m.estimate.seconds,
                basis=m.estimate.basis, timeout_s=m.timeout_s, measurement=m.name)


def _pytest_argv(ctx: Context) -> tuple[str, ...]:
    return (ctx.python, "-m", "pytest", "tests/gpu", "-v", "-rA", "-p", "no:cacheprovider",
            "--basetemp", str(ctx.work / "pytest"), "--junitxml", str(ctx.work / "gpu-tests.xml"))


def gemm_recipes() -> tuple[str, ...]:
    return (ONE_B, THREE_B, SEVEN_B)


def _gemm_argv(ctx: Context) -> tuple[str, ...]:
    argv = [ctx.python, f"{KIT_DIR}/gemm.py", "--gpu", ctx.gpu, "--out", str(ctx.work / "gemm.json")]
    for recipe in gemm_recipes():
        argv += ["--recipe", recipe]
    return tuple(argv)


def _adam_argv(ctx: Context) -> tuple[str, ...]:
    return (ctx.python, f"{KIT_DIR}/adam_step.py", "--recipe", ONE_B, "--gpu", ctx.gpu,
            "--out", str(ctx.work / "adam_step.json"))


CALIBRATED = "profile-7b.yaml"  # in the work folder, archived with it
CALIBRATED_MOE = "profile-moe.yaml"  # the MoE's (calibrate-moe), beside it


def _calibrate_argv(ctx: Context, recipe: str = SEVEN_B,
                    out: str = CALIBRATED) -> tuple[str, ...]:
    return (ctx.python, "-m", "dsforge", "calibrate", recipe, "--gpu", ctx.gpu, "--out",
            str(ctx.work / out))


# The loop's model per GPU: one that fills it at 8 sequences a step, whose top layouts differ
# in what the cost model tells apart (checkpointing, micro-batch, ZeRO-3).
LOOP_RECIPES = {"h200": SEVEN_B, "h100": THREE_B}
LOOP_TOP = 4
LOOP_TOKENS = 8 * 4096
LOOP_OUT = "search-loop"  # in the work folder: the trials' runs, results.db, profile.yaml


def loop_argv(ctx: Context, calibrated: bool) -> tuple[str, ...]:
    """The search with --measure on this GPU; its --json ends the step's log (kit_results)."""
    profile = ("--profile", str(ctx.work / CALIBRATED)) if calibrated else ()
    return (ctx.python, "-m", "dsforge", "plan", "--search", LOOP_RECIPES[ctx.gpu], "--gpus", "1",
            "--gpu", ctx.gpu, "--top", str(LOOP_TOP), "--global-batch-tokens", str(LOOP_TOKENS),
            "--measure", "--measure-out", str(ctx.work / LOOP_OUT), "--json", *profile)


def run_steps(spec: RunSpec, measurement: str, ctx: Context) -> list[Step]:
    """The plan (in-process) and the run; a skip if it is not planned for this GPU or does
    not fit it."""
    if ctx.gpu not in spec.gpus:
        return []
    resolved = resolve_run(spec, ctx.gpu)
    note = fit_note(resolved, ctx.gpu)
    if note is not None:
        return [Step(name=spec.label, kind="skip", spec=spec, measurement=measurement, note=note)]
    sets = [word for item in spec.all_overrides(ctx.gpu) for word in ("--set", item)]
    plan = (ctx.python, "-m", "dsforge", "plan", spec.recipe, "--world-size", "1", "--device",
            "cuda", "--json", *sets)
    # dsforge's own --timeout 30 s inside the step's limit, so dsforge stops its job (and
    # says so) before the kit has to.
    run = (*(("env", *spec.env) if spec.env else ()), ctx.python, "-m", "dsforge", "run", spec.recipe, "--world-size", "1", "--run-dir",
           str(ctx.work / "runs" / spec.label), "--timeout", f"{spec.timeout_s - 30:.0f}", *sets)
    estimate = run_estimate(spec, resolved.recipe.train.steps)
    return [Step(name=f"{spec.label}.plan", kind="plan", argv=plan, spec=spec, expected_s=0,
                 measurement=measurement,
                 note=f"in-process (dsforge.plan.build_plan), written to "
                      f"{ctx.work / 'plans' / spec.label}.json"),
            Step(name=spec.label, kind="run", argv=run, spec=spec, expected_s=estimate.seconds,
                 basis=estimate.basis, timeout_s=spec.timeout_s, measurement=measurement)]


def study_estimate(spec: StudySpec) -> Estimate:
    """Every cell's start-up, measured steps (warm-up included) and end."""
    from dsforge.bench.study import expand, load_study

    study, _ = load_study(REPO / spec.study)
    cells = len(expand(study))
    steps = study.measure.warmup_steps + study.measure.steps
    per_cell = spec.start.seconds + steps * spec.step.seconds + END_S
    kind = "measured" if spec.start.measured and spec.step.measured else "guess"
    return Estimate(cells * per_cell * study.measure.repeats,
                    f"{kind}: {cells} cells x (start-up {spec.start.seconds:.0f} s "
                    f"({_kind(spec.start)}) + {steps} x {spec.step.seconds:g} s ({_kind(spec.step)}) "
                    f"+ {END_S} s end (a guess))")


def study_path(spec: StudySpec, work: Path) -> Path:
    """Where the kit writes the study it runs (write_study)."""
    return work / "studies" / f"{spec.label}.yaml"


def write_study(spec: StudySpec, work: Path) -> Path:
    """The study file as shipped, on the kit's corpus, at study_path: its recipe made absolute
    (the copy lives elsewhere) and data_overrides() added to its `set`. Returns the path."""
    import yaml

    source = REPO / spec.study
    study = yaml.safe_load(source.read_text())
    study["recipe"] = str((source.parent / study["recipe"]).resolve())
    study["set"] = {**(study.get("set") or {}),
                    **dict(item.split("=", 1) for item in data_overrides())}
    path = study_path(spec, work)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {spec.study} as the GPU kit runs it (kit_steps.write_study)\n"
                    + yaml.safe_dump(study, sort_keys=False))
    return path


def study_steps(spec: StudySpec, measurement: str, ctx: Context) -> list[Step]:
    out = ctx.work / "bench" / spec.label
    bench = (ctx.python, "-m", "dsforge", "bench", str(study_path(spec, ctx.work)), "--out", str(out))
    report = (ctx.python, "-m", "dsforge", "report", str(out / "results.db"))
    estimate = study_estimate(spec)
    return [Step(name=spec.label, kind="bench", argv=bench, spec=spec, expected_s=estimate.seconds,
                 basis=estimate.basis, timeout_s=spec.timeout_s, measurement=measurement),
            Step(name=f"{spec.label}.report", kind="report", argv=report, spec=spec,
                 expected_s=REPORT.seconds, basis=REPORT.basis, timeout_s=120,
                 measurement=measurement)]


def selection_steps(selection: str, gpu: str, python: str = "python3") -> list[Step]:
    ctx = Context(gpu=gpu, python=python, work=Path(DEFAULT_WORK))
    return steps(select([selection]), ctx)


def selection_seconds(selection: str, gpu: str) -> float:
    """The estimated duration of a selection's command on `gpu`, install and environment
    included (not the machine's start)."""
    return sum(s.expected_s for s in selection_steps(selection, gpu))
