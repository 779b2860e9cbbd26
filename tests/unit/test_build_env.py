"""What DeepSpeed needs to build an op at run time (translate/build_env.py, launch/probe.py), on
simulated hosts: fake nvidia-smi, nvcc, ninja and c++ scripts on a PATH of their own.

The mapped architecture lists are fed to DeepSpeed's own parser and torch's, so these tests fail
when either moves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsforge import cli
from dsforge.launch import preflight as preflight_module
from dsforge.launch import probe
from dsforge.launch.fit import Gpu, Machine, fit_problems
from dsforge.recipe import resolve_file
from dsforge.translate.build_env import (AVOID, CUDA_OPS, TORCH_ARCH_NAMES, BuildFacts,
                                         arch_list_for_rank, build_problems, deepspeed_reads,
                                         map_arch_list, rank_env)
from dsforge.translate.optimizer import CPU_ADAM, FUSED_ADAM
from dsforge.units import GiB
from tests.conftest import REPO

TINY = str(REPO / "recipes" / "tiny.yaml")
DEEPSPEED_ADAM = ("--set", "train.adam_impl=deepspeed")
NVCC_OUTPUT = ("nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release {0}, "
               "V{0}.88\nBuild cuda_{0}.r{0}/compiler.36424714_0")
# The H200 image of ../shared/reference/gpu-h200-2026-11-26 (env.json): all a build needs.
H200_IMAGE = BuildFacts(arch_list="9.0a", cuda_home="/usr/local/cuda",
                        nvcc="/usr/local/cuda/bin/nvcc", nvcc_release="13.0", torch_cuda="13.0",
                        ninja="/venv/bin/ninja", cxx_path="/usr/bin/c++", path="/venv/bin:/usr/bin",
                        prebuilt_for="cuda")
NOTHING = BuildFacts(arch_list="hopper", path="/nowhere")  # no toolkit, no tools


def _rules(problems):
    return sorted((p.rule, p.severity) for p in problems)


# --- the architecture list, against DeepSpeed's parser and torch's ----------------------------

def _deepspeed_archs(value: str, monkeypatch) -> str:
    """What DeepSpeed 0.19.8's run-time build of FusedAdam makes of TORCH_CUDA_ARCH_LIST: the
    list it hands torch (builder.py compute_capability_args in JIT mode, as jit_load calls it)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    builder = FusedAdamBuilder()
    builder.jit_mode, builder._jit_arch_list = True, value.strip() or None
    builder.compute_capability_args()
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def _torch_flags(value: str, monkeypatch) -> list[str]:
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    return _get_cuda_arch_flags()


@pytest.mark.parametrize("value, mapped, deepspeed_builds", [
    ("9.0a", "9.0", "9.0+PTX"),                  # the H200 image's
    ("8.0;9.0a", "8.0;9.0", "8.0;9.0+PTX"),
    ("8.0 9.0a", "8.0;9.0", "8.0;9.0+PTX"),
    ("9.0a+PTX", "9.0+PTX", "9.0+PTX"),
    ("10.0a", "10.0", "10.0+PTX"),
    ("12.0f", "12.0", "12.0+PTX"),               # family-specific (CUDA 12.9+)
    ("sm_90a", "9.0", "9.0+PTX"),
    ("compute_90a;sm_80", "8.0;9.0+PTX", "8.0;9.0+PTX"),
    ("sm_100", "10.0", "10.0+PTX"),
    ("8.0,9.0", "8.0;9.0", "8.0;9.0+PTX"),
    ("9.0;9.0a;9.0+PTX", "9.0+PTX", "9.0+PTX"),  # each architecture once, +PTX kept
    ("Hopper", "9.0+PTX", "9.0+PTX"),            # torch's names
    ("Ampere Hopper", "8.0;8.6+PTX;9.0+PTX", "8.0;8.6+PTX;9.0+PTX"),
])
def test_lists_deepspeed_cannot_read_are_mapped_to_ones_it_builds_with(value, mapped,
                                                                        deepspeed_builds,
                                                                        monkeypatch):
    with pytest.raises((ValueError, IndexError)):
        _deepspeed_archs(value, monkeypatch)  # every rank died of this
    mapping = map_arch_list(value)
    assert mapping.changed and not mapping.unreadable and mapping.mapped == mapped
    assert _deepspeed_archs(mapping.mapped, monkeypatch) == deepspeed_builds
    _torch_flags(mapping.mapped, monkeypatch)  # and torch builds with it too


