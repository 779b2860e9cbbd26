"""The GPU kit (benchmarks/gpu) without a GPU: its dry run, the one-command budget of the
essential selection, the wheel and pin checks, the planned recipes and studies, the command
list, the table, the driver's step runner and environment, and the scripts at tiny size."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

KIT = REPO / "benchmarks" / "gpu"


def _load_kit():
    """kit.py puts benchmarks/gpu on sys.path, so its sibling modules import by name."""
    spec = importlib.util.spec_from_file_location("gpu_kit", KIT / "kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load_kit()
kit_plan, kit_steps, kit_checks = kit.kit_plan, kit.kit_steps, kit.kit_checks
kit_results, kit_table, kit_wheels = kit.kit_results, kit.kit_table, kit.kit_wheels
kit_fake = kit.kit_fake


@pytest.fixture(autouse=True)
def corpus():
    """Every run resolves on the kit's corpus: the built one, else the dry run's stand-in (CI
    has no carried folder); reset after each test, since the driver's tests point it elsewhere."""
    built = kit.kit_corpus.built(kit_plan.CORPUS)
    kit_plan.use_corpus(kit_plan.CORPUS if built else kit.kit_corpus.stand_in())
    yield kit_plan.corpus()
    kit_plan.use_corpus(kit_plan.CORPUS)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_dry_run_passes_without_wheels_and_prints_every_command(gpu, tmp_path, capsys):
    code = kit.main(["--dry-run", "--gpu", gpu, "--wheels", str(tmp_path / "absent"), "all"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "wheels (" in out and "not built" in out and "dry run: ok" in out
    assert "FAKE INPUTS" in out and "Nothing here is a GPU measurement" in out
    steps = kit_steps.steps(kit_plan.select(["all"]), kit.Context(gpu=gpu, python="python3",
                                                                 work=kit.DEFAULT_WORK))
    for step in steps:
        if step.kind not in ("skip",):
            assert " ".join(step.argv[:3]) in out and step.argv[-1] in out
    assert out.rstrip().endswith("dry run: ok")


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_dry_run_of_the_essential_command_shows_its_estimate(gpu, tmp_path, capsys):
    assert kit.main(["--dry-run", "--gpu", gpu, "--wheels", str(tmp_path / "absent"), "essential"]) == 0
    out = capsys.readouterr().out
    seconds = kit_steps.selection_seconds("essential", gpu)
    assert f"commands on the {gpu} machine, from the repository root (~{seconds:.0f} s):" in out
    assert f"essential on {gpu}: ~{seconds:.0f} s of {kit_plan.selection_limit('essential'):.0f} s" in out


def test_unknown_measurement_is_a_usage_error(capsys):
    assert kit.main(["--dry-run", "mfu-70b"]) == 2
    assert "unknown measurement 'mfu-70b'" in capsys.readouterr().err


def test_selection_by_name_selection_and_all():
    assert [m.name for m in kit_plan.select(["essential"])] == ["gpu-tests", "anchor", "zero"]
    assert [m.name for m in kit_plan.select(["gemm", "levers", "gemm"])] == [
        "gemm", "kernels-1b", "adam-step", "7b-levers"]
    every = [m.name for m in kit_plan.select(["all"])]
    assert sorted(every) == sorted(kit_plan.MEASUREMENTS) and len(set(every)) == len(every)
    named = [n for names in kit_plan.SELECTIONS.values() for n in names]
    assert sorted(named) == sorted(kit_plan.MEASUREMENTS)  # each measurement in one selection
    with pytest.raises(ValueError):
        kit_plan.select([])
    with pytest.raises(ValueError, match="call1"):
        kit_plan.select(["call1"])


def test_the_essential_command_fits_8_minutes_with_install_and_environment():
    """Issue 21: the essential measurements fit one command of at most 8 minutes. The
    estimates include install and environment; the finish and a margin stay unplanned."""
    limit = kit_plan.ESSENTIAL_S - kit_plan.FINISH_S - kit_plan.ESSENTIAL_MARGIN_S
    assert kit_plan.selection_limit("essential") == limit and kit_plan.ESSENTIAL_S <= 480
    for gpu in kit_plan.PLANNED_GPUS:
        steps = kit_steps.selection_steps("essential", gpu)
        assert [s.kind for s in steps[:2]] == ["install", "env"]
        assert {"pytest", "run", "bench", "report"} <= {s.kind for s in steps}
        assert sum(s.expected_s for s in steps) <= limit, gpu
    assert kit_plan.ESSENTIAL_BUDGET_S + kit_plan.FINISH_S <= kit_plan.ESSENTIAL_S
    _, problems = kit_checks.selection_check()
    assert problems == []


def test_a_step_that_breaks_the_essential_budget_fails_the_check(monkeypatch):
    monkeypatch.setitem(kit_plan.SELECTIONS, "essential", (*kit_plan.SELECTIONS["essential"], "adam-step"))
    _, problems = kit_checks.selection_check()
    assert [p.split(":")[0] for p in problems] == ["essential on h100", "essential on h200"]


def test_optional_selections_each_fit_one_command():
    for selection in ("levers", "sweeps"):
        assert kit_plan.selection_limit(selection) == kit_plan.CALL_BUDGET_S < kit_plan.ONE_COMMAND_S
        for gpu in kit_plan.PLANNED_GPUS:
            assert kit_steps.selection_seconds(selection, gpu) <= kit_plan.CALL_BUDGET_S


def test_every_estimate_says_whether_it_was_measured_or_guessed():
    for selection in kit_plan.SELECTIONS:
        for gpu in kit_plan.PLANNED_GPUS:
            for step in kit_steps.selection_steps(selection, gpu):
                if step.kind not in ("plan", "skip"):
                    assert step.basis.startswith(("measured", "guess")), (step.name, step.basis)
                    assert step.expected_s > 0


def test_kit_pins_match_setup_cfg_and_a_drift_is_caught():
    pins, setup = kit_wheels.read_pins(), kit_wheels.setup_requirements()
    gpu_extra = kit_wheels.extra_requirements("gpu")
    assert "liger-kernel" in gpu_extra  # the kit carries what dsforge[gpu] adds
    assert kit_wheels.pin_problems(pins, setup, gpu_extra) == []
    drifted = [kit_wheels.Pin(p.name, "0.19.7" if p.name == "deepspeed" else p.version, p.why) for p in pins]
    assert any("deepspeed==0.19.8" in p for p in kit_wheels.pin_problems(drifted, setup))
    old_liger = [kit_wheels.Pin(p.name, "0.8.4" if p.name == "liger-kernel" else p.version, p.why)
                 for p in pins]
    assert [p for p in kit_wheels.pin_problems(old_liger, setup, gpu_extra) if "dsforge[gpu]" in p]
    without = [p for p in pins if p.name != "liger-kernel"]
    assert any("(nothing)" in p for p in kit_wheels.pin_problems(without, setup, gpu_extra))
    assert "liger-kernel==0.8.5" in kit_steps.install_requirements()


def _fake_wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any") -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", metadata)
    return path


def test_wheel_checks_on_a_fake_folder(tmp_path):
    expected = kit_wheels.expected_wheels(kit_wheels.read_pins())
    for name, version in expected.items():
        requires = {"deepspeed": ["hjson", "pydantic>=2.0.0", "torch>=2.0", 'pywin32; sys_platform == "win32"'],
                    "megatron-core": ["torch>=2.6.0", "packaging>=24.2"],
                    "dsforge": ["deepspeed==0.19.8", "megatron-core==0.16.1", "torch>=2.4"]}.get(name, [])
        _fake_wheel(tmp_path, name, version, requires)
    report = kit_wheels.check_wheels(tmp_path, expected)
    assert report.state == "complete" and report.problems == []
    assert kit_wheels.requirement_problems(tmp_path) == []  # the win32-only requirement is not ours

    _fake_wheel(tmp_path, "hjson", "3.0.0")
    (tmp_path / "packaging-26.2-py3-none-any.whl").unlink()
    _fake_wheel(tmp_path, "extra-thing", "1.0", ["no-such-package>=1"], tag="cp311-cp311-manylinux_2_17_x86_64")
    report = kit_wheels.check_wheels(tmp_path, expected)
    text = "\n".join(report.problems)
    assert report.state == "incomplete"
    assert "hjson: 2 versions" in text and "packaging==26.2: missing" in text
    assert "extra-thing 1.0: not in requirements.txt" in text and "not installable on CPython 3.12" in text
    assert any("no-such-package" in p and "neither carried" in p
               for p in kit_wheels.requirement_problems(tmp_path))
    lines, problems = kit_checks.wheel_check(tmp_path, with_tree=False)
    assert problems and any("incomplete" in line for line in lines)


def test_the_wheels_folder_is_ignored_and_travels_within_the_limit():
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q",
                              "benchmarks/gpu/wheels/deepspeed-0.19.8-py3-none-any.whl"])
    assert ignored.returncode == 0
    assert kit_wheels.tree_bytes() < kit_wheels.TREE_LIMIT_BYTES


