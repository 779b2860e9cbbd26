"""model.compile: layers end to end (runtime/assemble/compile.py): compiled runs train with
eager's losses, through `dsforge run` as a user starts it. Two CPU ranks with aot_eager (the
same graphs, no code generated) at dp 2 with ZeRO-2 and selective checkpointing, and at pp 2
with full checkpointing; one rank with inductor, whose kernels a second run finds in dsforge's
cache. (cp 2 and ZeRO-1 were compared by hand the same way, bit for bit: docs/runtime.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

TINY = REPO / "recipes" / "tiny.yaml"


def _run(tmp_path, name: str, *overrides: str, env: dict | None = None, world: int = 2) -> dict:
    run_dir = tmp_path / name
    sets = [word for item in ("train.steps=4", *overrides) for word in ("--set", item)]
    done = subprocess.run([sys.executable, "-m", "dsforge", "run", str(TINY), "--world-size",
                           str(world), *sets, "--run-dir", str(run_dir), "--timeout", "240"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"losses": losses, "stderr": done.stderr, "manifest": manifest, "summary": summary}


LAYOUTS = {"dp2_zero2_selective": ("zero.stage=2", "train.activation_checkpointing=selective"),
           "pp2_full": ("parallel.pp=2", "parallel.dp=1", "train.activation_checkpointing=full")}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", LAYOUTS)
def test_compiled_layers_train_with_eagers_losses(tmp_path, name):
    layout = LAYOUTS[name]
    eager = _run(tmp_path, "eager", *layout)
    compiled = _run(tmp_path, "compiled", *layout, "model.compile=layers",
                    env={"DSFORGE_COMPILE_BACKEND": "aot_eager"})
    assert compiled["losses"] == eager["losses"]
    assert compiled["manifest"]["implementations"]["compile"] == "layers (aot_eager)"
    assert eager["manifest"]["implementations"]["compile"] == "none"
    assert "layers compiled in" in compiled["stderr"] and "compile" in compiled["summary"]["startup_s"]
    assert "compiled again" not in compiled["stderr"]


@pytest.mark.timeout(300)
def test_inductor_compiles_once_per_machine(tmp_path):
    """inductor generates C++ here; its cache is dsforge's ($XDG_CACHE_HOME/dsforge/inductor)."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "DSFORGE_COMPILE_BACKEND": ""}
    small = ("parallel.dp=1", "model.num_layers=2")
    eager = _run(tmp_path, "eager", *small, world=1)
    first = _run(tmp_path, "first", *small, "model.compile=layers", env=env, world=1)
    second = _run(tmp_path, "second", *small, "model.compile=layers", env=env, world=1)
    assert first["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert second["losses"] == first["losses"]
    assert any((tmp_path / "cache" / "dsforge" / "inductor").iterdir())
    assert second["summary"]["startup_s"]["compile"] < first["summary"]["startup_s"]["compile"]
