"""What a rank was building when it died, why, and what fixes it (pure, torch-free).

A rank builds code at run time in three ways: DeepSpeed JIT-compiles an op (its op builder,
deepspeed/ops/op_builder, through torch.utils.cpp_extension), Triton compiles a kernel, and
torch.compile traces and compiles (torch._dynamo, torch._inductor). A failure there is a
problem of the machine's environment, not of the recipe or the model, and its traceback names
neither: on a real H200 DeepSpeed's builder read TORCH_CUDA_ARCH_LIST="9.0a" with int() and
every rank died of `ValueError: invalid literal for int() with base 10: '0a'`. `diagnose`
reads the exception chain and its frames (`evidence` takes them from a live exception) and
returns what was built, the cause naming the variable involved, and a fix; None when the
failure did not happen while building.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from dsforge.runtime.guard.chain import exception_chain
from dsforge.translate.build_env import deepspeed_reads, map_arch_list

# Path pieces (with "/" separators) of the code that builds: a frame of one of them on the stack
# means the failure happened while building. Not the code that runs what was built: a compiled
# graph runs under torch/_dynamo/eval_frame.py and launches its kernels through
# torch/_inductor/runtime/ and triton/runtime/, and an error there is the model's or the GPU's.
_OP_BUILDER = "/deepspeed/ops/op_builder/"
_CPP_EXTENSION = "/torch/utils/cpp_extension.py"
_TRITON = "/triton/"
_TRITON_COMPILER = "/triton/compiler/"
_COMPILE = ("/torch/_dynamo/convert_frame.py", "/torch/_inductor/compile_fx.py")
# Exception classes raised only while compiling.
_TRITON_ERRORS = ("triton.compiler.", "triton.runtime.errors.")
_COMPILE_ERRORS = ("torch._dynamo.exc.", "torch._inductor.exc.")
# The first error a compiler printed (gcc, clang, nvcc: "file:line:col: error: ...").
_COMPILER_ERROR = re.compile(r"^.*\berror:.*$", re.MULTILINE | re.IGNORECASE)
SHOWN_CHARS = 200  # longest piece of an error message a cause quotes


@dataclass(frozen=True)
class Frame:
    path: str  # the file, "/"-separated
    function: str
    builds: str | None = None  # what the frame's object builds: a DeepSpeed op's or a kernel's name


@dataclass(frozen=True)
class Raised:
    """One exception of the chain: its class (module-qualified) and its message."""
    type: str
    message: str


@dataclass(frozen=True)
class Evidence:
    raised: tuple[Raised, ...]  # the exception first, then what caused it (__cause__/__context__)
    frames: tuple[Frame, ...]  # every traceback of the chain, each outermost call first


@dataclass(frozen=True)
class BuildCause:
    what: str  # e.g. "DeepSpeed's fused_adam op"
    cause: str
    fix: str


def diagnose(evidence: Evidence, env: Mapping[str, str]) -> BuildCause | None:
    """The build the failure happened in, or None. DeepSpeed's ops first: their build runs
    through torch's extension loader and may be called from compiled code."""
    op = _deepspeed_op(evidence.frames)
    if op is not None:
        return _op_cause(f"DeepSpeed's {op} op" if op else "a DeepSpeed op", evidence, env, op)
    loader = [f for f in evidence.frames if _CPP_EXTENSION in f.path]
    if loader:
        name = next((f.builds for f in loader if f.builds), None)
        what = f"the C++/CUDA extension {name}" if name else "a C++/CUDA extension"
        return _op_cause(what, evidence, env, None)
    if _is_triton(evidence):
        kernel = next((f.builds for f in evidence.frames if _TRITON in f.path and f.builds), None)
        return _compile_cause(f"the Triton kernel {kernel}" if kernel else "a Triton kernel",
                              evidence, env, cache="TRITON_CACHE_DIR")
    if _is_compile(evidence):
        return _compile_cause("torch.compile", evidence, env, cache="TORCHINDUCTOR_CACHE_DIR")
    return None


def _deepspeed_op(frames: tuple[Frame, ...]) -> str | None:
    """The op name ("" when unnamed) if an op builder is on the stack, else None."""
    builders = [f for f in frames if _OP_BUILDER in f.path]
    if not builders:
        return None
    return next((f.builds for f in reversed(builders) if f.builds), "")