@pytest.mark.skipif(kit_wheels.check_wheels(kit_wheels.WHEELS, kit_wheels.expected_wheels(
    kit_wheels.read_pins())).state != "complete" or kit_wheels.find_python312() is None,
    reason="needs the built kit (build_kit.sh) and a Python 3.12")
def test_pip_resolves_the_built_kit_for_the_gpu_image():
    ok, tail = kit_wheels.resolve_install(kit_wheels.WHEELS, kit_steps.install_requirements(),
                                          kit_wheels.find_python312())
    assert ok, tail


def test_import_check_flags_what_the_image_lacks():
    pins = kit_wheels.read_pins()
    assert kit_wheels.import_problems(["PyYAML", "hjson", "pydantic_core", "jaraco.text"], pins) == []
    assert kit_wheels.import_problems(["transformer_engine"], pins) == [
        "dsforge's runtime imports transformer-engine, which is neither carried nor in the GPU image"]


def test_planned_runs_and_studies_validate_and_fit_where_planned():
    lines, problems = kit_checks.spec_check()
    assert problems == []
    runs = [(spec, gpu) for m in kit_plan.MEASUREMENTS.values() for spec in m.runs for gpu in spec.gpus]
    assert len(runs) == sum(1 for line in lines if line.endswith("fits, runs"))
    for spec, gpu in runs:
        assert kit_steps.resolve_run(spec, gpu).layout.world_size == 1


