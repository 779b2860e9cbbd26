"""What the kit measures on one GPU and in which command, with the estimates of its steps.

A measurement (MEASUREMENTS) is a named list of `dsforge run`s, `dsforge bench` studies or one
script. SELECTIONS groups measurements into device-tool commands: `essential` is issue 21's
one command of at most 8 minutes (ESSENTIAL_S, checked by the dry run and CI); `levers` and
`sweeps` are optional, each within one 10-minute command, for a second command or a later
session. Every command starts with the install and environment steps.

Every run and study carries the estimates of its start-up and steps, each with its basis
(`Estimate`: measured on a GPU session, ../shared/reference/gpu-h200-2026-11-26 and
results/, or a guess). kit_steps.py turns measurements into the exact command of every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kit_wheels import WHEELS


PLANNED_GPUS = ("h100", "h200")  # the kinds the device tool lends
ONE_COMMAND_S = 600  # the device tool's limit on one command
CALL_BUDGET_S = 560  # an optional selection's budget: 40 s stay for the table and archive
ESSENTIAL_S = 480  # issue 21: the essential measurements fit one command of at most 8 minutes
FINISH_S = 5  # guess: the last table, results and archive after the last step
ESSENTIAL_MARGIN_S = 20  # estimates are ~10% guesses: the essential plan leaves this unplanned
# The `--budget` the essential command runs with: no step starts that would not end by then,
# and a running one is stopped then; 5 s more for Python's start and the kit's own work.
ESSENTIAL_BUDGET_S = ESSENTIAL_S - FINISH_S - 5
KIT_DIR = "benchmarks/gpu"
MEASURED = "measured 2026-11-26 (H200)"


@dataclass(frozen=True)
class Estimate:
    """Seconds and where they come from: `measured` figures are from the first GPU session
    (../shared/reference/gpu-h200-2026-11-26), anything else is a guess, said so."""
    seconds: float
    basis: str

    @property
    def measured(self) -> bool:
        return self.basis.startswith("measured")


# Start-up and end of one `dsforge run` (launch, imports, model build and initialisation,
# DeepSpeed's engine, the summary and teardown), by model. KIT = the kit's second session
# (results/2026-11-26-h200): each run's seconds less its three measured steps.
KIT = "measured by the kit 2026-11-26 (H200, results/2026-11-26-h200)"
# KIT2 = the kit's third session, the same day (results/2026-11-26-h200-targets)
KIT2 = "measured by the kit 2026-11-26 (H200, results/2026-11-26-h200-targets)"
# KIT3 = the fourth (results/2026-11-26-h200-essential): the essential command, 520 s in all
KIT3 = "measured by the kit 2026-11-26 (H200, results/2026-11-26-h200-essential)"
# KIT5 = the sixth, on an H200 (results/2026-11-27-h200): the essential command since the
# weight draw moved to the GPU, with the calibration; each run's seconds less its three steps
# and END_S.
KIT5 = "measured by the kit 2026-11-27 (H200, results/2026-11-27-h200)"
START_7B = Estimate(28, f"{KIT5}: 64 s with 3 steps of 10.9 s (116 s in KIT3, before the "
                        "weight draw moved to the GPU)")
START_7B_Z3 = Estimate(48, f"{KIT5}: 64 s with 3 steps of 4.4 s at ZeRO-3 (110 s in KIT3)")
# KIT4 = the fifth, on an H100 (results/2026-11-26-h100-essential): the draw on the GPU
# measured (the `weights` start-up phase 0.0 s); each run's seconds less its three steps and
# END_S. The 1B, 3B and MoE start-ups are the H100's; used for the H200 as well.
KIT4 = "measured by the kit 2026-11-26 (H100, results/2026-11-26-h100-essential)"
START_1B = Estimate(26, f"{KIT4}: 130 s for 4 ZeRO cells of 3 steps of 1.15 s")
START_3B = Estimate(31, f"{KIT4}: 34-42 s with 3 steps of 1.58-1.96 s")
START_MOE = Estimate(23, f"{KIT4}: 30 s with 3 steps of 1.26 s")
END_S = 3  # guess: summary, the live-tensor census, teardown after the last step
STEP_7B_SHIPPED = Estimate(11.07, f"{KIT2}: the shipped 7B, ZeRO-0 none mb 1 at 32 sequences "
                                  "(10.89 s in KIT3)")
STEP_7B_Z3_NONE_MB1 = Estimate(4.09, f"{KIT3}: 7B ZeRO-3 none mb 1 at 8 sequences")
STEP_7B_GB16 = Estimate(5.60, f"{KIT2}: 7B ZeRO-0 none mb 1 at 16 sequences")
STEP_1B_MB8 = Estimate(1.12, f"{KIT2}: the 1B at none mb 8 (as shipped)")
STEP_1B = Estimate(1.13, f"{KIT3}: the 1B as shipped at ZeRO 0-3, 1.09-1.13 s")
# Half the shipped 16 sequences: one microbatch of 8, ~half the step less than half of the
# optimizer step's ~50 ms (guess).
STEP_1B_GB8 = Estimate(0.60, "guess: half of the 1B's 1.13 s at 16 sequences, plus its optimizer step")
STEP_1B_OTHER = Estimate(1.7, f"{KIT}: the 1B's sweep, 1.22-1.72 s a step")
STEP_7B_Z0_FULL_MB2 = Estimate(3.66, f"{KIT2}: 7B ZeRO-0 full mb 2 at 8 sequences")
STEP_7B_SELECTIVE = Estimate(2.92, f"{KIT2}: 7B ZeRO-0 selective mb 1 at 8 sequences")
STEP_3B = Estimate(6.07, f"{KIT4}: the 3B as now shipped (none mb 2, 32 sequences), by hand")
STEP_3B_GB8 = Estimate(1.96, f"{KIT4}: the 3B at 8 sequences, 1.58-1.96 s")
STEP_MOE = Estimate(1.82, f"{KIT3}: the MoE at 8 layers (1.48 s in KIT2)")
# Issue 38's prediction, written before any grouped run on a GPU: the expert loop was 56-58%
# of the sequential step and the whole step ran at ~9% of peak, host-bound; grouped GEMMs at
# the dense path's ~70% of peak and no host sync bring the step to ~0.55 s (35% MFU asks 0.47 s).
STEP_MOE_GROUPED = Estimate(0.55, "guess: issue 38's prediction for grouped experts")
# Issue 51, written before any masked run on a GPU (benchmarks/gpu/README.md): the 1B's
# 65,536 tokens a step at mb 1 (its fixed cost a microbatch: 8 of them at 8k) with the
# attention's causal half growing with the sequence (~15% of the executed FLOPs at 8k, ~46% at
# 32k); within documents of a few thousand tokens flex does a fraction of that work, at a lower
# rate than flash.
STEP_1B_8K = Estimate(1.45, "guess: the 1B's 1.13 s at 4k, mb 1's fixed costs, attention x2")
STEP_1B_32K = Estimate(2.2, "guess: attention ~46% of the executed FLOPs at 32k")
DOCUMENTS = ("data.document_masking=true", "data.reset_position_ids=true")
FUSED_ADAM_JIT_S = 60  # measured 2026-11-26: DeepSpeed's FusedAdam JIT build on the H200
STEP_7B_GB8 = Estimate(2.87, f"{KIT2}: the 7B as shipped at 8 sequences (53.2% MFU)")
# The peer loop (peer_loop.py), never run on a GPU before: guesses. Its start: Python, torch and
# transformers imported, the model built and initialised on the GPU.
PEER_LOOP_START = Estimate(20, "guess: imports and a model built on the GPU")
# Without Liger's fusions and, where no checkpointing fits, with full recomputation (+1/3 of
# the compute): ~1.45x dsforge's step at the same job (a guess, to be measured).
STEP_PEER_7B = Estimate(4.2, "guess: ~1.45 x dsforge's 2.87 s (full checkpointing, no fusions)")
STEP_PEER_3B = Estimate(2.8, "guess: ~1.45 x dsforge's 1.96 s")
# Issue 40's predictions, written before any compiled or float8 run on a GPU: the calibrated
# H200 profile (results/2026-11-27-h200, profile-7b.yaml) with the issue-40 terms
# (cost/profile.py: compiled_other_share 0.6, fp8_gemm_speedup 1.6, fp8_eager_cast_share
# 0.5) gives the 7B at 8 sequences 2.74 s eager, 2.51 compiled (1.09x), 2.41 fp8 eager
# (1.14x), 1.89 fp8 compiled (1.45x); scaled to the measured eager step (2.87 s):
PREDICTED_SPEEDUP = {"compiled": 1.09, "fp8-eager": 1.14, "fp8-compiled": 1.45,
                     "fp8-rowwise-compiled": 1.45}
PEER_COMPILE_DSFORGE = Estimate(60, "guess: inductor compiling one 7B layer's forward and backward")
STEP_1B_FP8 = Estimate(0.80, "guess: the 1B at 1.13 s a step over issue 40's 1.4x")


def _compile_fp8_variants(base: Estimate) -> tuple[tuple[str, tuple[str, ...], Estimate], ...]:
    """(label, overrides, step estimate) of each variant, its step the eager one's over the
    predicted speed-up (guesses: none has run on a GPU)."""
    sets = {"eager-bf16": (), "compiled": ("model.compile=layers",),
            "fp8-eager": ("train.fp8=tensorwise",),
            "fp8-compiled": ("train.fp8=tensorwise", "model.compile=layers"),
            "fp8-rowwise-compiled": ("train.fp8=rowwise", "model.compile=layers")}
    out = []
    for variant, overrides in sets.items():
        ratio = PREDICTED_SPEEDUP.get(variant)
        step = base if ratio is None else Estimate(
            round(base.seconds / ratio, 2), f"guess: {base.seconds:g} s over the predicted {ratio}x")
        out.append((variant, overrides, step))
    return tuple(out)


# The steps every command starts with, and `dsforge report` after a study.
INSTALL = Estimate(8, f"{KIT}: 6 s, liger-kernel included")
ENV = Estimate(26, f"{KIT4}: 26 s (18-22 s in KIT3, 13-17 s in the first session)")
REPORT = Estimate(2, f"{MEASURED}: 1-2 s")
PEER_OOM_RETRY = Estimate(15, "guess: a first try without checkpointing that runs out of memory")
PEER_COMPILE = Estimate(75, "guess: inductor compiling one decoder layer's forward and backward "
                            "(and the retry without checkpointing)")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One `dsforge run` on one GPU."""
    label: str  # unique; names the run directory
    recipe: str  # relative to the repository root
    overrides: tuple[str, ...] = ()
    gpus: tuple[str, ...] = PLANNED_GPUS  # the GPUs it is planned for
    start: Estimate
    step: Estimate
    extra: Estimate | None = None  # anything else it pays for (an op build)
    timeout_s: float = 300.0
    env: tuple[str, ...] = ()  # NAME=value set for this run only (through env(1))
    shrunk: str = ""  # what differs from the recipe as shipped to fit the budget; the table says it

    def all_overrides(self, gpu: str) -> tuple[str, ...]:
        return (*self.overrides, *data_overrides(), f"cluster.gpu={gpu}")


