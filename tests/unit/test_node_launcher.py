"""dsforge's launcher of one machine's ranks (dsforge/launch/node.py), with a rank program
that starts in milliseconds: each rank's environment, a failing rank ending the others with
its exit code (a signal's too), and SIGTERM or SIGINT ending them all."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO


def _launch(tmp_path, *, fail: int = -1, code: int = 0, sleep: float = 0.0):
    command = [sys.executable, "-m", "dsforge.launch.node", "--nproc", "3", "--master_port",
               "4321", "--module", "tests.unit.helpers.fake_rank", str(tmp_path), str(fail),
               str(code), str(sleep)]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _ranks(tmp_path, count: int = 3, timeout_s: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(list(tmp_path.glob("rank*.json"))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(count)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_every_rank_gets_its_place_in_the_job(tmp_path):
    proc = _launch(tmp_path)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    for rank, seen in enumerate(_ranks(tmp_path)):
        assert seen["argv"] == f"--local_rank={rank}"
        assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"], seen["LOCAL_SIZE"]) == \
            (str(rank), str(rank), "3", "3")
        assert (seen["CROSS_RANK"], seen["CROSS_SIZE"]) == ("0", "1")
        assert (seen["MASTER_ADDR"], seen["MASTER_PORT"]) == ("127.0.0.1", "4321")
    assert "--master_addr=127.0.0.1 --master_port=4321" in output


@pytest.mark.parametrize("code, exit_code", [(3, 3), (-9, 256 - 9)])  # -9: SIGKILLed
def test_a_failing_rank_ends_the_others_and_gives_its_exit_code(tmp_path, code, exit_code):
    proc = _launch(tmp_path, fail=1, code=code, sleep=120)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == exit_code, output
    assert "rank 1 (pid" in output and f"exits with return code = {code}" in output
    assert not any(_alive(seen["pid"]) for seen in _ranks(tmp_path))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_every_rank(tmp_path, signum):
    proc = _launch(tmp_path, sleep=120)
    ranks = _ranks(tmp_path)
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert not any(_alive(seen["pid"]) for seen in ranks)
