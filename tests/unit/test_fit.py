"""Refusing what cannot run here (launch/fit.py, launch/probe.py) and its CLI message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dsforge import cli
from dsforge.launch import probe
from dsforge.launch.fit import CPU_RANK_OVERHEAD_BYTES, Gpu, Machine, device_for, fit_problems
from dsforge.recipe import resolve_file
from dsforge.units import GiB
from tests.conftest import REPO

LAPTOP = Machine(name="this machine", cpus=2, memory_available=23 * GiB)
H200 = Gpu(name="NVIDIA H200", memory_total=141 * GiB, memory_free=140 * GiB)


def _rules(problems):
    return sorted((p.rule, p.severity) for p in problems)


def test_70b_on_a_cpu_machine_is_refused_for_memory_and_warned_for_cores():
    resolved = resolve_file(REPO / "recipes" / "70b_pp4.yaml")
    problems = fit_problems(resolved, LAPTOP, device="cpu")
    assert _rules(problems) == [("FIT2", "error"), ("FIT3", "warning")]
    memory = problems[0]
    assert memory.fields["ranks"] == 32 and memory.fields["memory per rank (estimated)"] == "50.8 GiB"


def test_70b_fits_eight_nodes_of_four_h200s_but_not_one():
    resolved = resolve_file(REPO / "recipes" / "70b_pp4.yaml")
    node = Machine(name="node1", cpus=64, memory_available=1000 * GiB, gpus=(H200,) * 4)
    assert fit_problems(resolved, node, device="cuda", ranks=4) == []
    assert _rules(fit_problems(resolved, node, device="cuda")) == [("FIT1", "error")]
    small = Machine(name="node1", cpus=64, memory_available=1000 * GiB,
                    gpus=(Gpu(name="A100", memory_total=40 * GiB, memory_free=39 * GiB),) * 4)
    assert _rules(fit_problems(resolved, small, device="cuda", ranks=4)) == [("FIT2", "error")]


def test_cpu_ranks_share_host_memory():
    resolved = resolve_file(REPO / "recipes" / "tiny.yaml")  # 2 ranks, a few MiB each
    assert fit_problems(resolved, LAPTOP, device="cpu") == []
    tight = Machine(name="m", cpus=2, memory_available=int(1.5 * CPU_RANK_OVERHEAD_BYTES))
    assert _rules(fit_problems(resolved, tight, device="cpu")) == [("FIT2", "error")]
    unknown = Machine(name="m", cpus=1, memory_available=None)
    assert _rules(fit_problems(resolved, unknown, device="cpu")) == [("FIT3", "warning")]


def test_device_auto_follows_the_gpus():
    assert device_for("auto", LAPTOP) == "cpu"
    assert device_for("auto", Machine(name="g", cpus=8, memory_available=None, gpus=(H200,))) == "cuda"
    assert device_for("cuda", LAPTOP) == "cuda"  # and then FIT1: no GPU for any rank
    resolved = resolve_file(REPO / "recipes" / "tiny.yaml")
    assert _rules(fit_problems(resolved, LAPTOP, device="cuda")) == [("FIT1", "error")]


def test_the_host_probe_runs_as_a_standalone_script(tmp_path):
    """preflight sends probe.py's text over ssh (with host_memory's functions in place of its
    import): it must need nothing but the stdlib, where dsforge is not importable."""
    from dsforge.launch.preflight import host_script

    out = subprocess.run([sys.executable, "-I", "-S", "-c", host_script(False)], capture_output=True,
                         text=True, check=True, timeout=60, cwd=tmp_path).stdout
    found = json.loads(out)["machine"]
    assert found["cpus"] >= 1 and found["memory_available"] > 0 and isinstance(found["gpus"], list)


@pytest.mark.parametrize("visible, expected", [(None, ["0", "1"]), ("1", ["1"]), ("", []),
                                               ("GPU-b", ["1"]), ("7", [])])
def test_cuda_visible_devices_narrow_the_gpus(visible, expected):
    gpus = [{"index": "0", "uuid": "GPU-a"}, {"index": "1", "uuid": "GPU-b"}]
    assert [g["index"] for g in probe.only_visible(gpus, visible)] == expected


def test_run_refuses_in_seconds_with_the_ways_forward(tmp_path):
    result = CliRunner().invoke(cli.main, ["run", str(REPO / "recipes" / "70b_pp4.yaml"),
                                           "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    out = result.output
    assert "does not fit this machine" in out and "[FIT2]" in out
    assert f"dsforge run {REPO / 'recipes' / '70b_pp4.yaml'} --tiny" in out
    assert "--hostfile HOSTFILE" in out and "--skip-fit-check" in out
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_the_reduce_bucket_is_no_larger_than_the_gradients_a_backward_fills():
    """DeepSpeed's default 5e8-element bucket would be 2 GB (fp32) against the tiny model and
    count whole in the fit (a GPU reserves it; on the CPU its pages would stay untouched):
    dsforge sizes it to the rank's parameters, so the prediction is what a backward writes."""
    from dsforge.estimate.memory import estimate_memory
    from dsforge.launch.fit import rank_memory_bytes

    resolved = resolve_file(REPO / "recipes" / "tiny.yaml", [], world_size=2)
    r = resolved.recipe
    memory = estimate_memory(model=r.model, train=r.train, zero=r.zero, layout=resolved.layout)
    assert 0 < memory.bucket <= memory.params + 4  # fp32, one parameter's rounding
    assert rank_memory_bytes(resolved, "cpu") == memory.total