@dataclass(frozen=True, kw_only=True)
class StudySpec:
    """One `dsforge bench` study, then `dsforge report` on its results."""
    label: str
    study: str  # relative to the repository root
    start: Estimate  # per cell
    step: Estimate
    timeout_s: float
    shrunk: str = ""  # what differs from the recipe as shipped to fit the budget


@dataclass(frozen=True, kw_only=True)
class PeerSpec:
    """Another framework on the job of one dsforge run (issue 39): the model, sequence length,
    global batch, micro-batch and precision of `matches`'s recipe, on the same corpus."""
    label: str  # unique; names its output (work/peers/LABEL.json)
    framework: str  # a key of PEER_SCRIPTS: "loop" (peer_loop.py)
    matches: str  # the RunSpec label in the same measurement
    compile: str  # "none" | "layers"
    gpus: tuple[str, ...] = PLANNED_GPUS
    start: Estimate
    step: Estimate
    extra: Estimate | None = None  # compilation, a retry after running out of memory
    timeout_s: float = 300.0


@dataclass(frozen=True, kw_only=True)
class Measurement:
    name: str
    about: str
    baseline: str | None = None  # the run label suffix the table divides the others' steps by
    runs: tuple[RunSpec, ...] = ()
    studies: tuple[StudySpec, ...] = ()
    peers: tuple[PeerSpec, ...] = ()
    script: str | None = None  # "gpu-tests", "gemm", "adam-step", "calibrate", "calibrate-moe"
    # or "search"
    estimate: Estimate | None = None  # for a script
    timeout_s: float = 0.0



