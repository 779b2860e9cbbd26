"""The ranks' heartbeat file (dsforge.job.heartbeat): written off the caller's thread, read back
by rank."""

from __future__ import annotations

import time

from dsforge.job.heartbeat import Heartbeat, read_all
from dsforge.job.run_dir import RunDir


def test_heartbeat_file_follows_the_beats_off_the_hot_path(tmp_path):
    run_dir = RunDir(tmp_path)
    heartbeat = Heartbeat(run_dir, rank=3, write_every_s=0.05)
    heartbeat.beat(7)
    assert read_all(run_dir) == {}  # nothing written on the caller's thread
    deadline = time.monotonic() + 5
    while 3 not in read_all(run_dir) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert read_all(run_dir)[3][0] == 7
    heartbeat.beat(8)
    heartbeat.flush()
    assert read_all(run_dir)[3][0] == 8


def test_a_heartbeat_that_cannot_be_read_is_left_out(tmp_path):
    """The supervisor reads the beats while recording how its rank ended: a file cut short or
    set aside by a restart between the listing and the read must not fail it."""
    run_dir = RunDir(tmp_path)
    run_dir.heartbeats.mkdir(parents=True)
    (run_dir.heartbeats / "rank00000").write_text("")
    (run_dir.heartbeats / "rank00001").write_text(f"5 {time.time()}")
    assert list(read_all(run_dir)) == [1]