def _is_triton(evidence: Evidence) -> bool:
    return (any(r.type.startswith(_TRITON_ERRORS) for r in evidence.raised)
            or any(_TRITON_COMPILER in f.path for f in evidence.frames))


def _is_compile(evidence: Evidence) -> bool:
    return (any(r.type.startswith(_COMPILE_ERRORS) for r in evidence.raised)
            or any(part in f.path for f in evidence.frames for part in _COMPILE))


def _op_cause(what: str, evidence: Evidence, env: Mapping[str, str],
              op_name: str | None) -> BuildCause:
    """DeepSpeed's op builder and torch's extension loader: the environment they build in."""
    cause, fix = _op_environment(evidence, env) or (
        _quoted(evidence), "the build's output is in job.log; check the CUDA toolkit "
                           "(CUDA_HOME), the compilers and ninja")
    if op_name == "fused_adam":  # the one op dsforge can do without (translate/optimizer.py)
        fix += "; or build nothing: torch's fused AdamW, --set train.adam_impl=fused"
    return BuildCause(what, cause, fix)


def _op_environment(evidence: Evidence, env: Mapping[str, str]) -> tuple[str, str] | None:
    text = _text(evidence)
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if arch is not None and "invalid literal for int()" in text and not deepspeed_reads(arch):
        return _arch_list(arch)
    for check in (_unknown_arch, _cuda_mismatch, _compiler, _no_toolkit, _no_ninja, _no_arch_list):
        found = check(text, env)
        if found is not None:
            return found
    return _unwritable(text, env, "TORCH_EXTENSIONS_DIR")  # where torch's JIT builds go


def _arch_list(value: str) -> tuple[str, str]:
    cause = (f"TORCH_CUDA_ARCH_LIST={value!r} cannot be parsed by DeepSpeed's op builder, which "
             "reads each entry as MAJOR.MINOR[+PTX]")
    mapped = map_arch_list(value)
    if mapped.unreadable:
        return cause, ("set TORCH_CUDA_ARCH_LIST to the GPUs' architectures as MAJOR.MINOR, "
                       "e.g. '9.0' for H100/H200")
    return cause, f"export TORCH_CUDA_ARCH_LIST={mapped.mapped!r} before dsforge run"