# Twelve steps, the first two left out of every figure: a GPU figure counts with >= 10 measured
# steps (issue 39). Step 0 pays for the allocator's warm-up and Triton's first compiles (Liger's
# kernels); step 1 is the first at the warm-up's learning rate.
TEN_MEASURED = ("train.steps=12", "train.timing_warmup=2")
GB8 = ("train.global_batch=8",)  # the 7B's levers, measured at 8 sequences on 2026-11-26
GB8_SHRUNK = "8 sequences a step (32 shipped)"
MB2 = ("train.micro_batch=2",)
SEVEN_B = "recipes/7b_1gpu.yaml"
ONE_B = f"{KIT_DIR}/recipes/1b_1gpu.yaml"
THREE_B = f"{KIT_DIR}/recipes/3b_1gpu.yaml"
MOE = "recipes/moe_1gpu.yaml"
# The MoE at 8 of its 24 layers: the shipped 24 need 85.9 GiB, more than an 80 GB H100, and
# ~60 s more start-up.
MOE_8L = ("model.num_layers=8",)

# Every run and study trains on real text (issue 39): the Python standard library's sources,
# a 32,000-token BPE (corpus.py, run by build_kit.sh into the carried folder). The prefix is
# absolute, so it holds from any recipe's folder. A dry run without the built corpus validates
# against a small stand-in (corpus.stand_in): `use_corpus` is the one switch.
CORPUS = WHEELS / "corpus" / "pystdlib"
_corpus = [CORPUS]


