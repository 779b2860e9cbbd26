"""A rank's failure classified (job/failure.py, runtime/guard/build_failure.py): a build with the
op, the variable and the fix; an out-of-memory with what the rank measured; anything else as
an exception. Real DeepSpeed and torch code raises wherever it can on a CPU."""

from __future__ import annotations

import traceback

import pytest
import torch

from dsforge.job import failure
from dsforge.job.run_dir import RunDir
from dsforge.runtime.guard import oom
from dsforge.runtime.guard.build_failure import BuildCause, Evidence, Frame, Raised, diagnose
from dsforge.runtime.guard.record import record_for
from dsforge.translate.build_env import deepspeed_reads, map_arch_list

SITE = "/usr/lib/python3.11/site-packages"
BUILDER = Frame(f"{SITE}/deepspeed/ops/op_builder/builder.py", "jit_load", "fused_adam")
EXTENSION = Frame(f"{SITE}/torch/utils/cpp_extension.py", "_jit_compile", "my_ext")
ENGINE = Frame(f"{SITE}/deepspeed/runtime/engine.py", "_configure_optimizer")


def _record(exc: BaseException, step: int = 0) -> failure.Failure:
    try:
        raise exc
    except BaseException as raised:
        return record_for(raised, rank=0, step=step, detail=traceback.format_exc())


def _evidence(*raised: tuple[str, str], frames=()) -> Evidence:
    return Evidence(raised=tuple(Raised(t, m) for t, m in raised), frames=tuple(frames))


def test_deepspeeds_own_builder_on_the_h200s_arch_list(monkeypatch, tmp_path):
    """The first-day GPU failure, raised by DeepSpeed 0.19.8's CUDA FusedAdam JIT build itself
    (it reads the architecture list before compiling anything, on a CPU too)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    try:
        FusedAdamBuilder().jit_load(verbose=False)
    except ValueError as exc:
        record = record_for(exc, rank=3, step=-1, detail=traceback.format_exc())
    assert (record.kind, record.what) == ("build", "DeepSpeed's fused_adam op")
    assert record.message == "ValueError: invalid literal for int() with base 10: '0a'"
    assert record.headline() == (
        "rank 3 failed building DeepSpeed's fused_adam op before its first step: "
        "TORCH_CUDA_ARCH_LIST='9.0a' cannot be parsed by DeepSpeed's op builder, which reads each "
        "entry as MAJOR.MINOR[+PTX]. Fix: export TORCH_CUDA_ARCH_LIST='9.0' before dsforge run; "
        "or build nothing: torch's fused AdamW, --set train.adam_impl=fused")
    assert record.explained and "compute_capability_args" in record.detail


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the builder asks it instead")
def test_deepspeeds_builder_without_an_arch_list_or_a_gpu(monkeypatch):
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    with pytest.raises(RuntimeError) as caught:
        builder.compute_capability_args()
    cause = diagnose(_evidence_of(caught.value), {})
    assert cause.cause.startswith("TORCH_CUDA_ARCH_LIST is not set")


def _evidence_of(exc: BaseException) -> Evidence:
    from dsforge.runtime.guard.build_failure import evidence

    return evidence(exc)


def test_a_compiler_error_from_torchs_extension_loader(tmp_path, monkeypatch):
    """torch.utils.cpp_extension.load runs ninja and the compiler for real; the first error the
    compiler printed is the cause."""
    from torch.utils.cpp_extension import load

    source = tmp_path / "broken.cpp"
    source.write_text("int answer( { return 42; }\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(RuntimeError) as caught:
        load(name="dsforge_broken", sources=[str(source)], build_directory=None, verbose=False)
    cause = diagnose(_evidence_of(caught.value), {"CXX": "g++"})
    assert cause.what == "the C++/CUDA extension dsforge_broken"
    assert cause.cause.startswith("the compiler failed: ") and "error" in cause.cause
    assert "CXX=g++" in cause.fix


@pytest.mark.parametrize("value, readable", [
    ("9.0a", "9.0"), ("sm_90a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("8.6 9.0a+PTX", "8.6;9.0+PTX"),
    ("sm_100a", "10.0"), ("10.0f", "10.0"), ("9.0", "9.0"), ("8.0;8.0a", "8.0"),
])
def test_arch_lists_deepspeed_can_read(value, readable):
    """The fix a build failure names is translate/build_env.py's mapping (one rule for both)."""
    assert map_arch_list(value).mapped == readable and deepspeed_reads(readable)
    assert deepspeed_reads(value) == (value == readable)