@pytest.mark.parametrize("value", ["9.0", "9.0+PTX", "8.0;9.0", "7.0 8.0 9.0+PTX", " 8.0 ; 9.0 ",
                                   "10.0;12.0", "", " "])
def test_lists_deepspeed_reads_are_left_as_set(value, monkeypatch):
    assert deepspeed_reads(value)
    mapping = map_arch_list(value)
    assert mapping.mapped == value and not mapping.changed
    if value.strip():
        _deepspeed_archs(value, monkeypatch)


def test_native_builds_for_the_visible_gpus(monkeypatch):
    """"native" is torch's word for the GPUs it sees; DeepSpeed does that for an empty list."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    with pytest.raises(ValueError):
        _deepspeed_archs("native", monkeypatch)
    assert map_arch_list("native").mapped == ""
    assert _deepspeed_archs("", monkeypatch) == "9.0+PTX"


@pytest.mark.parametrize("name", sorted(TORCH_ARCH_NAMES))
def test_torchs_names_map_to_the_architectures_torch_builds_them_for(name, monkeypatch):
    assert _torch_flags(name, monkeypatch) == _torch_flags(map_arch_list(name).mapped, monkeypatch)


@pytest.mark.parametrize("value, unreadable", [("hopper", ("hopper",)), ("9", ("9",)),
                                               ("8.0;sm90;9.0a", ("sm90",)),
                                               ("native;9.0", ("native",))])
def test_entries_nothing_maps_are_named(value, unreadable, monkeypatch):
    with pytest.raises((ValueError, IndexError)):
        _deepspeed_archs(value, monkeypatch)
    mapping = map_arch_list(value)
    assert mapping.unreadable == unreadable and not mapping.changed


def test_deepspeeds_run_time_build_parses_the_list_but_compares_no_cuda_versions(monkeypatch):
    """FusedAdamBuilder.jit_load, as a rank's first step calls it, up to torch's build: "9.0a"
    is the H200's ValueError, the mapped list reaches torch, and DeepSpeed's toolkit-versus-torch
    check (DS_SKIP_CUDA_CHECK's) never runs, so dsforge need not set DS_SKIP_CUDA_CHECK."""
    import torch
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed.ops.op_builder import builder
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    def compared(*args, **kwargs):
        raise AssertionError("DeepSpeed compared nvcc's CUDA with torch's")

    built = []
    monkeypatch.setattr(builder, "assert_no_cuda_mismatch", compared)
    monkeypatch.setattr(builder, "installed_cuda_version", compared)
    monkeypatch.setattr(builder.OpBuilder, "_loaded_ops", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(cpp_extension, "load",
                        lambda **kw: built.append(os.environ["TORCH_CUDA_ARCH_LIST"]) or "op")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="invalid literal for int.*'0a'"):
        FusedAdamBuilder().jit_load(verbose=False)
    env, _ = rank_env([FUSED_ADAM], os.environ)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"])
    assert FusedAdamBuilder().jit_load(verbose=False) == "op"
    assert built == ["9.0+PTX"] and os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_only_fused_adam_is_a_cuda_op_and_every_op_has_a_way_around():
    """CUDA_OPS against DeepSpeed's builders on its CUDA accelerator (CPU Adam comes from its
    CPU builders there); every op optimizer.py may build has a fix that builds nothing."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    cuda = CUDA_Accelerator()
    for op, name in ((FUSED_ADAM, "FusedAdamBuilder"), (CPU_ADAM, "CPUAdamBuilder")):
        builder = cuda.get_op_builder(name)
        assert builder.NAME == op and issubclass(builder, CUDAOpBuilder) == (op in CUDA_OPS)
    assert set(AVOID) == {FUSED_ADAM, CPU_ADAM}


# --- problems for each environment (pure) ------------------------------------------------------

def test_the_h200_image_builds_fused_adam_once_its_list_is_mapped():
    assert build_problems([FUSED_ADAM], H200_IMAGE, device="cuda", host="this machine") == []
    env, line = rank_env([FUSED_ADAM], {"TORCH_CUDA_ARCH_LIST": "9.0a"})
    assert env == {"TORCH_CUDA_ARCH_LIST": "9.0"}
    assert line.startswith("dsforge: TORCH_CUDA_ARCH_LIST='9.0a' is '9.0' on the ranks")


def test_an_older_cuda_toolkit_than_torchs_is_refused_with_the_fix():
    old = BuildFacts(**{**vars(H200_IMAGE), "nvcc_release": "12.4"})
    [problem] = build_problems([FUSED_ADAM], old, device="cuda", host="node3")
    assert (problem.rule, problem.severity) == ("BLD3", "error")
    assert problem.fields == {"host": "node3", "CUDA_HOME": "/usr/local/cuda",
                              "nvcc release": "12.4", "torch.version.cuda": "13.0"}
    assert "point CUDA_HOME at a CUDA 13.x toolkit" in problem.fix
    assert "train.adam_impl: auto" in problem.fix


def test_a_minor_cuda_mismatch_only_warns():
    facts = BuildFacts(**{**vars(H200_IMAGE), "nvcc_release": "12.4", "torch_cuda": "12.8"})
    assert _rules(build_problems([FUSED_ADAM], facts, device="cuda", host="h")) == [
        ("BLD4", "warning")]


def test_no_nvcc_is_refused_naming_where_torch_looked():
    bare = BuildFacts(**{**vars(H200_IMAGE), "cuda_home": None, "nvcc": None,
                         "nvcc_release": None})
    [problem] = build_problems([FUSED_ADAM], bare, device="cuda", host="this machine")
    assert problem.rule == "BLD2" and problem.fields == {"PATH": H200_IMAGE.path}
    assert "CUDA_HOME and CUDA_PATH are unset" in problem.message
    assert "CUDA 13.0" in problem.fix
    runtime_only = BuildFacts(**{**vars(H200_IMAGE), "cuda_home": "/opt/cuda",
                                 "nvcc": "/opt/cuda/bin/nvcc", "nvcc_release": None,
                                 "nvcc_error": "not found"})
    [problem] = build_problems([FUSED_ADAM], runtime_only, device="cuda", host="this machine")
    assert problem.rule == "BLD2" and problem.fields == {"CUDA_HOME": "/opt/cuda"}
    assert "/opt/cuda/bin/nvcc: not found" in problem.message


def test_no_ninja_and_no_compiler_are_refused_for_every_op():
    tools_missing = BuildFacts(**{**vars(H200_IMAGE), "ninja": None, "cxx_path": None,
                                  "cxx": "g++-13"})
    for op, device in ((FUSED_ADAM, "cuda"), (CPU_ADAM, "cuda"), (CPU_ADAM, "cpu"),
                       (FUSED_ADAM, "cpu")):
        problems = build_problems([op], tools_missing, device=device, host="this machine")
        assert _rules(problems) == [("BLD5", "error"), ("BLD6", "error")]
        assert problems[1].fields["CXX"] == "g++-13" and AVOID[op] in problems[1].fix


def test_an_unreadable_list_is_refused_naming_the_variable_its_value_and_the_fix():
    facts = BuildFacts(**{**vars(H200_IMAGE), "arch_list": "8.0;hopper"})
    [problem] = build_problems([FUSED_ADAM], facts, device="cuda", host="this machine")
    assert problem.rule == "BLD1" and problem.fields == {"TORCH_CUDA_ARCH_LIST": "8.0;hopper"}
    assert "'hopper'" in problem.message and "9.0 for H100/H200" in problem.fix
    text = str(problem)
    assert text.startswith("[BLD1] TORCH_CUDA_ARCH_LIST='8.0;hopper': ") and "Fix: set" in text


def test_builds_without_nvcc_check_no_cuda():
    """CPU Adam is C++ even on GPU ranks; FusedAdam on CPU ranks is DeepSpeed's C++ one."""
    cpp_only = BuildFacts(**{**vars(NOTHING), "ninja": "/b/ninja", "cxx_path": "/b/c++"})
    assert build_problems([CPU_ADAM], cpp_only, device="cuda", host="h") == []
    assert build_problems([FUSED_ADAM], cpp_only, device="cpu", host="h") == []
    assert _rules(build_problems([FUSED_ADAM], cpp_only, device="cuda", host="h")) == [
        ("BLD1", "error"), ("BLD2", "error")]


def test_an_op_deepspeed_was_installed_with_needs_nothing():
    prebuilt = BuildFacts(**{**vars(NOTHING), "prebuilt_ops": frozenset({FUSED_ADAM}),
                             "prebuilt_for": "cuda"})
    assert build_problems([FUSED_ADAM], prebuilt, device="cuda", host="h") == []
    # prebuilt for the cuda accelerator; CPU ranks on a machine without GPUs run the cpu one
    assert build_problems([FUSED_ADAM], prebuilt, device="cpu", host="h") != []
    assert build_problems([CPU_ADAM], prebuilt, device="cuda", host="h") != []


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_job_that_builds_nothing_is_never_refused_for_builds(device):
    machine = Machine(name="m", cpus=8, memory_available=100 * GiB,
                      gpus=(Gpu(name="H200", memory_total=141 * GiB, memory_free=140 * GiB),) * 2,
                      build=NOTHING)
    assert fit_problems(resolve_file(TINY), machine, device=device) == []
    deepspeed = resolve_file(TINY, ["train.adam_impl=deepspeed"])
    assert {p.rule for p in fit_problems(deepspeed, machine, device=device)} >= {"BLD5", "BLD6"}


def test_a_rank_maps_its_list_only_when_it_builds_on_a_gpu():
    """Each rank maps the list it has itself (runtime/rank.py), however it got there."""
    builds = resolve_file(TINY, ["train.adam_impl=deepspeed"])
    image = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    mapped, line = arch_list_for_rank(builds, "cuda", image)
    assert mapped == {"TORCH_CUDA_ARCH_LIST": "9.0"} and "DeepSpeed builds fused_adam" in line
    assert arch_list_for_rank(builds, "cpu", image) == ({}, "")
    assert arch_list_for_rank(resolve_file(TINY), "cuda", image) == ({}, "")  # builds nothing
    offload = resolve_file(TINY, ["zero.offload_optimizer=cpu"])  # CPU Adam: C++, no list read
    assert arch_list_for_rank(offload, "cuda", image) == ({}, "")
    assert arch_list_for_rank(builds, "cuda", {"TORCH_CUDA_ARCH_LIST": "9.0"}) == ({}, "")
    # unmappable: refused by BLD1 before launch, left as it is here
    assert arch_list_for_rank(builds, "cuda", {"TORCH_CUDA_ARCH_LIST": "hopper"})[0] == {}


def test_preflight_checks_the_list_the_ranks_will_get():
    host = BuildFacts(**{**vars(H200_IMAGE), "arch_list": "hopper"})
    assert host.forwarded({"TORCH_CUDA_ARCH_LIST": "9.0a"}).arch_list == "9.0a"
    assert host.forwarded({}).arch_list == "hopper"


# --- the probe, against what torch and DeepSpeed read -------------------------------------------

def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(0o755)
    return path


def _printf(lines) -> str:
    """Shell text printing `lines` with the shell's builtin (PATH holds no cat)."""
    return "printf '%s\\n' " + " ".join(f"'{line}'" for line in lines)


class FakeHost:
    """This process's environment as a host's: PATH holds only the fake tools made here,
    CUDA_HOME an empty toolkit."""

    def __init__(self, root: Path, monkeypatch):
        self.bin, self.cuda = root / "bin", root / "cuda"
        self.bin.mkdir()
        (self.cuda / "bin").mkdir(parents=True)
        monkeypatch.setenv("PATH", str(self.bin))
        monkeypatch.setenv("CUDA_HOME", str(self.cuda))
        for name in ("CUDA_PATH", "CXX", "TORCH_CUDA_ARCH_LIST", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(name, raising=False)

    def gpus(self, count: int) -> None:
        _script(self.bin / "nvidia-smi", _printf(f"{i}, GPU-{i}, NVIDIA H200, 143771, 143000"
                                                 for i in range(count)))

    def nvcc(self, release: str) -> None:
        _script(self.cuda / "bin" / "nvcc", _printf(NVCC_OUTPUT.format(release).splitlines()))

    def tools(self) -> None:
        _script(self.bin / "ninja", "echo 1.11.1")
        _script(self.bin / "c++", "exit 0")


@pytest.fixture
def host(tmp_path, monkeypatch):
    return FakeHost(tmp_path, monkeypatch)


def test_build_facts_read_what_torch_and_deepspeed_read(host, monkeypatch):
    import torch
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed import git_version_info
    from deepspeed.ops.op_builder.builder import installed_cuda_version

    host.nvcc("12.4")
    host.tools()
    facts = probe.build_facts()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", facts["cuda_home"])
    assert installed_cuda_version() == (12, 4) and facts["nvcc_release"] == "12.4"
    assert facts["torch_cuda"] == torch.version.cuda
    assert facts["prebuilt_for"] == git_version_info.accelerator_name
    assert facts["prebuilt_ops"] == sorted(op for op, yes in git_version_info.installed_ops.items()
                                           if yes)
    assert facts["ninja"] == str(host.bin / "ninja") and facts["cxx_path"] == str(host.bin / "c++")
    assert BuildFacts.from_probe(facts).nvcc == str(host.cuda / "bin" / "nvcc")


@pytest.mark.parametrize("where", ["CUDA_HOME", "CUDA_PATH", "nvcc on PATH", "neither"])
def test_the_toolkit_is_found_where_torch_finds_it(where, host, monkeypatch):
    from torch.utils.cpp_extension import _find_cuda_home

    monkeypatch.delenv("CUDA_HOME")
    if where in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.setenv(where, str(host.cuda))
    if where == "nvcc on PATH":
        _script(host.bin / "nvcc", "exit 0")
    assert probe.cuda_home_for_torch() == _find_cuda_home()


def test_an_nvcc_that_does_not_run_is_said(host):
    assert probe.nvcc_release(str(host.cuda / "bin" / "nvcc")) == (None, "not found")
    broken = _script(host.cuda / "bin" / "nvcc", "echo oops; exit 3")
    assert probe.nvcc_release(str(broken)) == (
        None, "`nvcc --version` exited 3 without a CUDA release")


# --- through the real command -----------------------------------------------------------------

def _run(*args: str):
    return CliRunner().invoke(cli.main, list(args))


def test_run_refuses_a_gpu_job_this_machine_cannot_build_for(host, tmp_path, monkeypatch):
    """Two H200s, the image's "9.0a" (mapped, so fine), no nvcc, no ninja, no c++."""
    host.gpus(2)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    result = _run("run", TINY, *DEEPSPEED_ADAM, "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2, result.output
    out = result.output
    assert f"{TINY} cannot build its DeepSpeed ops on this machine: 3 errors" in out
    assert "[BLD5]" in out and "[BLD6]" in out and "[BLD2]" in out and "[BLD1]" not in out
    assert f"CUDA_HOME='{host.cuda}'" in out and "--skip-fit-check" in out
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_run_refuses_a_toolkit_of_another_cuda_major_and_skip_fit_check_overrides(
        host, tmp_path, monkeypatch):
    host.gpus(2)
    host.tools()
    host.nvcc("12.4")
    monkeypatch.setattr(probe, "torch_cuda", lambda: "13.0")
    result = _run("run", TINY, *DEEPSPEED_ADAM, "--run-dir", str(tmp_path / "r"), "--dry-run")
    assert result.exit_code == 2 and "[BLD3]" in result.output, result.output
    assert "nvcc release='12.4', torch.version.cuda='13.0'" in result.output
    skipped = _run("run", TINY, *DEEPSPEED_ADAM, "--run-dir", str(tmp_path / "r"), "--dry-run",
                   "--skip-fit-check")
    assert skipped.exit_code == 0, skipped.output
    host.nvcc("13.0")
    fine = _run("run", TINY, *DEEPSPEED_ADAM, "--run-dir", str(tmp_path / "r"), "--dry-run")
    assert fine.exit_code == 0 and "BLD" not in fine.output, fine.output


def test_run_of_a_job_that_builds_nothing_ignores_the_build_environment(host, tmp_path,
                                                                        monkeypatch):
    host.gpus(2)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "hopper")
    result = _run("run", TINY, "--run-dir", str(tmp_path / "r"), "--dry-run")
    assert result.exit_code == 0 and "BLD" not in result.output, result.output


def test_preflight_refuses_a_host_that_cannot_build(host, tmp_path, monkeypatch):
    """The hostfile's host is this machine, reached with `python -c` instead of ssh: the real
    host script (probe.py's text) runs there with the fake tools."""
    host.gpus(2)
    monkeypatch.setattr(preflight_module, "ssh_command", lambda name, remote, timeout_s: remote)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu-node1 slots=2\n")
    result = _run("run", TINY, *DEEPSPEED_ADAM, "--hostfile", str(hostfile),
                  "--run-dir", str(tmp_path / "r"))
    assert result.exit_code == 2, result.output
    out = result.output
    assert f"preflight of {hostfile}: 3 errors" in out
    for rule in ("BLD2", "BLD5", "BLD6"):
        assert f"[{rule}] host='gpu-node1'" in out