def corpus() -> Path:
    return _corpus[0]


def use_corpus(prefix: Path) -> None:
    _corpus[0] = prefix


def data_overrides() -> tuple[str, ...]:
    return (f"data.source={corpus()}",)


def _run(label: str, recipe: str, *overrides: str, start: Estimate, step: Estimate,
         gpus: tuple[str, ...] = PLANNED_GPUS, extra: Estimate | None = None,
         timeout_s: float = 300.0, env: tuple[str, ...] = (), shrunk: str = "") -> RunSpec:
    return RunSpec(label=label, recipe=recipe, overrides=(*TEN_MEASURED, *overrides), gpus=gpus,
                   start=start, step=step, extra=extra, timeout_s=timeout_s, env=env,
                   shrunk=shrunk)


def _sweep(size: str, recipe: str, cells: tuple[tuple[str, int], ...], start: Estimate,
           step: Estimate, *overrides: str, shrunk: str = "") -> tuple[RunSpec, ...]:
    return tuple(_run(f"{size}-{ac}-mb{mb}", recipe, f"train.activation_checkpointing={ac}",
                      f"train.micro_batch={mb}", *overrides, start=start, step=step, shrunk=shrunk)
                 for ac, mb in cells)


_AC_X_MB = tuple((ac, mb) for ac in ("none", "selective", "full") for mb in (1, 2))

