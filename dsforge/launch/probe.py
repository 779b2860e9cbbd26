"""What a machine has for a job: CPU cores, available host memory, GPUs and their memory, and
what DeepSpeed's run-time op builds would find there (`build_facts`, checked by build_env.py).

Standard library only, because preflight sends this file's text over ssh to every host of a
hostfile (`python -c SOURCE`) where dsforge may not be importable; the one dsforge import,
host_memory's (which a rank's checkpoint staging shares), preflight replaces with that module's
functions (preflight.host_script).
GPUs are read from nvidia-smi, never from torch: initialising CUDA here would leave a context
(hundreds of MiB) on every GPU for the whole job. torch and DeepSpeed are not imported either
(seconds each): the facts needed from them are read from their installed files' text.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess

from dsforge.host_memory import memory_available

MiB = 1024**2
# Where torch.utils.cpp_extension looks for the CUDA toolkit last (its _find_cuda_home).
TORCH_DEFAULT_CUDA_HOME = "/usr/local/cuda"


def probe() -> dict:
    return {"cpus": len(os.sched_getaffinity(0)), "memory_available": memory_available(),
            "gpus": visible_gpus()}


def visible_gpus() -> list[dict]:
    """name, total and free bytes of each GPU this process may use (CUDA_VISIBLE_DEVICES)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = "--query-gpu=index,uuid,name,memory.total,memory.free"
    try:
        out = subprocess.run([smi, query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        index, uuid, name, total, free = [part.strip() for part in line.split(",")]
        gpus.append({"index": index, "uuid": uuid, "name": name,
                     "memory_total": int(float(total)) * MiB, "memory_free": int(float(free)) * MiB})
    return only_visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def only_visible(gpus: list[dict], visible: str | None) -> list[dict]:
    if visible is None:
        return gpus
    by_key = {g["index"]: g for g in gpus} | {g["uuid"]: g for g in gpus}
    chosen = [by_key.get(item.strip()) for item in visible.split(",") if item.strip()]
    return [g for g in chosen if g is not None]


def build_facts() -> dict:
    """The fields of build_env.BuildFacts, as torch's and DeepSpeed's build would see them."""
    cuda_home = cuda_home_for_torch()
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    release, error = nvcc_release(nvcc) if nvcc else (None, None)
    cxx = os.environ.get("CXX") or "c++"  # torch's get_cxx_compiler
    return {"arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"), "cuda_home": cuda_home,
            "nvcc": nvcc, "nvcc_release": release, "nvcc_error": error,
            "torch_cuda": torch_cuda(), "ninja": shutil.which("ninja"), "cxx": cxx,
            "cxx_path": _which_command(cxx), "path": os.environ.get("PATH", ""),
            **prebuilt_ops()}


def cuda_home_for_torch() -> str | None:
    """The CUDA toolkit torch builds extensions with, found as torch finds it."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return TORCH_DEFAULT_CUDA_HOME if os.path.exists(TORCH_DEFAULT_CUDA_HOME) else None


def nvcc_release(nvcc: str) -> tuple[str | None, str | None]:
    """("13.0", None) from `nvcc --version`, or (None, why not)."""
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, "not found" if isinstance(exc, FileNotFoundError) else str(exc)
    # torch reads the version the same way (cpp_extension._check_cuda_version).
    found = re.search(r"release (\d+[.]\d+)", done.stdout)
    if done.returncode != 0 or found is None:
        return None, f"`nvcc --version` exited {done.returncode} without a CUDA release"
    return found.group(1), None


def torch_cuda() -> str | None:
    """torch.version.cuda (None for a CPU build of torch, or without torch)."""
    folder = _package_folder("torch")
    return _assigned(os.path.join(folder, "version.py")).get("cuda") if folder else None


def prebuilt_ops() -> dict:
    """The ops DeepSpeed was installed with prebuilt (DS_BUILD_OPS=1 or DS_BUILD_<OP>=1 at pip
    install time) and the accelerator they were built for, from the file its setup.py writes."""
    folder = _package_folder("deepspeed")
    found = _assigned(os.path.join(folder, "git_version_info_installed.py")) if folder else {}
    ops = found.get("installed_ops")
    built = sorted(name for name, yes in ops.items() if yes) if isinstance(ops, dict) else []
    return {"prebuilt_ops": built, "prebuilt_for": found.get("accelerator_name")}


def _package_folder(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)  # finds a top-level package without importing it
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def _assigned(path: str) -> dict:
    """The literal values a Python file assigns to names at its top level."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        for target in (t for t in targets if isinstance(t, ast.Name)):
            try:
                values[target.id] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                pass  # not a literal: not one of the facts read here
    return values


def _which_command(command: str) -> str | None:
    """The program a command line such as CXX="ccache g++" starts, found on PATH."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    return shutil.which(words[0]) if words else None


if __name__ == "__main__":
    print(json.dumps(dict(probe(), build=build_facts())))
