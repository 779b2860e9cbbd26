"""Step metrics (dsforge.runtime.loop.metrics): the record of a step, MFU/HFU, and the summary
that leaves out warmup."""

from __future__ import annotations

import pytest
import torch

from dsforge.runtime.loop.metrics import MetricsWriter, make_record


def test_metrics_summary_leaves_out_warmup(tmp_path):
    writer = MetricsWriter(tmp_path / "m.jsonl")
    for step, seconds in enumerate([10.0, 1.0, 2.0, 3.0]):
        writer.write(make_record(step=step, warmup=step == 0, loss=1.0, grad_norm=None, lr=0.1,
                                 step_time_s=seconds, tokens_per_step=100, world_size=2,
                                 flops_per_token=1e9, hardware_flops_per_token=1e9,
                                 peak_flops=None, device=torch.device("cpu")))
    summary = writer.summary()
    assert summary["measured_steps"] == 3 and summary["median_step_time_s"] == 2.0
    assert summary["median_mfu"] is None
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 4


def _write_steps(writer, steps, seconds, first_warmup):
    for step, s in zip(steps, seconds):
        writer.write(make_record(step=step, warmup=step < first_warmup, loss=float(step),
                                 grad_norm=None, lr=0.1, step_time_s=s, tokens_per_step=100,
                                 world_size=2, flops_per_token=1e9, hardware_flops_per_token=1e9,
                                 peak_flops=None, device=torch.device("cpu")))


def test_a_resumed_runs_summary_times_its_own_steps(tmp_path):
    """Resumed after step 5 (on another layout, say): the run's steps and losses are all its
    steps', its timings only the resumed process's measured ones (a summary over both mixed a
    dp2 run's 57 ms steps into a tp2 run's 200 ms)."""
    path = tmp_path / "m.jsonl"
    _write_steps(MetricsWriter(path), range(8), [9.0, 0.05, 0.05, 0.05, 0.05, 0.06, 0.06, 0.06], 1)
    resumed = MetricsWriter(path)
    resumed.keep_steps_before(5)  # steps 5-7 are trained again, first warming up at step 5
    _write_steps(resumed, range(5, 10), [3.0, 0.2, 0.2, 0.24, 0.2], 6)
    summary = resumed.summary()
    assert summary["steps"] == 10 and summary["final_loss"] == 9.0
    assert summary["measured_steps"] == 4 and summary["median_step_time_s"] == pytest.approx(0.2)


def test_mfu_with_a_known_peak():
    record = make_record(step=0, warmup=False, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=1.0,
                         tokens_per_step=1000, world_size=1, flops_per_token=1e9,
                         hardware_flops_per_token=2e9, peak_flops=1e13, device=torch.device("cpu"))
    assert record.mfu == pytest.approx(0.1) and record.hfu == pytest.approx(0.2)