MEASUREMENTS: dict[str, Measurement] = {m.name: m for m in (
    Measurement(name="gpu-tests", script="gpu-tests", timeout_s=300,
                estimate=Estimate(100, f"guess: 65 s {KIT4[len('measured '):]} for three tiny "
                                       "dsforge runs at once (54 s in KIT3), 10 s for the two "
                                       "tiny MoE runs and the MoE layer's host-sync check since, "
                                       "25 s for the device drill's restart (a second start)"),
                about="pytest tests/gpu: the smoke recipe in bf16 through NCCL, nothing built at "
                      "run time, bf16 against fp32, Liger's kernels against torch's over 30 steps, "
                      "grouped experts against sequential ones, no host sync in an ep-1 MoE layer, "
                      "a device-side assert restarted, a NaN loss stopped"),
    # The headline (issue 39: >= 10 measured steps on real tokens): on an H200 the 7B as
    # shipped (ZeRO-0 without checkpointing at mb 1 and 32 sequences, the fastest measured:
    # 55.2-56.1% MFU); an 80 GB H100 holds no 7B without offload, so there the kit's 3B as
    # shipped (ZeRO-0 without checkpointing at mb 2 and 32 sequences: 51.3-52.8% without a
    # manifest, 50.7% with one at 16 sequences; 68.0 GiB).
    Measurement(name="anchor", about="recipes/7b_1gpu.yaml as shipped (H200); the kit's 3B as "
                                     "shipped (H100); each with its breakdown",
                runs=(_run("7b-shipped", SEVEN_B, gpus=("h200",), start=START_7B, step=STEP_7B_SHIPPED),
                      _run("3b-shipped", THREE_B, gpus=("h100",), start=START_3B, step=STEP_3B))),
    # Other layouts of the same models, at 8 sequences to fit a command: the planner's first
    # 7B layout, ZeRO-3 without checkpointing at mb 1 (118.9 GiB; issue 23's calibration
    # point: ZeRO-3's per-module gathers); on an H100 the 3B at ZeRO-3 (the 3B at mb 1 is
    # mfu-3b's none-mb1, in the same selection).
    Measurement(name="layouts", about="the 7B at ZeRO-3 (H200); the 3B at ZeRO-3 (H100); 8 "
                                      "sequences a step",
                runs=(_run("7b-z3-none-mb1-gb8", SEVEN_B, "zero.stage=3", *GB8, gpus=("h200",),
                           start=START_7B_Z3, step=STEP_7B_Z3_NONE_MB1, shrunk=GB8_SHRUNK),
                      _run("3b-z3-mb2-gb8", THREE_B, "zero.stage=3", *GB8, gpus=("h100",),
                           start=START_3B, step=STEP_3B_GB8, shrunk=GB8_SHRUNK))),
    Measurement(name="zero", about="dsforge bench: ZeRO 0-3 on the 1B model (dp 1), predicted vs "
                                   "measured memory, the live-tensor census, the breakdown per "
                                   "stage; dsforge report",
                studies=(StudySpec(label="zero-1b", study=f"{KIT_DIR}/studies/zero_1b.yaml",
                                   start=START_1B, step=STEP_1B_GB8, timeout_s=300,
                                   shrunk="8 sequences a step (16 shipped)"),)),
    # Issue 38: recipes/moe_1gpu.yaml (top-2 of 8 experts in every layer) at 8 layers with
    # Megatron's sequential experts and dsforge's grouped ones (torch's grouped GEMM, no host
    # sync at ep 1), one after the other in one command.
    Measurement(name="moe-experts", about="recipes/moe_1gpu.yaml at 8 layers, experts sequential "
                                          "then grouped: tokens/s, MFU on active parameters, the "
                                          "breakdown's experts phase",
                runs=tuple(_run(f"moe-8l-{impl}", MOE, *MOE_8L, f"model.moe.experts={impl}",
                                start=START_MOE, step=step, shrunk="8 of its 24 layers")
                           for impl, step in (("sequential", STEP_MOE),
                                              ("grouped", STEP_MOE_GROUPED)))),
    # Issue 51: packed documents on the kit's corpus (a Python source file a document): the 1B
    # at 8k and 32k tokens a sequence (65,536 tokens a step each), attention over the whole
    # sequence (SDPA's causal kernel) and within each document (data.document_masking: flex
    # attention's block mask on a GPU, the kernel in each run's manifest).
    Measurement(name="documents", about="the 1B at 8k and 32k tokens a sequence, full causal "
                                        "attention and attention within documents (flex): "
                                        "tokens/s and the kernel chosen",
                runs=tuple(_run(f"1b-{size}-{mode}", ONE_B, f"train.seq_len={seq}",
                                f"model.max_seq_len={seq}", f"train.global_batch={65536 // seq}",
                                "train.micro_batch=1", *sets, start=START_1B, step=step,
                                shrunk=f"{seq} tokens a sequence, {65536 // seq} a step")
                           for size, seq, step in (("8k", 8192, STEP_1B_8K),
                                                   ("32k", 32768, STEP_1B_32K))
                           for mode, sets in (("causal", ()), ("documents", DOCUMENTS)))),
    # Issue 39: a peer on the same job, in the same command. The largest Llama-family shape
    # both fit on the GPU (the 7B on an H200; the 3B on an H100, which holds no 7B with 16
    # bytes a parameter), as dsforge ships it but at 8 sequences a step to fit the command.
    # The peer: transformers' Llama in a plain PyTorch loop (peer_loop.py), eager and with its
    # layers compiled, each at the fastest checkpointing that fits.
    Measurement(name="peers", about="dsforge and a plain transformers + PyTorch loop on the same "
                                    "job (7B on an H200, 3B on an H100; 8 sequences a step), "
                                    "eager and compiled: tokens/s, MFU, loss; peers.json",
                runs=(_run("7b-peer-job", SEVEN_B, *GB8, gpus=("h200",), start=START_7B,
                           step=STEP_7B_GB8, shrunk=GB8_SHRUNK),
                      _run("3b-peer-job", THREE_B, *GB8, gpus=("h100",), start=START_3B,
                           step=STEP_3B_GB8, shrunk=GB8_SHRUNK)),
                peers=tuple(PeerSpec(label=f"{size}-loop-{mode}", framework="loop",
                                     matches=f"{size}-peer-job", compile=mode, gpus=(gpu,),
                                     start=PEER_LOOP_START, step=step,
                                     extra=PEER_COMPILE if mode == "layers" else PEER_OOM_RETRY)
                            for size, gpu, step in (("7b", "h200", STEP_PEER_7B),
                                                    ("3b", "h100", STEP_PEER_3B))
                            for mode in ("none", "layers"))),
    # Issue 40: torch.compile and float8 GEMMs on the 7B (H200) or the 3B (H100), each at 8
    # sequences a step: eager bf16, compiled layers, float8 eager, float8 + compiled (tensor-
    # wise and rowwise). The ratios to eager bf16 are in the table with the planner's.
    Measurement(name="compile-fp8", about="the 7B (H200) or 3B (H100) at 8 sequences: eager "
                                          "bf16, compiled layers, fp8 tensorwise eager and "
                                          "compiled, fp8 rowwise compiled; ratios to eager",
                baseline="eager-bf16",
                runs=tuple(_run(f"{size}-{variant}", recipe, *GB8, *sets, gpus=(gpu,), start=start,
                                step=step, extra=PEER_COMPILE_DSFORGE if "compiled" in variant else None,
                                shrunk=GB8_SHRUNK)
                           for size, recipe, gpu, start, base in (("7b", SEVEN_B, "h200", START_7B, STEP_7B_GB8),
                                                                  ("3b", THREE_B, "h100", START_3B, STEP_3B_GB8))
                           for variant, sets, step in _compile_fp8_variants(base))),
    # Issue 40: float8 follows bf16 on real tokens: the kit's 1B as shipped over 100 steps in
    # bf16 and with fp8 (tensorwise, compiled), final loss within 1.5% (the mean of the last
    # 10 steps).
    Measurement(name="fp8-loss", about="the 1B as shipped, 100 steps in bf16 and in fp8 + "
                                       "compiled layers on the corpus: the losses side by side",
                runs=(_run("1b-loss-bf16", ONE_B, "train.steps=100", start=START_1B, step=STEP_1B_MB8),
                      _run("1b-loss-fp8", ONE_B, "train.steps=100", "train.fp8=tensorwise",
                           "model.compile=layers", start=START_1B, step=STEP_1B_FP8,
                           extra=PEER_COMPILE_DSFORGE))),
    Measurement(name="gemm", script="gemm", timeout_s=180,
                estimate=Estimate(10, f"{KIT}: 7 s, the GEMMs and four SDPA backends"),
                about="bf16 GEMM throughput at the 1B/3B/7B shapes against the planner's "
                      "compute_efficiency; dsforge's SDPA with each backend (flash, cudnn, "
                      "efficient, torch's choice)"),
    # `auto`, not `liger`: dsforge refuses liger where liger-kernel is not installed (rule X1),
    # so the CPU machine could not plan it; on the kit's machine auto is Liger (env.json says).
    # At micro-batch 2, not the shipped 8: torch's loss materialises fp32 logits over 128k
    # words (38.3 GiB at mb 2 on 2026-11-26), which at mb 8 would not fit an 80 GB H100.
    Measurement(name="kernels-1b", about="the 1B at mb 2 with model.kernels auto (Liger's "
                                         "kernels on the kit's GPU) and with torch's",
                runs=(_run("1b-kernels-auto", ONE_B, *MB2, start=START_1B, step=STEP_1B_OTHER),
                      _run("1b-kernels-torch", ONE_B, "model.kernels=torch", *MB2,
                           start=START_1B, step=STEP_1B_OTHER))),
    Measurement(name="adam-step", script="adam-step", timeout_s=300,
                estimate=Estimate(134, f"{KIT3}: 8 engines of 1.2B and FusedAdam's JIT build"),
                about="the optimizer step alone at the 1B's parameters, per ZeRO stage: torch's "
                      "fused AdamW against DeepSpeed's FusedAdam (JIT-built)"),
    # Issue 23: a profile measured on the kit's GPU at the 7B's shapes (its GEMMs at three
    # sizes, DeepSpeed's optimizer step at two), the basis of a shipped H100/H200 profile.
    Measurement(name="calibrate", script="calibrate", timeout_s=300,
                estimate=Estimate(55, f"{KIT5}: 47 s, the layer timing included; guess: "
                                      "~5 s more for the ZeRO-3 forward at the recipe's "
                                      "shapes, added since"),
                about="dsforge calibrate recipes/7b_1gpu.yaml on the kit's GPU: the GEMMs' rate "
                      "and knee, the optimizer step's fixed cost and bytes a parameter, "
                      "attention, memory bandwidth, the host floors at ZeRO-0 and ZeRO-3 and the "
                      "layer's work outside its GEMMs, as a --profile file"),
    # Issue 47: the grouped GEMM timed by calibrate on a GPU (expert_efficiency), at the
    # shipped MoE's shapes, beside the MoE runs whose step it prices.
    Measurement(name="calibrate-moe", script="calibrate-moe", timeout_s=300,
                estimate=Estimate(60, "guess: the 7B's calibrate (47 s measured) at the MoE's "
                                      "smaller GEMMs, with its grouped experts timed"),
                about="dsforge calibrate recipes/moe_1gpu.yaml on the kit's GPU: its experts as "
                      "it runs them (grouped GEMM: expert_efficiency) beside the dense figures, "
                      "as a --profile file"),
    # Issue 23's loop on the kit's GPU, after `calibrate` in `profiles`: dsforge plan --search
    # --measure from the profile calibrate wrote (LOOP_RECIPES, loop_argv).
    Measurement(name="loop", script="search", timeout_s=420,
                estimate=Estimate(240, f"{KIT5}: 174 s for the 7B's top 3 at 8 sequences with "
                                       "the install; guess: ~60 s for a fourth trial"),
                about="dsforge plan --search --measure on the kit's GPU from the profile "
                      "calibrate wrote: the top 4 layouts of the 7B (H200) or the 3B (H100) at 8 "
                      "sequences run as trials; predicted against measured before and after the "
                      "refit"),
    Measurement(name="7b-levers", about="the 7B: the shipped layout at global batch 16; full "
                                        "checkpointing at mb 2 and selective at mb 1, at 8 "
                                        "sequences (H200)",
                runs=(_run("7b-gb16", SEVEN_B, "train.global_batch=16", gpus=("h200",),
                           start=START_7B, step=STEP_7B_GB16),
                      _run("7b-z0-full-mb2", SEVEN_B, "train.activation_checkpointing=full",
                           "train.micro_batch=2", *GB8, gpus=("h200",), start=START_7B, shrunk=GB8_SHRUNK,
                           step=STEP_7B_Z0_FULL_MB2),
                      _run("7b-z0-selective-mb1", SEVEN_B, "train.activation_checkpointing=selective",
                           *GB8, gpus=("h200",), start=START_7B, step=STEP_7B_SELECTIVE,
                           shrunk=GB8_SHRUNK))),
    # An 80 GB H100 holds the 7B only with the optimizer offloaded: CPU Adam (a host-bound step
    # and a JIT build), alone in a command (twelve steps of ~30 s, a guess).
    Measurement(name="7b-offload", about="the 7B with the optimizer offloaded to the host (H100)",
                runs=(_run("7b-offload-selective-mb1", f"{KIT_DIR}/recipes/7b_1gpu_offload.yaml",
                           gpus=("h100",), start=START_7B,
                           step=Estimate(30, "guess: CPU Adam over 6.7B parameters on the host"),
                           extra=Estimate(FUSED_ADAM_JIT_S, "guess: CPU Adam's JIT build, as "
                                                            "long as FusedAdam's measured one"),
                           timeout_s=500),)),
    # Issue 21: the breakdown's cost stays under 1% of a step. The 1B as shipped with and
    # without its clock (DSFORGE_BREAKDOWN=off), in one command: the two step times' ratio.
    # On 2026-11-26 (at mb 4) the run with the clock was 0.5% faster: noise, not a cost.
    Measurement(name="breakdown-cost", about="the 1B as shipped with and without the step "
                                             "breakdown (DSFORGE_BREAKDOWN=off): what measuring "
                                             "costs",
                runs=tuple(_run(f"1b-breakdown-{mode}", ONE_B, start=START_1B,
                                step=STEP_1B_MB8, env=(f"DSFORGE_BREAKDOWN={mode}",))
                           for mode in ("on", "off"))),
    Measurement(name="mfu-1b", about="~1.2B model: activation checkpointing none/selective/full x "
                                     "micro-batch 1/2, none at 4 (8 is shipped), seq 4096",
                runs=_sweep("1b", ONE_B, (*_AC_X_MB, ("none", 4)), START_1B, STEP_1B_OTHER)),
    Measurement(name="mfu-3b", about="~3.2B model: checkpointing none/selective/full at "
                                     "micro-batch 1, full at 2, seq 4096, 8 sequences",
                runs=_sweep("3b", THREE_B, (("none", 1), ("selective", 1), ("full", 1), ("full", 2)),
                            START_3B, STEP_3B_GB8, *GB8, shrunk=GB8_SHRUNK)),
)}
# In the order to run them. The essential one follows issue 21's order (tests, the headline
# runs, the ZeRO study, the MoE run); the budget skips from the end when estimates run long.
SELECTIONS: dict[str, tuple[str, ...]] = {
    "essential": ("gpu-tests", "anchor", "zero"),
    "levers": ("gemm", "kernels-1b", "adam-step", "7b-levers"),
    "layouts": ("layouts", "mfu-3b"),
    "sweeps": ("mfu-1b", "breakdown-cost"),
    "offload": ("7b-offload",),
    "profiles": ("calibrate", "loop"),
    "experts": ("moe-experts", "calibrate-moe"),
    "peers": ("peers",),
    "compile-fp8": ("compile-fp8",),
    "fp8-loss": ("fp8-loss",),
    "documents": ("documents",),
}


def select(names: list[str]) -> list[Measurement]:
    """Measurement names, selection names or `all`, in the order given, each once.
    ValueError names what is unknown."""
    chosen: list[str] = []
    for name in names:
        if name == "all":
            expanded = [m for selection in SELECTIONS.values() for m in selection]
        elif name in SELECTIONS:
            expanded = list(SELECTIONS[name])
        elif name in MEASUREMENTS:
            expanded = [name]
        else:
            known = ", ".join([*SELECTIONS, *MEASUREMENTS, "all"])
            raise ValueError(f"unknown measurement {name!r}; known: {known}")
        chosen += [n for n in expanded if n not in chosen]
    if not chosen:
        raise ValueError("name at least one measurement (or a selection, or all)")
    return [MEASUREMENTS[n] for n in chosen]


def selection_limit(selection: str) -> float:
    """What a selection's estimate must stay within: the essential one within 8 minutes less
    the finish and the margin; the others within one command's budget."""
    if selection == "essential":
        return ESSENTIAL_S - FINISH_S - ESSENTIAL_MARGIN_S
    return CALL_BUDGET_S
