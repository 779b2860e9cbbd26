"""The GPU kit's environment check: what the machine is and whether dsforge can run on it.

Reads, never changes: nvidia-smi's name, memory, driver and clocks; torch's CUDA, cuDNN, NCCL
and bf16 support and whether flash attention is enabled; the versions of deepspeed,
megatron-core, liger-kernel, triton and dsforge and whether they import (and from where:
dsforge must come from the working tree); which kernels `model.kernels: auto` picks here (the
ranks' own choice, dsforge/translate/kernels.py); TORCH_CUDA_ARCH_LIST as the image sets it;
nvcc and ninja, which DeepSpeed's JIT builds need; CPUs and host memory.
Writes JSON to --out and prints a short summary; exits 1 when a run could not work (no CUDA
device, deepspeed or megatron-core missing, or versions other than setup.cfg's pins).

--quick skips importing deepspeed and megatron-core (seconds each): the kit's CPU test uses it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PINNED = ("deepspeed", "megatron-core")
SMI_FIELDS = "name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,power.limit"


def command_output(argv: list[str], timeout: float = 30) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout or done.stderr).strip() or None


def nvidia_smi() -> dict | None:
    out = command_output(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"])
    if out is None:
        return None
    return {"gpus": [dict(zip(SMI_FIELDS.split(","), (v.strip() for v in line.split(","))))
                     for line in out.splitlines()]}


def torch_facts() -> dict:
    import torch

    facts = {"version": torch.__version__, "cuda": torch.version.cuda,
             "cuda_available": torch.cuda.is_available()}
    if facts["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        facts.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                     memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                     bf16=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version(),
                     nccl=".".join(map(str, torch.cuda.nccl.version())),
                     flash_sdp=torch.backends.cuda.flash_sdp_enabled())
    return facts


def package(name: str, module: str | None, quick: bool) -> dict:
    try:
        facts = {"version": version(name)}
    except PackageNotFoundError:
        return {"version": None}
    if module and not quick:
        try:
            imported = importlib.import_module(module)
            facts["imported_from"] = str(Path(imported.__file__).parent)
        except Exception as exc:  # any import failure is the finding
            facts["import_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def dsforge_facts() -> dict:
    import dsforge

    where = Path(dsforge.__file__).resolve().parent
    try:
        wheel = version("dsforge")
    except PackageNotFoundError:
        wheel = None
    return {"tree_version": dsforge.__version__, "installed_version": wheel,
            "imported_from": str(where), "from_working_tree": where == REPO / "dsforge"}


def host_facts() -> dict:
    memory = None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        line = next((l for l in meminfo.read_text().splitlines() if l.startswith("MemTotal")), "")
        memory = int(line.split()[1]) * 1024 if line else None
    return {"python": sys.version.split()[0], "executable": sys.executable,
            "platform": platform.platform(), "cpus": os.cpu_count(), "memory_bytes": memory,
            "nvcc": command_output(["nvcc", "--version"]), "ninja": command_output(["ninja", "--version"]),
            "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
            "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}


def kernels_auto(cuda: bool) -> dict:
    """What `model.kernels: auto` runs on this machine's ranks, decided as the ranks decide."""
    from types import SimpleNamespace

    from dsforge.translate.kernels import choose_kernels, liger_installed

    choice = choose_kernels(SimpleNamespace(kernels="auto"), device="cuda" if cuda else "cpu",
                            liger_available=liger_installed())
    return {"impl": choice.impl, "why": choice.why}


def collect(quick: bool) -> dict:
    facts = torch_facts()
    # liger_kernel.ops imports Triton, which needs a GPU driver: imported only where one is.
    liger_module = "liger_kernel.ops" if facts["cuda_available"] else None
    return {"host": host_facts(), "nvidia_smi": nvidia_smi(), "torch": facts,
            "packages": {"deepspeed": package("deepspeed", "deepspeed", quick),
                         "megatron-core": package("megatron-core", "megatron.core", quick),
                         "liger-kernel": package("liger-kernel", liger_module, quick),
                         "triton": package("triton", None, quick),
                         "transformer-engine": package("transformer-engine", None, quick),
                         "apex": package("apex", None, quick)},
            "kernels_auto": kernels_auto(facts["cuda_available"]),
            "dsforge": dsforge_facts()}


def problems(facts: dict, pins: dict[str, str]) -> list[str]:
    """What would stop a GPU run; `pins` are setup.cfg's exact versions."""
    found = []
    if not facts["torch"]["cuda_available"]:
        found.append("torch sees no CUDA device")
    for name in PINNED:
        entry = facts["packages"][name]
        if entry["version"] != pins.get(name):
            found.append(f"{name} {entry['version'] or 'not installed'}, setup.cfg pins {pins.get(name)}")
        if "import_error" in entry:
            found.append(f"{name} does not import: {entry['import_error']}")
    liger = facts["packages"]["liger-kernel"]
    if "import_error" in liger and facts["kernels_auto"]["impl"] == "liger":
        found.append(f"liger-kernel does not import ({liger['import_error']}), yet model.kernels "
                     "auto picks it: every run would fail")
    if not facts["dsforge"]["from_working_tree"]:
        found.append(f"dsforge imports from {facts['dsforge']['imported_from']}, not the working "
                     "tree (set PYTHONPATH to the repository root)")
    return found


def setup_pins() -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kit_wheels import setup_requirements

    pins = {}
    for name, requirement in setup_requirements().items():
        exact = [s.version for s in requirement.specifier if s.operator == "=="]
        if exact:
            pins[name] = exact[0]
    return pins


def summary(facts: dict) -> str:
    t, p = facts["torch"], facts["packages"]
    gpu = f"{t.get('device')} ({t.get('memory_bytes', 0) / 2**30:.1f} GiB, sm {t.get('capability')})" \
        if t["cuda_available"] else "no CUDA device"
    return (f"{gpu}; torch {t['version']} (CUDA {t['cuda']}, NCCL {t.get('nccl')}); "
            f"deepspeed {p['deepspeed']['version']}, megatron-core {p['megatron-core']['version']}, "
            f"liger-kernel {p['liger-kernel']['version']} (model.kernels auto: "
            f"{facts['kernels_auto']['impl']}), "
            f"dsforge {facts['dsforge']['tree_version']} from "
            f"{'the working tree' if facts['dsforge']['from_working_tree'] else facts['dsforge']['imported_from']}; "
            f"python {facts['host']['python']}, {facts['host']['cpus']} CPUs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="do not import deepspeed/megatron")
    args = parser.parse_args(argv)
    facts = collect(args.quick)
    facts["problems"] = problems(facts, setup_pins())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(facts, indent=2) + "\n")
    print(summary(facts))
    for problem in facts["problems"]:
        print(f"  problem: {problem}")
    return 1 if facts["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