def test_a_selection_running_one_recipe_twice_is_a_problem(monkeypatch):
    anchor = kit_plan.MEASUREMENTS["anchor"]
    shipped = next(s for s in anchor.runs if s.label == "7b-shipped")
    same = dataclasses.replace(shipped, label="7b-again", overrides=(*shipped.overrides, "zero.stage=0"))
    monkeypatch.setitem(kit_plan.MEASUREMENTS, "anchor",
                        dataclasses.replace(anchor, runs=(*anchor.runs, same)))
    assert kit_checks.duplicate_runs() == ["7b-again and 7b-shipped run the same recipe on h200 in essential; "
                                    "change one of them"]


def test_kit_recipes_and_studies_start_with_a_comment():
    files = sorted((KIT / "recipes").glob("*.yaml")) + sorted((KIT / "studies").glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        assert path.read_text().startswith("# "), path


def test_commands_per_gpu():
    ctx = lambda gpu: kit.Context(gpu=gpu, python="PY", work=Path("/w"))
    h100 = kit_steps.steps(kit_plan.select(["anchor"]), ctx("h100"))
    h200 = kit_steps.steps(kit_plan.select(["anchor"]), ctx("h200"))
    layouts = kit_steps.steps(kit_plan.select(["layouts"]), ctx("h200"))
    assert [s.kind for s in h100] == ["install", "env"] + ["plan", "run"]
    assert h100[0].argv[:6] == ("PY", "-m", "pip", "install", "--no-index", "--find-links")
    assert [s.name for s in h100 if s.kind == "run"] == ["3b-shipped"]
    assert [s.name for s in h200 if s.kind == "run"] == ["7b-shipped"]
    shipped = next(s for s in h200 if s.name == "7b-shipped")
    assert shipped.argv[:8] == ("PY", "-m", "dsforge", "run", "recipes/7b_1gpu.yaml", "--world-size",
                                "1", "--run-dir")
    assert shipped.argv[8] == "/w/runs/7b-shipped"
    # as shipped: only the step count (ten measured after two warm-up steps), the corpus
    # (real tokens) and the GPU's name change
    sets = [shipped.argv[i + 1] for i, word in enumerate(shipped.argv) if word == "--set"]
    assert sets == ["train.steps=12", "train.timing_warmup=2", f"data.source={kit_plan.corpus()}",
                    "cluster.gpu=h200"]
    assert shipped.argv[shipped.argv.index("--timeout") + 1] == f"{shipped.timeout_s - 30:.0f}"
    alternative = next(s for s in layouts if s.name == "7b-z3-none-mb1-gb8")
    assert "zero.stage=3" in alternative.argv and "train.global_batch=8" in alternative.argv
    assert alternative.spec.shrunk == kit_plan.GB8_SHRUNK
    # the default GPU path builds nothing: no run pays for a FusedAdam build any more
    assert shipped.expected_s == pytest.approx(kit_plan.START_7B.seconds + kit_plan.END_S
                                               + 12 * kit_plan.STEP_7B_SHIPPED.seconds)


def test_a_run_that_does_not_fit_becomes_a_skip_with_the_reason():
    spec = kit_plan.RunSpec(label="7b-none-mb4", recipe="recipes/7b_1gpu.yaml",
                            overrides=("train.activation_checkpointing=none", "train.micro_batch=4"),
                            start=kit_plan.START_7B, step=kit_plan.STEP_7B_SELECTIVE)
    [step] = kit_steps.run_steps(spec, "m", kit.Context(gpu="h100", python="PY", work=Path("/w")))
    assert step.kind == "skip" and "GiB per GPU >" in step.note and "H100" in step.note


def test_kempnerforge_formula_equals_dsforges_for_llama_and_differs_when_heads_x_dim_is_not_hidden():
    from dsforge.estimate.flops import flops_per_token
    from tests.conftest import make_recipe

    llama = make_recipe("model.preset=llama2-7b", "train.seq_len=4096").model
    assert kit_results.kempnerforge_flops_per_token(llama, 4096) == 46_084_915_200
    wide = make_recipe("model.kv_channels=32").model  # 4 heads x 32 = 128 != hidden 64
    assert kit_results.kempnerforge_flops_per_token(wide, 64) != flops_per_token(wide, 64).model


def test_table_from_fake_inputs(tmp_path):
    from dsforge.job.metrics_file import PHASES

    steps = kit_steps.steps(kit_plan.select(["all"]), kit.Context(gpu="h200", python="PY", work=tmp_path))
    records = kit_fake.write_fake_inputs(steps, tmp_path, "h200")
    result = kit_results.collect(steps, records, tmp_path, "h200")
    table = kit_table.render(result, fake=True)
    assert [r["label"] for r in result["runs"]] == [s.name for s in steps if s.kind in ("run", "skip")]
    for row in result["runs"]:
        assert row["mfu"] == pytest.approx(kit_fake.FAKE_MFU)
        if row["label"].startswith("moe"):  # KempnerForge's formula is for dense models
            assert row["mfu_kempnerforge"] is None
        else:
            assert row["mfu_kempnerforge"] == pytest.approx(kit_fake.FAKE_MFU)
        assert row["allocated_bytes"] / row["predicted_bytes"] == pytest.approx(0.9, abs=1e-6)
        assert sum(row["breakdown_s"].values()) == pytest.approx(row["step_s"])
    assert result["gpu_tests"]["counts"]["passed"] == 4 and result["precision"]["within_tolerance"]
    assert result["kernels"]["within_tolerance"] and result["kernels"]["steps"] == 30
    zero = result["studies"]["zero-1b"]
    assert sorted(c["axes"]["zero.stage"] for c in zero) == [0, 1, 2, 3]
    assert all(c["breakdown_s"] for c in zero)
    assert "| 7b-shipped | fake |" in table and "| zero.stage=3 | ok |" in table
    assert "| run | step ms | " + " | ".join(PHASES) + " |" in table
    assert "| zero-1b zero.stage=0 |" in table and "| moe-8l-grouped |" in table
    assert "| 3 | deepspeed | FAKE |" in table and "SDPA flash TFLOP/s" not in table  # no gemm.json
    assert "FAKE INPUTS" in table and "MFU 6P+12LDS" in table
    # issue 39: every figure with >= 10 measured steps, its loss, the prediction written before
    # it ran and the manifest's source and machine
    evidence = table[table.index("### Evidence"):].split("\n\n")[0]
    for row in result["runs"]:
        assert row["measured_steps"] >= 10 and row["loss_falls"] and row["predicted_step_s"] > 0
        assert f"| {row['label']} | {row['measured_steps']} | " in evidence
    assert "| 7b-shipped | 10 | 10.400 -> 7.439 | 11.28 |" in evidence
    assert "GPU-FAKE, driver FAKE" in evidence and "does not fall" not in evidence
    assert "| 7b-z3-none-mb1-gb8 |" in evidence and kit_plan.GB8_SHRUNK in evidence
    assert "| zero-1b zero.stage=3 | 10 |" in evidence
    # issue 40: the compiled and float8 runs against eager bf16, with the predicted ratios
    speedups = table[table.index("### Compiled layers and float8"):].split("\n\n")[0]
    assert "| 7b-fp8-compiled | " in speedups and "| 1.45 |" in speedups
    assert "### float8 follows bf16" in table and "within 1.5%" in table


def test_table_leaves_out_the_breakdown_of_a_run_without_one(tmp_path):
    """Runs of a dsforge that measured no breakdown (DSFORGE_BREAKDOWN=off, or older) render
    without that section instead of failing."""
    steps = kit_steps.steps(kit_plan.select(["moe-experts"]), kit.Context(gpu="h100", python="PY", work=tmp_path))
    records = kit_fake.write_fake_inputs(steps, tmp_path, "h100")
    for impl in ("sequential", "grouped"):
        summary = tmp_path / "runs" / f"moe-8l-{impl}" / "summary.json"
        data = json.loads(summary.read_text())
        data.pop("median_breakdown_s")
        summary.write_text(json.dumps(data))
    result = kit_results.collect(steps, records, tmp_path, "h100")
    assert result["runs"][0]["breakdown_s"] is None and result["runs"][0]["step_s"] > 0
    assert "Where the step goes" not in kit_table.render(result)


def test_a_run_that_does_not_learn_is_marked_and_one_without_a_manifest_gives_no_figures(tmp_path):
    steps = kit_steps.steps(kit_plan.select(["moe-experts"]), kit.Context(gpu="h200", python="PY", work=tmp_path))
    records = kit_fake.write_fake_inputs(steps, tmp_path, "h200")
    metrics = tmp_path / "runs" / "moe-8l-sequential" / "metrics.jsonl"
    flat = [{**json.loads(line), "loss": 10.37} for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in flat))
    (tmp_path / "runs" / "moe-8l-grouped" / "manifest.json").unlink()
    result = kit_results.collect(steps, records, tmp_path, "h200")
    sequential, grouped = result["runs"]
    assert sequential["loss_falls"] is False and sequential["first_loss"] == 10.37
    assert grouped.get("step_s") is None and "no manifest.json" in grouped["status"]
    table = kit_table.render(result)
    assert "10.370 -> 10.370 **does not fall**" in table
    assert "| moe-8l-grouped | fake; no manifest.json: figures left out |" in table


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_peer_runs_the_job_of_its_dsforge_run_and_peers_json_matches_them(gpu, tmp_path):
    """Issue 39: the peer gets the dsforge run's model, sequence length, global batch and
    micro-batch, on the same corpus; peers.json's rows carry the same model, precision and
    sequence length, MFU by dsforge's formula; the chart is drawn."""
    steps = kit_steps.steps(kit_plan.select(["peers"]), kit.Context(gpu=gpu, python="PY", work=tmp_path))
    [run] = [s for s in steps if s.kind == "run"]
    peers = [s for s in steps if s.kind == "peer"]
    assert [p.spec.compile for p in peers] == ["none", "layers"]
    train = kit_steps.resolve_run(run.spec, gpu).recipe.train
    for peer in peers:
        flag = lambda name: peer.argv[peer.argv.index(name) + 1]
        assert (flag("--seq-len"), flag("--global-batch"), flag("--micro-batch"), flag("--steps")) == \
            (str(train.seq_len), str(train.global_batch), str(train.micro_batch), "12")
        assert flag("--data") == str(kit_plan.corpus()) and peer.spec.matches == run.name
    records = kit_fake.write_fake_inputs(steps, tmp_path, gpu)
    rows = kit_results.collect(steps, records, tmp_path, gpu)["peers"]
    keys = {"framework", "version", "settings", "model", "seq_len", "global_batch_tokens",
            "precision", "measured_steps", "tokens_per_s_per_gpu", "mfu", "first_loss",
            "last_loss", "device"}
    assert [r["framework"].split()[0] for r in rows] == ["dsforge", "transformers+torch", "transformers+torch"]
    for row in rows:
        assert keys <= set(row) and row["measured_steps"] == 10
        assert (row["model"], row["precision"], row["seq_len"]) == \
            (rows[0]["model"], rows[0]["precision"], rows[0]["seq_len"])
        assert row["global_batch_tokens"] == 8 * 4096
    assert rows[1]["mfu"] == pytest.approx(kit_fake.FAKE_PEER_SHARE * rows[0]["mfu"])
    assert "| dsforge |" in kit_table.render(kit_results.collect(steps, records, tmp_path, gpu))
    assert kit.kit_peers.chart(rows, tmp_path / "peers.png").stat().st_size > 0