@pytest.mark.parametrize("raised, expected", [
    (("deepspeed.ops.op_builder.builder.CUDAMismatchException",
      ">- DeepSpeed Op Builder: Installed CUDA version 13.0 does not match the version torch was "
      "compiled with 12.8, unable to compile cuda/cpp extensions without a matching cuda version."),
     ("the CUDA toolkit at CUDA_HOME=/usr/local/cuda is not the CUDA torch was built with "
      "(13.0 against torch's 12.8)", "CUDA major version")),
    (("deepspeed.ops.op_builder.builder.MissingCUDAException",
      "CUDA_HOME does not exist, unable to compile CUDA op(s)"),
     ("no CUDA compiler: CUDA_HOME=/usr/local/cuda holds no nvcc", "set CUDA_HOME")),
    (("builtins.RuntimeError", "Unable to JIT load the fused_adam op due to ninja not being installed."),
     ("ninja is not installed (or not on PATH)", "pip install ninja")),
    (("builtins.OSError", "[Errno 28] No space left on device: '/home/user/.cache/torch_extensions'"),
     ("cannot write its cache directory (TORCH_EXTENSIONS_DIR not set): OSError: [Errno 28] No "
      "space left",
      "set TORCH_EXTENSIONS_DIR")),
])
def test_the_environment_a_deepspeed_op_builds_in(raised, expected):
    cause = diagnose(_evidence(raised, frames=[ENGINE, BUILDER]), {"CUDA_HOME": "/usr/local/cuda"})
    assert cause.what == "DeepSpeed's fused_adam op"
    assert cause.cause.startswith(expected[0]) and expected[1] in cause.fix
    assert cause.fix.endswith("--set train.adam_impl=fused")  # the op dsforge can do without


def test_an_unknown_arch_for_torchs_extension_builder():
    cause = diagnose(_evidence(("builtins.ValueError", "Unknown CUDA arch (9.5) or GPU not supported"),
                               frames=[ENGINE, EXTENSION]), {"TORCH_CUDA_ARCH_LIST": "9.5"})
    assert cause.what == "the C++/CUDA extension my_ext"
    assert "names '9.5', an architecture torch's extension builder does not know" in cause.cause


def test_an_unrecognised_build_error_is_quoted_with_the_log_as_the_fix():
    cpu_adam = Frame(BUILDER.path, "load", "cpu_adam")
    cause = diagnose(_evidence(("builtins.RuntimeError", "something new\nsecond line"),
                               frames=[ENGINE, cpu_adam]), {})
    assert cause == BuildCause("DeepSpeed's cpu_adam op", "RuntimeError: something new",
                               "the build's output is in job.log; check the CUDA toolkit "
                               "(CUDA_HOME), the compilers and ninja")


TRITON_RUN = Frame(f"{SITE}/triton/runtime/jit.py", "run", "rms_norm_kernel")
TRITON_COMPILE = Frame(f"{SITE}/triton/compiler/compiler.py", "compile")


def test_triton_failures_while_compiling_a_kernel():
    wrapped = _evidence(("torch._dynamo.exc.BackendCompilerFailed", "backend='inductor' raised:"),
                        ("triton.compiler.errors.CompilationError", "at 3:4: invalid"))
    assert diagnose(wrapped, {}).what == "a Triton kernel"
    ptxas = _evidence(("builtins.RuntimeError", "PTXASError: ptxas fatal: Value 'sm_100a' is not defined"),
                      frames=[TRITON_RUN, TRITON_COMPILE,
                              Frame(f"{SITE}/triton/backends/nvidia/compiler.py", "make_cubin")])
    cause = diagnose(ptxas, {})
    assert cause.what == "the Triton kernel rms_norm_kernel" and "TRITON_PTXAS_PATH" in cause.fix
    cache = _evidence(("builtins.PermissionError", "[Errno 13] Permission denied: '/home/u/.triton'"),
                      frames=[TRITON_RUN, TRITON_COMPILE, Frame(f"{SITE}/triton/runtime/cache.py", "put")])
    assert diagnose(cache, {"TRITON_CACHE_DIR": "/home/u/.triton"}).cause.startswith(
        "cannot write TRITON_CACHE_DIR=/home/u/.triton: PermissionError: [Errno 13]")
    # a kernel that compiled and then failed at launch is the kernel's or the GPU's problem
    launch = _evidence(("builtins.RuntimeError", "Triton Error [CUDA]: an illegal memory access"),
                       frames=[TRITON_RUN, Frame(f"{SITE}/triton/backends/nvidia/driver.py", "__call__")])
    assert diagnose(launch, {}) is None


