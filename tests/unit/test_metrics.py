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


def test_records_are_strict_json_with_null_for_values_that_are_not_finite():
    """json.dumps writes bare NaN and Infinity, which strict readers refuse; dsforge's records
    write null there, at any depth, and leave finite values alone."""
    import json
    import math

    from dsforge.job.metrics_file import json_text

    def refuse(constant):
        raise ValueError(constant)

    data = {"loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "steps": 3, "ok": True,
            "val_losses": [[1, -math.inf], [2, 2.5]], "nested": {"x": (math.nan, 0.5)}}
    text = json_text(data)
    assert json.loads(text, parse_constant=refuse) == {
        "loss": None, "grad_norm": None, "lr": 1e-3, "steps": 3, "ok": True,
        "val_losses": [[1, None], [2, 2.5]], "nested": {"x": [None, 0.5]}}


def test_a_resumed_run_reads_a_null_loss_back_as_nan(tmp_path):
    import math

    from dsforge.runtime.loop.metrics import MetricsWriter, make_record

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step, loss in enumerate([2.0, math.nan, 1.5]):
        writer.write(make_record(step=step, warmup=False, loss=loss, grad_norm=None, lr=1e-3,
                                 step_time_s=1.0, tokens_per_step=8, world_size=1,
                                 flops_per_token=1.0, hardware_flops_per_token=1.0,
                                 peak_flops=None, device=torch.device("cpu")))
    assert "NaN" not in path.read_text()
    again = MetricsWriter(path)
    again.keep_steps_before(3)
    assert [r.loss for r in again.records][::2] == [2.0, 1.5] and math.isnan(again.records[1].loss)


def test_a_resumed_run_reads_a_null_validation_loss_back_as_nan(tmp_path):
    import math

    from dsforge.runtime.loop.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    MetricsWriter(path).write_eval(1, math.inf)
    again = MetricsWriter(path)
    again.keep_steps_before(3)
    assert math.isnan(again.last_eval()[1])