def _unknown_arch(text: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    """torch's extension builder knows a fixed set of architectures (cpp_extension.py)."""
    match = re.search(r"Unknown CUDA arch \(([^)]*)\)", text)
    if match is None:
        return None
    value = env.get("TORCH_CUDA_ARCH_LIST", "")
    return (f"TORCH_CUDA_ARCH_LIST={value!r} names {match[1]!r}, an architecture torch's "
            "extension builder does not know",
            "set TORCH_CUDA_ARCH_LIST to the GPUs' architectures, e.g. '9.0' for H100/H200")


def _cuda_mismatch(text: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    if "CUDAMismatchException" not in text and "mismatches the version" not in text:
        return None
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH") or "(found on PATH)"
    versions = re.findall(r"\b\d+\.\d+\b", text)
    said = f" ({versions[0]} against torch's {versions[1]})" if len(versions) >= 2 else ""
    return (f"the CUDA toolkit at CUDA_HOME={home} is not the CUDA torch was built with{said}",
            "point CUDA_HOME at a toolkit of torch's CUDA major version (dsforge checks it "
            "before launch: rule BLD3)")


def _no_toolkit(text: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    if not ("MissingCUDAException" in text or "CUDA_HOME" in text or "nvcc not found" in text
            or "CUDA was not found" in text):
        return None
    home = env.get("CUDA_HOME")
    where = f"CUDA_HOME={home} holds no nvcc" if home else "CUDA_HOME is not set and no nvcc is on PATH"
    return (f"no CUDA compiler: {where}",
            "install the CUDA toolkit of torch's CUDA version and set CUDA_HOME to it")


def _no_ninja(text: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    if "ninja" not in text.lower() or "Error building extension" in text:
        return None
    return ("ninja is not installed (or not on PATH)", "pip install ninja")


def _no_arch_list(text: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    if "found no CUDA devices" not in text and "bad-fork" not in text and "forked subprocess" not in text:
        return None
    return ("TORCH_CUDA_ARCH_LIST is not set and the builder could not ask the GPUs",
            "set TORCH_CUDA_ARCH_LIST to the GPUs' architecture, e.g. '9.0' for H100/H200")


def _unwritable(text: str, env: Mapping[str, str], variable: str) -> tuple[str, str] | None:
    if not re.search(r"No space left on device|Permission denied|Read-only file system", text):
        return None
    where = env.get(variable)
    named = f"{variable}={where}" if where else f"its cache directory ({variable} not set)"
    return (f"cannot write {named}: {_first_line(text, r'No space|Permission|Read-only')}",
            f"set {variable} to a writable directory with free space")


def _compiler(text: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    if "Error building extension" not in text:
        return None
    first = _COMPILER_ERROR.search(text.split("Error building extension", 1)[1].split("\n", 1)[-1])
    said = f": {first[0].strip()[:SHOWN_CHARS]}" if first else ""
    compilers = f"CXX={env.get('CXX', 'c++')}, CUDA_HOME={env.get('CUDA_HOME', '(unset)')}"
    return (f"the compiler failed{said}",
            f"the compiler's whole output is in job.log; check the compilers ({compilers}) "
            "against the versions torch supports")


def _compile_cause(what: str, evidence: Evidence, env: Mapping[str, str], *,
                   cache: str) -> BuildCause:
    text = _text(evidence)
    found = _unwritable(text, env, cache)
    if found is not None:
        return BuildCause(what, *found)
    if "ptxas" in text.lower():
        return BuildCause(what, f"Triton's ptxas failed: {_first_line(text, 'ptxas')}",
                          "set TRITON_PTXAS_PATH to the ptxas of a CUDA toolkit that knows this "
                          "GPU, or run the plain kernels: --set model.kernels=torch")
    return BuildCause(what, _quoted(evidence),
                      "run with nothing compiled: --set model.compile=none where the recipe "
                      "compiles its layers, and the plain kernels: --set model.kernels=torch")


def _text(evidence: Evidence) -> str:
    """The chain as Python prints it, one "Type: message" after another."""
    return "\n".join(f"{r.type.rsplit('.', 1)[-1]}: {r.message}" for r in evidence.raised)


def _quoted(evidence: Evidence) -> str:
    """The innermost exception's first line: the closest to the cause."""
    last = evidence.raised[-1] if evidence.raised else Raised("Exception", "")
    name = last.type.rsplit(".", 1)[-1]
    message = last.message.strip().splitlines()[0] if last.message.strip() else ""
    return f"{name}: {message[:SHOWN_CHARS]}" if message else name


def _first_line(text: str, pattern: str) -> str:
    for line in text.splitlines():
        if re.search(pattern, line, re.IGNORECASE):
            return line.strip()[:SHOWN_CHARS]
    return ""


def evidence(exc: BaseException) -> Evidence:
    """The exception chain of `exc` and its frames, with what each builder frame builds."""
    raised, frames = [], []
    for current in exception_chain(exc):
        cls = type(current)
        raised.append(Raised(f"{cls.__module__}.{cls.__qualname__}", str(current)))
        frames += _frames(current.__traceback__)
    return Evidence(raised=tuple(raised), frames=tuple(frames))


def _frames(tb) -> list[Frame]:
    found = []
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename.replace("\\", "/")
        found.append(Frame(path, code.co_name, _builds(tb.tb_frame, path)))
        tb = tb.tb_next
    return found


def _builds(frame, path: str) -> str | None:
    """The name of what a builder frame builds: an op builder's NAME, the `name` torch's
    extension loader was given, a Triton JITFunction's function name."""
    local = frame.f_locals
    if _OP_BUILDER in path:
        return getattr(local.get("self"), "NAME", None)
    if _CPP_EXTENSION in path:
        name = local.get("name")
        return name if isinstance(name, str) else None
    if _TRITON in path:
        owner = local.get("self")
        name = getattr(owner, "__name__", None) or getattr(getattr(owner, "fn", None), "__name__", None)
        return name if isinstance(name, str) else None
    return None
