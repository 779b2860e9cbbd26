"""What model.compile runs as (torch-free: `dsforge plan` and the manifest say it; the ranks
compile with it in runtime/assemble/compile.py).

The backend is inductor; DSFORGE_COMPILE_BACKEND names another (the tests use aot_eager on CPU,
where inductor compiles each kernel with a C++ compiler in ~13 s)."""

from __future__ import annotations

import os

BACKEND_ENV = "DSFORGE_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_backend() -> str:
    return os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND


def inductor_cache_dir(torch_default: str | None = None) -> str:
    """Where inductor keeps its kernels: TORCHINDUCTOR_CACHE_DIR where the user chose one, else
    with dsforge's other caches (dsforge_inductor_dir), so a second run on the machine reuses
    them. `torch_default`: torch's own folder, which torch writes into the variable the first
    time it looks (so that value is no choice; in a process that imported inductor)."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    return chosen if chosen and chosen != torch_default else dsforge_inductor_dir()


def dsforge_inductor_dir() -> str:
    """$XDG_CACHE_HOME/dsforge/inductor, else ~/.cache/dsforge/inductor (torch's own default
    is a folder in /tmp, which machines clear)."""
    from dsforge.data.cache import default_cache_dir

    return str(default_cache_dir().parent / "inductor")


def compiled_with(setting: str) -> str:
    """model.compile as it runs: "none", or "layers (BACKEND)"."""
    return "none" if setting == "none" else f"{setting} ({compile_backend()})"


def compile_problems(model, *, compiler: str | None, cache_dir: str | None, host: str) -> list:
    """CM4: inductor compiles its kernels with the machine's C/C++ compiler (C++ on CPU ranks;
    Triton's launchers on GPUs), found as torch finds it ($CXX, else c++); CM5: it writes them
    to its cache (`cache_dir`, None where not checked: a remote host's). Nothing for eager
    runs or another backend."""
    from dsforge.problems import Problem

    if model.compile == "none" or compile_backend() != "inductor":
        return []
    problems = []
    if compiler is None:
        problems.append(Problem(rule="CM4", fields={"model.compile": model.compile, "host": host},
                                message="torch.compile's inductor needs a C/C++ compiler and none "
                                        "was found ($CXX, else c++ on the PATH)",
                                fix="install one (e.g. apt install g++) or set CXX, or use "
                                    "model.compile: none"))
    if cache_dir is not None and not _writable(cache_dir):
        problems.append(Problem(rule="CM5", fields={"model.compile": model.compile,
                                                    "TORCHINDUCTOR_CACHE_DIR": cache_dir},
                                message="inductor cannot write its kernel cache there",
                                fix="set TORCHINDUCTOR_CACHE_DIR (or XDG_CACHE_HOME) to a "
                                    "writable directory"))
    return problems


def _writable(path: str) -> bool:
    """The directory, or its nearest existing parent (it will be made), can be written."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    return os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)
