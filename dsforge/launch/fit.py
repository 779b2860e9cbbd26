"""Can this job run here? The ranks and memory a layout needs against what a machine has.

Decided before any rank starts, in a second, from dsforge's memory model
(estimate/memory.py: the most loaded pipeline rank's parameters, gradients, optimizer state,
activations and buffers) and a probe of the machine (launch/probe.py):
  FIT1 (error)   ranks on a GPU machine > its GPUs (one rank per GPU);
  FIT2 (error)   a rank's predicted memory > free memory per GPU; on CPU, all of this
                 machine's ranks together > the host memory available (they share it);
  FIT3 (warning) more CPU ranks than cores: it runs, each rank on one thread, slowly;
  FIT4           a checkpoint's snapshot of its ranks' state (each rank's part copied into
                 host memory before it is written, estimate/save_cost.py) beside the job:
                 (warning) more than half the host memory the job leaves free, so saves stage
                 in parts (train.checkpoint_staging_gb: auto, runtime/checkpoint/staging.py)
                 and hold the optimizer step for the writes; (error) the parts a set
                 train.checkpoint_staging_gb asks for do not fit;
  BLD1-BLD6      what DeepSpeed needs to build the ops the ranks build at run time, when the
                 machine's build facts were probed (translate/build_env.py).
The user can override the errors (--skip-fit-check); warnings never block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from dsforge.problems import Problem
from dsforge.recipe import Resolved
from dsforge.schema.train import TrainConfig
from dsforge.translate.build_env import BuildFacts, build_problems, job_ops
from dsforge.translate.kernels import predicted_memory
from dsforge.units import MiB, format_bytes

# A CPU rank's own footprint before the model: Python, torch, DeepSpeed and Megatron-Core
# imported, gloo groups formed. Measured: 32 tiny ranks of recipes/70b_pp4.yaml --tiny
# raised the machine's used memory by ~10.3 GiB (docs/launch.md).
CPU_RANK_OVERHEAD_BYTES = 330 * MiB


@dataclass(frozen=True, kw_only=True)
class Gpu:
    name: str
    memory_total: int
    memory_free: int


@dataclass(frozen=True, kw_only=True)
class Machine:
    name: str  # "this machine" or a host name
    cpus: int
    memory_available: int | None  # bytes; None = unknown
    gpus: tuple[Gpu, ...] = ()
    build: BuildFacts | None = None  # None: not probed (nothing to build here)

    @classmethod
    def from_probe(cls, name: str, probed: dict) -> "Machine":
        gpus = tuple(Gpu(name=g["name"], memory_total=g["memory_total"], memory_free=g["memory_free"])
                     for g in probed.get("gpus", []))
        build = BuildFacts.from_probe(probed["build"]) if probed.get("build") else None
        return cls(name=name, cpus=probed["cpus"], memory_available=probed.get("memory_available"),
                   gpus=gpus, build=build)

    def with_build(self, facts: dict) -> "Machine":
        """This machine with its build facts (launch/probe.py `build_facts`)."""
        return replace(self, build=BuildFacts.from_probe(facts))

    def describe(self) -> str:
        ram = f"{format_bytes(self.memory_available)} of available RAM" if self.memory_available else "unknown RAM"
        if not self.gpus:
            return f"{self.name}: no GPU, {self.cpus} CPU cores, {ram}"
        free = min(g.memory_free for g in self.gpus)
        return (f"{self.name}: {len(self.gpus)} x {self.gpus[0].name} ({format_bytes(free)} free on the "
                f"fullest), {self.cpus} CPU cores, {ram}")


def device_for(choice: str, machine: Machine) -> str:
    """The device ranks will use: cuda when asked, or when auto finds a GPU."""
    if choice == "auto":
        return "cuda" if machine.gpus else "cpu"
    return choice


def rank_memory_bytes(resolved: Resolved, device: str) -> float:
    """A rank's predicted peak on `device` (estimate/memory.py; the kernels it runs there).
    The ZeRO reduce bucket in it is no larger than the rank's gradients (translate sizes it
    so), which a backward fills on the CPU too, where a large allocation is committed page by
    page as it is written."""
    return predicted_memory(resolved, device).total


def device_run_problems(resolved: Resolved, device: str, probed: dict) -> list[Problem]:
    """What this machine's `device` ranks cannot run (run_problems), from what is installed
    and probed here."""
    from dsforge.launch.probe import build_facts
    from dsforge.translate.compile import inductor_cache_dir
    from dsforge.translate.fp8 import torchao_installed
    from dsforge.translate.kernels import liger_installed

    return run_problems(resolved, device, capability=lowest_capability(probed),
                        liger=liger_installed(), torchao=torchao_installed(),
                        compiler=lambda: build_facts()["cxx_path"],
                        cache_dir=inductor_cache_dir(), host="this machine")


def run_problems(resolved: Resolved, device: str, *, capability: tuple[int, int] | None,
                 liger: bool, torchao: bool, compiler: Callable[[], str | None],
                 cache_dir: str | None, host: str) -> list[Problem]:
    """What `device` ranks on `host` cannot run: the kernels (K1, X1: Liger's where not
    installed), float8 GEMMs (FP6, X1: the GPUs' compute capability, torchao), compiling (CM4,
    CM5: inductor's compiler, asked for only then, and its cache where `cache_dir` is known).
    The fit check (this machine) and preflight (every host) both ask it."""
    from dsforge.translate.compile import compile_problems
    from dsforge.translate.fp8 import fp8_device_problems
    from dsforge.translate.kernels import device_problems

    r = resolved.recipe
    problems = device_problems(r.model, device=device, precision=r.train.precision,
                               liger_available=liger,
                               document_masking=r.data.document_masking)
    problems += fp8_device_problems(r.train.fp8, device=device, capability=capability,
                                    torchao_available=torchao)
    if r.model.compile != "none":
        problems += compile_problems(r.model, compiler=compiler(), cache_dir=cache_dir, host=host)
    return problems


def lowest_capability(probed: dict) -> tuple[int, int] | None:
    """The lowest compute capability of the probed GPUs dsforge/hardware.py knows by name."""
    from dsforge.hardware import gpu_for_device_name

    known = [gpu_for_device_name(g["name"]) for g in probed.get("gpus") or []]
    return min((g.capability for g in known if g is not None), default=None)


def fit_problems(resolved: Resolved, machine: Machine, *, device: str,
                 ranks: int | None = None) -> list[Problem]:
    """Every reason the job's `ranks` local ranks (default: the whole world) cannot run on
    `machine` with `device` ("cpu" or "cuda")."""
    ranks = resolved.layout.world_size if ranks is None else ranks
    per_rank = rank_memory_bytes(resolved, device)
    snapshot = snapshot_bytes(resolved, ranks)
    if device == "cuda":
        problems = _gpu_problems(machine, ranks, per_rank)
        host_bytes = ranks * CPU_RANK_OVERHEAD_BYTES
    else:
        problems = _cpu_problems(machine, ranks, per_rank)
        host_bytes = ranks * (per_rank + CPU_RANK_OVERHEAD_BYTES)
    problems += _staging_problems(machine, ranks, snapshot, host_bytes, resolved.recipe.train)
    if machine.build is not None:
        problems += build_problems(job_ops(resolved, device), machine.build, device=device,
                                   host=machine.name)
    return problems


def snapshot_bytes(resolved: Resolved, ranks: int) -> float:
    """Host memory a checkpoint's snapshot takes on a machine running `ranks` of the job's
    ranks: the whole world's state on one machine, else the busiest host's; 0 when the run
    never saves."""
    if not resolved.recipe.train.checkpoint_every:
        return 0.0
    from dsforge.estimate.save_cost import host_state_bytes

    hosts = host_state_bytes(resolved)
    return sum(hosts) if ranks >= resolved.layout.world_size else max(hosts)


def _staging_problems(machine: Machine, ranks: int, snapshot: float, job_bytes: float,
                      train: TrainConfig) -> list[Problem]:
    """FIT4: what a save holds in host memory beside the job (`job_bytes`: the ranks' own host
    memory). auto stages at most half of what the job leaves free (staging.staging_budget)."""
    if not snapshot or machine.memory_available is None:
        return []
    free = machine.memory_available - job_bytes
    if free <= 0:
        return []  # the job itself does not fit (FIT2 says so)
    fields = {"checkpoint snapshot (estimated)": format_bytes(snapshot),
              f"available RAM on {machine.name}": format_bytes(machine.memory_available)}
    if train.staging_bytes is not None:
        staged = min(snapshot, ranks * train.staging_bytes)
        if staged > free:
            return [Problem(
                rule="FIT4", fields={"train.checkpoint_staging_gb": train.checkpoint_staging_gb,
                                     **fields},
                message=f"the saves of the {ranks} rank(s) here would stage "
                        f"{format_bytes(staged)} in host memory, and the job leaves "
                        f"{format_bytes(free)} free",
                fix=f"lower train.checkpoint_staging_gb (at most {free / ranks / 1e9:.2f} GB a "
                    "rank here) or set it to auto")]
        part = train.staging_bytes
    elif snapshot > free / 2:
        part = free / 2 / ranks
    else:
        return []
    if part * ranks >= snapshot:
        return []
    return [Problem(
        rule="FIT4", severity="warning", fields=fields,
        message=f"a save cannot hold the state of the ranks here in host memory at once: "
                f"it stages it in parts of {format_bytes(part)} a rank, and the optimizer step "
                "after a save waits until all but the last part are on disk",
        fix="to save without holding the step: raise zero.stage or the data-parallel size "
            "(each rank then holds less state), or spread the ranks over more hosts")]


def _gpu_problems(machine: Machine, ranks: int, per_rank: float) -> list[Problem]:
    problems = []
    if ranks > len(machine.gpus):
        problems.append(Problem(
            rule="FIT1", fields={"ranks": ranks, f"GPUs on {machine.name}": len(machine.gpus)},
            message="the layout needs one GPU per rank",
            fix="run over a hostfile with enough GPUs, or shrink the layout (see below)"))
    usable = machine.gpus[:ranks]
    if usable and per_rank > min(g.memory_free for g in usable):
        fullest = min(usable, key=lambda g: g.memory_free)
        problems.append(Problem(
            rule="FIT2", fields={"memory per rank (estimated)": format_bytes(per_rank),
                                 f"free on {fullest.name}": format_bytes(fullest.memory_free)},
            message=f"a rank's predicted peak does not fit its GPU ({format_bytes(fullest.memory_total)} total)",
            fix="raise zero.stage, parallel.tp or parallel.pp, set train.activation_checkpointing, "
                "lower train.micro_batch, or run on larger GPUs"))
    return problems


def _cpu_problems(machine: Machine, ranks: int, per_rank: float) -> list[Problem]:
    problems = []
    need = ranks * (per_rank + CPU_RANK_OVERHEAD_BYTES)
    if machine.memory_available is not None and need > machine.memory_available:
        problems.append(Problem(
            rule="FIT2", fields={"ranks": ranks, "memory per rank (estimated)": format_bytes(per_rank),
                                 f"available RAM on {machine.name}": format_bytes(machine.memory_available)},
            message=f"the CPU ranks share the host's memory and need {format_bytes(need)} together "
                    f"(model states and activations + {CPU_RANK_OVERHEAD_BYTES // MiB} MiB a "
                    f"process)",
            fix="run on GPUs over a hostfile, shrink the model, or smoke-test the layout at "
                "tiny size (see below)"))
    if ranks > machine.cpus:
        problems.append(Problem(
            rule="FIT3", severity="warning", fields={"ranks": ranks, "CPU cores": machine.cpus},
            message="more CPU ranks than cores: each rank gets one thread and steps are slow",
            fix="expected for smoke tests of big layouts; use fewer ranks to measure speed"))
    return problems
