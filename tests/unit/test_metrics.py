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


def test_mfu_with_a_known_peak():
    record = make_record(step=0, warmup=False, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=1.0,
                         tokens_per_step=1000, world_size=1, flops_per_token=1e9,
                         hardware_flops_per_token=2e9, peak_flops=1e13, device=torch.device("cpu"))
    assert record.mfu == pytest.approx(0.1) and record.hfu == pytest.approx(0.2)
