"""Issue 10: every bad input is a clean exit 2 that names what the user wrote, never a
traceback, a hang or a run that starts and dies. Through the `dsforge` command itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dsforge.cli import main
from tests.conftest import REPO

TINY = str(REPO / "recipes" / "tiny.yaml")


def run(*args: str):
    start = time.monotonic()
    result = CliRunner().invoke(main, list(args))
    result.seconds = time.monotonic() - start
    return result


def assert_clean_exit_2(result, *expected: str) -> None:
    """Exit 2 through sys.exit or a usage error, no exception escaping, each text shown."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for text in expected:
        assert text in result.output, result.output


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_a_non_utf8_recipe(tmp_path):
    path = _write(tmp_path, "r.yaml", Path(TINY).read_bytes().replace(b"Tiny", b"T\xefny"))
    assert_clean_exit_2(run("validate", path), "[Y6]", path, "not UTF-8")


def test_a_non_utf8_hostfile(tmp_path):
    hosts = _write(tmp_path, "hosts", b"n\xf6de slots=2\n")
    assert_clean_exit_2(run("validate", TINY, "--hostfile", hosts), "[H3]", hosts, "not UTF-8")


def test_ten_thousand_bad_hostfile_lines_are_not_ten_thousand_lines_of_output(tmp_path):
    hosts = _write(tmp_path, "hosts", b"bad\n" * 10_000)
    result = run("validate", TINY, "--hostfile", hosts)
    assert_clean_exit_2(result, "10000 errors", "... and 9980 more")
    assert len(result.output.splitlines()) < 30


@pytest.mark.parametrize("name", ["x" * 300, "a\\0b", "../../x", ".hidden"])
def test_a_name_that_is_no_plain_file_name(name):
    assert_clean_exit_2(run("validate", TINY, "--set", f'name="{name}"'), "[N1]", "name=")


def test_an_alias_bomb_is_refused_quickly_and_briefly(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    path = _write(tmp_path, "bomb.yaml", Path(TINY).read_bytes() + "\n".join(lines).encode())
    result = run("validate", path)
    assert_clean_exit_2(result, "[Y6]", "holds more than 10000 values")
    assert result.seconds < 10 and len(result.output) < 1000


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_a_model_beyond_the_limits_is_refused_quickly(command):
    result = run(command, TINY, "--set", "model.num_layers=1000000000000000000000000000000")
    assert_clean_exit_2(result, "model.num_layers")
    assert result.seconds < 20
    result = run(command, TINY, "--set", "model.num_layers=10001")
    assert_clean_exit_2(result, "[M1]", "at most 10,000")


def test_a_seed_no_rank_could_use():
    assert_clean_exit_2(run("validate", TINY, "--set", "train.seed=4611686018427387904"),
                        "[R1]", "train.seed")


def test_nan_says_nan_is_not_allowed():
    assert_clean_exit_2(run("validate", TINY, "--set", "train.lr=.nan"),
                        "NaN and infinities are not allowed")


def test_a_bad_set_value_is_named_by_its_set_item():
    result = run("validate", TINY, "--set", "name=foo: bar")
    assert_clean_exit_2(result, "--set='name=foo: bar'")
    assert "<string>" not in result.output


def test_token_file_mismatches_are_found_before_any_rank_starts(tmp_path):
    ids = np.random.default_rng(0).integers(1, 250, 5000)
    u32 = tmp_path / "u32.bin"
    ids.astype(np.uint32).tofile(u32)
    assert_clean_exit_2(run("validate", TINY, "--set", f"data.source={u32}"),
                        "[D4]", "data.token_dtype", "set data.token_dtype: uint32")
    big = tmp_path / "big.bin"
    (ids * 200).astype(np.uint16).tofile(big)
    assert_clean_exit_2(run("validate", TINY, "--set", f"data.source={big}"),
                        "[D3]", "model.vocab_size=256")
    assert_clean_exit_2(run("validate", TINY, "--set", f"data.source={tmp_path}"),
                        "[D2]", "is a directory")


def _damaged_run(tmp_path: Path) -> Path:
    """A run directory whose checkpoint lost part of an optimizer shard."""
    root = tmp_path / "run" / "checkpoints"
    (root / "step00000003").mkdir(parents=True)
    files = {"mp_rank_00_model_states.pt": 10, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 30,
             "zero_pp_rank_1_mp_rank_00_optim_states.pt": 30, "dsforge_rng_rank00000.pt": 5,
             "dsforge_rng_rank00001.pt": 5}
    for name, size in files.items():
        (root / "step00000003" / name).write_bytes(b"x" * size)
    (root / "step00000003" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x" * 7)
    (root / "step00000003" / "dsforge_complete.json").write_text(json.dumps(
        {"step": 3, "tag": "step00000003", "world_size": 2, "recipe": {}, "files": files}))
    (root / "latest").write_text("step00000003")
    return tmp_path / "run"


def test_resuming_a_run_directory_that_does_not_exist_is_refused_and_makes_nothing(tmp_path):
    missing = tmp_path / "nosuch"
    result = run("run", TINY, "--run-dir", str(missing), "--resume", "--skip-fit-check")
    assert_clean_exit_2(result, f"--resume: {missing} does not exist", "without --resume")
    assert list(tmp_path.iterdir()) == []  # no directory, no lock beside it
    result = run("run", TINY, "--resume", "--skip-fit-check")
    assert_clean_exit_2(result, "--resume needs --run-dir", "runs/NAME-DATE")


@pytest.mark.parametrize("damage, expected", [
    ("shard", "[CK4]"),
    ("latest", "[CK1]"),
    ("marker", "[CK3]"),
])
def test_a_damaged_checkpoint_is_refused_before_launch(tmp_path, damage, expected):
    run_dir = _damaged_run(tmp_path)
    if damage == "latest":
        (run_dir / "checkpoints" / "latest").write_bytes(b"\x00\xff" * 50)
    if damage == "marker":
        marker = run_dir / "checkpoints" / "step00000003" / "dsforge_complete.json"
        marker.write_bytes(marker.read_bytes()[:40])
    result = run("run", TINY, "--run-dir", str(run_dir), "--resume", "--dry-run",
                 "--skip-fit-check")
    assert_clean_exit_2(result, "cannot resume", expected)