def _carried(tmp_path) -> str:
    """A carried folder whose corpus counts as built (the driver refuses to start without one)."""
    corpus = tmp_path / "wheels" / "corpus"
    corpus.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        (corpus / f"{kit.kit_corpus.NAME}{suffix}").write_bytes(b"")
    return str(tmp_path / "wheels")


def test_the_driver_refuses_to_start_without_the_corpus(tmp_path, capsys):
    out = tmp_path / "out"
    assert kit.main(["--out", str(out), "--work", str(tmp_path / "w"), "--wheels",
                     str(tmp_path / "absent"), "--gpu", "h100", "gemm"]) == 2
    assert "no corpus at" in (out / "kit.log").read_text() and "build_kit.sh" in capsys.readouterr().out


def _step(name, code, expected=1.0, timeout=30.0, kind="gemm"):
    return kit.Step(name=name, kind=kind, argv=(sys.executable, "-c", code), expected_s=expected,
                    timeout_s=timeout)


def test_the_driver_runs_steps_within_the_budget_and_writes_its_files(tmp_path, monkeypatch, capsys):
    steps = [_step("fine", "print('hello')"), _step("broken", "import sys; sys.exit(3)"),
             _step("slow", "import time; time.sleep(60)", timeout=1.0),
             _step("too-long", "print(1)", expected=10_000),
             kit.Step(name="unplanned", kind="skip", note="does not fit")]
    monkeypatch.setattr(kit.kit_steps, "steps", lambda measurements, ctx: steps)
    out, work = tmp_path / "out", tmp_path / "work"
    started = time.monotonic()
    code = kit.main(["--out", str(out), "--work", str(work), "--gpu", "h100", "--budget", "300",
                     "--wheels", _carried(tmp_path), "gemm"])
    assert time.monotonic() - started < 30  # the slow step's group was stopped at its limit
    assert code == 1
    results = json.loads((out / "results.json").read_text())
    status = {s["name"]: s["status"] for s in results["steps"]}
    assert status == {"fine": "ok", "broken": "failed (3)", "slow": "timeout",
                      "too-long": "skipped", "unplanned": "skipped"}
    assert (work / "logs" / "fine.log").read_text() == "hello\n"
    with tarfile.open(out / "records.tar.gz") as archive:  # packed: the logs are records
        assert {"logs/fine.log", "kit.log"} <= set(archive.getnames())
    assert not (out / "kit.log").exists() and not (out / "logs").exists()
    assert "| too-long | skipped |" in (out / "table.md").read_text()
    # printed last; table.md has machine paths written as <checkout>, <out>, ...
    assert capsys.readouterr().out.rstrip().endswith((out / "table.md").read_text().rstrip().splitlines()[-1])
    assert str(out) not in (out / "table.md").read_text()