def test_torch_compile_fails_while_tracing_not_while_running():
    """torch.compile's own code, with the eager backend (nothing built on a CPU)."""

    def wrong_shapes(x):
        return x @ torch.ones(3, 4)

    def factorized(x):
        return torch.linalg.cholesky(x) * 2  # whether x is positive-definite shows when it runs

    with pytest.raises(Exception) as caught:
        torch.compile(wrong_shapes, backend="eager")(torch.ones(2, 2))
    cause = diagnose(_evidence_of(caught.value), {})
    assert cause.what == "torch.compile" and "must have same reduction dim" in cause.cause
    assert cause.fix == ("run with nothing compiled: --set model.compile=none where the recipe "
                         "compiles its layers, and the plain kernels: --set model.kernels=torch")
    with pytest.raises(torch.linalg.LinAlgError) as caught:  # compiled fine, failed running
        torch.compile(factorized, backend="eager")(-torch.eye(2))
    assert diagnose(_evidence_of(caught.value), {}) is None


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    MemoryError(),
])
def test_out_of_memory_records_what_the_rank_measured(exc):
    record = _record(exc, step=4)
    memory = record.memory
    assert record.kind == "oom" and record.explained
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert memory["source"] == ("cuda max_memory_allocated" if on_gpu else "process peak RSS")
    assert 0 <= memory["peak"] < memory["capacity"]
    assert memory["requested"] == (2 * 2**30 if str(exc) else None)
    assert record.headline().startswith("rank 0 ran out of memory at step 5: measured peak ")


def test_an_out_of_memory_re_raised_as_another_error_is_still_one():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as error:
            raise RuntimeError("while running the schedule") from error
    except RuntimeError as exc:
        assert oom.out_of_memory(exc)
    assert not oom.out_of_memory(RuntimeError("CUDA error: an illegal memory access"))


def test_measured_figures_in_words_and_what_the_rank_needed():
    gib = 2**30
    memory = {"source": "cuda max_memory_allocated", "peak": 133 * gib, "allocated": 131 * gib,
              "reserved": 138 * gib, "capacity": int(140.4 * gib), "device": "NVIDIA H200",
              "requested": 4 * gib}
    assert failure.measured_text(memory) == (
        "measured peak 133.0 GiB (cuda max_memory_allocated, 138.0 GiB reserved) of 140.4 GiB "
        "(NVIDIA H200); 4.0 GiB more requested")
    assert failure.needed_bytes(memory) == 135 * gib  # what it held plus what it asked for
    assert failure.needed_bytes({**memory, "requested": None}) == 133 * gib  # its peak
    assert oom.requested_bytes("Tried to allocate 20.00 MiB. GPU 0") == 20 * 2**20


def test_records_round_trip_with_their_cause_and_figures(tmp_path):
    build = failure.Failure(rank=0, step=-1, kind="build", message="ValueError: x", what="w",
                            cause="c", fix="f", time=1.0)
    oom = failure.Failure(rank=1, step=2, kind="oom", message="OutOfMemoryError", time=2.0,
                          memory={"source": "s", "peak": 1, "capacity": 2, "device": "d",
                                  "requested": None})
    run_dir = RunDir(tmp_path)
    for record in (build, oom):
        failure.write(run_dir, record)
    assert failure.read_all(run_dir) == [build, oom]
    assert build.headline() == "rank 0 failed building w before its first step: c. Fix: f"