def test_a_failed_required_step_stops_the_command(tmp_path, monkeypatch):
    steps = [kit.Step(name="env", kind="env", argv=(sys.executable, "-c", "raise SystemExit(1)"),
                      expected_s=1, timeout_s=30, required=True), _step("after", "print(1)")]
    monkeypatch.setattr(kit.kit_steps, "steps", lambda measurements, ctx: steps)
    out = tmp_path / "out"
    assert kit.main(["--out", str(out), "--work", str(tmp_path / "w"), "--gpu", "h100",
                     "--wheels", _carried(tmp_path), "gemm"]) == 1
    status = {s["name"]: s["status"] for s in json.loads((out / "results.json").read_text())["steps"]}
    assert status == {"env": "failed (1)", "after": "not run"}


def test_the_driver_sets_nothing_dsforge_does_not(monkeypatch, tmp_path):
    """Issue 21: the kit runs with the machine's environment as a user has it."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK", raising=False)
    env = kit.step_environment(tmp_path)
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0a" and "DS_SKIP_CUDA_CHECK" not in env
    added = {k for k in env if k not in __import__("os").environ}
    assert added <= {"PYTHONPATH", "PYTHONUNBUFFERED", "TORCH_EXTENSIONS_DIR", "DSFORGE_RUNS"}
    script = (KIT / "run.sh").read_text()
    assert "TORCH_CUDA_ARCH_LIST" not in script and "DS_SKIP_CUDA_CHECK" not in script


def test_probe_env_quick_on_this_cpu(tmp_path):
    import probe_env

    assert probe_env.main(["--quick", "--out", str(tmp_path / "env.json")]) == 1  # no CUDA here
    facts = json.loads((tmp_path / "env.json").read_text())
    assert facts["dsforge"]["from_working_tree"] and facts["problems"] == ["torch sees no CUDA device"]
    assert facts["kernels_auto"]["impl"] == "torch"  # auto on a machine without a GPU
    assert "liger-kernel" in facts["packages"] and "torch_cuda_arch_list" in facts["host"]


def test_gemm_code_runs_on_the_cpu_at_tiny_shapes():
    import gemm

    from dsforge.calibrate import kernel_timing

    result = gemm.run(["benchmarks/gpu/recipes/1b_1gpu.yaml"], "h100", tiny=True, reps=1, warmup=0)
    [model] = result["models"]
    assert len(model["gemms"]) == 5 * 3 and model["share_of_peak"] is None
    assert result["planner_compute_efficiency"] == 0.6
    flops = sum(g["count"] * 2 * g["m"] * g["k"] * g["n"] for g in model["gemms"])
    assert model["step_gemm_flops"] == flops
    backends = model["attention"]["backends"]
    assert list(backends) == list(kernel_timing.SDPA_BACKENDS)
    assert backends["auto"]["seconds"] > 0 and backends["flash"]["seconds"] > 0  # torch's CPU kernels
    assert "error" in backends["cudnn"]  # no cuDNN attention on a CPU: recorded, not raised
    assert model["attention"]["kv_heads"] == 8  # grouped KV heads go in as they are


def test_adam_step_script_on_the_cpu_at_tiny_shapes(tmp_path):
    """Its own process: DeepSpeed's engines need a process group, which this one must not get."""
    out = tmp_path / "adam.json"
    done = subprocess.run([sys.executable, str(KIT / "adam_step.py"), "--recipe",
                           "benchmarks/gpu/recipes/1b_1gpu.yaml", "--cpu-tiny", "--reps", "1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["stage"], r["impl"]) for r in result["results"]] == [(s, "fused") for s in range(4)]
    wrappers = [r["optimizer"].split(" around ")[0] for r in result["results"]]
    assert wrappers == ["FP16_UnfusedOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer",
                        "DeepSpeedZeroOptimizer_Stage3"]
    assert all(r["optimizer"].endswith("AdamW (fused)") and r["step_s"] > 0 for r in result["results"])


def test_adam_step_builds_fused_adam_in_the_environment_a_rank_gives_it(monkeypatch, capsys):
    """On 2026-11-26 the script built FusedAdam under the image's "9.0a" and every engine died;
    a dsforge rank maps the list first, and so does the script, with dsforge's own code."""
    import adam_step

    from dsforge.calibrate.optimizer_timing import build_environment

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    fused_adam = adam_step.resolve("benchmarks/gpu/recipes/1b_1gpu.yaml", 1, "deepspeed")
    assert build_environment(fused_adam) == {"TORCH_CUDA_ARCH_LIST": "9.0"}
    assert "TORCH_CUDA_ARCH_LIST='9.0a' is '9.0'" in capsys.readouterr().err
    torch_adamw = adam_step.resolve("benchmarks/gpu/recipes/1b_1gpu.yaml", 1, "fused")
    assert build_environment(torch_adamw) == {}  # nothing is built


def test_a_run_with_its_own_environment_starts_through_env():
    """The breakdown's cost: the same run with and without its clock, set for that run only."""
    ctx = kit.Context(gpu="h200", python="PY", work=Path("/w"))
    runs = [s for s in kit_steps.steps(kit_plan.select(["breakdown-cost"]), ctx) if s.kind == "run"]
    assert [s.argv[:5] for s in runs] == [("env", "DSFORGE_BREAKDOWN=on", "PY", "-m", "dsforge"),
                                          ("env", "DSFORGE_BREAKDOWN=off", "PY", "-m", "dsforge")]
    assert runs[0].argv[5:] == tuple(a.replace("-off", "-on") for a in runs[1].argv[5:])
    assert kit_checks.duplicate_runs() == []  # the same recipe twice, told apart by the environment


def test_the_calibrate_step_writes_a_profile_the_table_shows(tmp_path):
    """Issue 23's profile measured on the kit's GPU: dsforge calibrate at the 7B's shapes for
    the GPU the kit planned, its profile in the work folder (archived) and in the table."""
    ctx = kit.Context(gpu="h200", python="PY", work=tmp_path)
    [step] = [s for s in kit_steps.steps(kit_plan.select(["calibrate"]), ctx) if s.kind == "calibrate"]
    assert step.argv == ("PY", "-m", "dsforge", "calibrate", "recipes/7b_1gpu.yaml", "--gpu",
                         "h200", "--out", str(tmp_path / kit_steps.CALIBRATED))
    kit_fake.write_fake_inputs([step], tmp_path, "h200")
    table = kit_table.render(kit_results.collect([step], {}, tmp_path, "h200"))
    assert "### The profile dsforge calibrate measured (FAKE (dry run)" in table
    assert "| gemm_knee_tokens | 256 |" in table


def test_the_experts_selection_calibrates_the_moe_beside_its_runs(tmp_path):
    """Issue 47: the grouped GEMM timed on the kit's GPU (expert_efficiency) at the shipped
    MoE's shapes, its profile beside the 7B's in the work folder and in the table."""
    ctx = kit.Context(gpu="h200", python="PY", work=tmp_path)
    steps = kit_steps.steps(kit_plan.select(["experts"]), ctx)
    [step] = [s for s in steps if s.kind == "calibrate-moe"]
    assert step.argv == ("PY", "-m", "dsforge", "calibrate", "recipes/moe_1gpu.yaml", "--gpu",
                         "h200", "--out", str(tmp_path / kit_steps.CALIBRATED_MOE))
    kit_fake.write_fake_inputs([step], tmp_path, "h200")
    table = kit_table.render(kit_results.collect([step], {}, tmp_path, "h200"))
    assert f"(FAKE (dry run), {kit_steps.CALIBRATED_MOE};" in table
    assert kit_steps.CALIBRATED + ";" not in table  # no 7B profile was written
    assert "| expert_efficiency | - |" in table and "| fp8_gemm_speedup | 1.6 |" in table


def test_the_loop_starts_from_the_profile_calibrate_wrote_in_the_same_command(tmp_path):
    """Issue 23's loop on the kit's GPU (`profiles`): the search's top layouts of the model that
    fills the GPU, measured as trials and refitted, from calibrate's profile where calibrate
    runs first, else from the GPU's default profile."""
    ctx = kit.Context(gpu="h100", python="PY", work=tmp_path)
    steps = kit_steps.steps(kit_plan.select(["profiles"]), ctx)
    assert [s.kind for s in steps] == ["install", "env", "calibrate", "search"]
    loop = steps[-1]
    assert loop.argv[:6] == ("PY", "-m", "dsforge", "plan", "--search", kit_plan.THREE_B)
    assert loop.argv[-2:] == ("--profile", str(tmp_path / kit_steps.CALIBRATED))
    assert "--measure" in loop.argv and "--json" in loop.argv
    [alone] = [s for s in kit_steps.steps(kit_plan.select(["loop"]), ctx) if s.kind == "search"]
    assert "--profile" not in alone.argv
    h200 = kit.Context(gpu="h200", python="PY", work=tmp_path)
    [seven_b] = [s for s in kit_steps.steps(kit_plan.select(["loop"]), h200) if s.kind == "search"]
    assert kit_plan.SEVEN_B in seven_b.argv


def test_the_loops_table_reads_the_search_json_at_the_end_of_its_log(tmp_path):
    """The dry run runs the step's own search here (its arguments checked by dsforge's CLI) and
    invents the trials; the table reads the JSON after the progress lines of the log."""
    ctx = kit.Context(gpu="h100", python="PY", work=tmp_path)
    steps = [s for s in kit_steps.steps(kit_plan.select(["profiles"]), ctx)
             if s.kind in ("calibrate", "search")]
    kit_fake.write_fake_inputs(steps, tmp_path, "h100")
    loop = kit_results.loop_result(tmp_path)
    assert len(loop["measured"]) == kit_steps.LOOP_TOP and loop["refit"]["prediction_error"] == 0.02
    table = kit_table.render(kit_results.collect(steps, {}, tmp_path, "h100"))
    assert "### The loop: dsforge plan --search --measure, top 4 (the profile it started from: " \
           "FAKE (dry run))" in table
    assert "| 1 | tp1 pp1 dp1 ZeRO-0 mb1 ckpt none | ok |" in table
    log = tmp_path / "logs" / "loop.log"
    log.write_text("trial 1/4: failed (oom)\n")  # no JSON: the command died before printing it
    assert kit_results.loop_result(tmp_path) is None
    log.unlink()
    assert kit_results.loop_result(tmp_path) is None
