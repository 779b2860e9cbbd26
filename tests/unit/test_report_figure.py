"""Issue 25 item 5: the bench report's plot, tested on what it draws (bench/report.py
`figure_data` and the figure's artists), never on pixels. The numbers are the H200 ZeRO study's
(../shared/reference/gpu-h200-2026-11-26/zero-1b-report.md): ZeRO-0 peaks in the optimizer
step (27.62 GiB predicted, 27.69 measured), its backward is 25.36 GiB; ZeRO-1 peaks in the
backward (26.30 GiB)."""

from __future__ import annotations

import pytest

from dsforge.bench import report
from dsforge.bench.report import aggregate, figure_data, write_report
from dsforge.bench.store import Row, Store
from dsforge.units import GiB, MiB

PARTS = ("params", "grads", "bucket", "optimizer", "activations", "buffers", "step_grads",
         "step_buffers", "step_bucket")
# MiB per part, as the study's report tabulates them, and the measured peak in GiB.
H200 = {0: ((2357.13, 2357.13, 0.00, 14142.77, 7116.00, 0.00, 2357.13, 9428.52, 0.00), 27.69),
        1: ((2357.13, 2357.13, 953.67, 14142.77, 7116.00, 0.00, 2357.13, 7071.39, 0.00), 25.85)}


def _memory(mib: tuple[float, ...]) -> dict:
    """MemoryEstimate.to_dict() of these parts."""
    m = {part: int(value * MiB) for part, value in zip(PARTS, mib)}
    backward = sum(m[p] for p in ("params", "grads", "bucket", "optimizer", "activations", "buffers"))
    step = sum(m[p] for p in ("params", "optimizer", "step_grads", "step_buffers", "step_bucket"))
    return {**m, "backward_total": backward, "step_total": step, "total": max(backward, step),
            "peak": "optimizer step" if step > backward else "backward"}


def _row(stage: int, memory: dict, measured_gib: float) -> Row:
    figures = {"step_times_s": [1.6946, 1.6939], "tokens_per_s": 38673.0,
               "tokens_per_s_per_gpu": 38673.0, "mfu": 0.353, "hfu": 0.471,
               "peak_memory_bytes": int(measured_gib * GiB),
               "memory_source": "cuda max_memory_allocated", "bubble_share_by_stage": {}}
    prediction = {"memory_bytes": memory, "bubble_share_of_step": 0.0,
                  "flops_per_token": 9.03e9, "hardware_flops_per_token": 1.2e10}
    return Row(study="gpu_zero_1b", cell=f"zero{stage}", repeat=0, axes={"zero.stage": stage},
               status="ok", figures=figures, prediction=prediction,
               manifest={"device": {"name": "NVIDIA H200"}})


def _h200_rows() -> list[Row]:
    return [_row(stage, _memory(mib), measured) for stage, (mib, measured) in H200.items()]


def test_the_predicted_stack_is_the_moment_that_is_the_peak_and_adds_up_to_it(tmp_path):
    data = figure_data(aggregate(_h200_rows()))
    zero0, zero1 = data.memory
    assert (zero0.moment, zero1.moment) == ("optimizer step", "backward")
    for bar in data.memory:
        assert sum(height for _, height in bar.stack) == pytest.approx(bar.predicted_peak, abs=1e-6)
    assert round(zero0.predicted_peak, 2) == 27.62 and round(zero1.predicted_peak, 2) == 26.30
    # the backward moment, which the plot drew before, is the other one, 2.3 GiB lower
    assert zero0.other_moment[0] == "backward" and round(zero0.other_moment[1], 2) == 25.36
    assert [part for part, _ in zero0.stack] == ["params", "step_grads", "step_bucket",
                                                 "optimizer", "step_buffers"]
    assert round(zero0.measured, 2) == 27.69
    # the same peak as the table under the plot
    table = write_report(_store(tmp_path, _h200_rows()), tmp_path / "out").read_text()
    assert "| 0 | ok | 38,673 | 38,673 | 1694.2 [1693.9-1694.6] | 35.3% | 47.1% | 27.69 | 27.62 |" in table
    assert "| 1 | ok | 38,673 | 38,673 | 1694.2 [1693.9-1694.6] | 35.3% | 47.1% | 25.85 | 26.30 |" in table


def test_a_prediction_stored_before_the_optimizer_step_moment_stacks_its_backward():
    split = {"params": 2**28, "grads": 2**28, "optimizer": 2**29, "activations": 2**29,
             "buffers": 2**29}
    (bar,) = figure_data(aggregate([_row(1, {**split, "total": 2 * GiB}, 3.0)])).memory
    assert bar.moment == "backward" and bar.other_moment is None
    assert sum(h for _, h in bar.stack) == pytest.approx(bar.predicted_peak) == pytest.approx(2.0)


def test_mfu_is_on_the_throughput_bars_as_in_the_table():
    cells = aggregate(_h200_rows())
    assert [b.mfu for b in figure_data(cells).throughput] == ["35.3%", "35.3%"]
    # a study's peak override recomputes it, as the table does: 38,673 x 9.03e9 / 1e15
    assert [b.mfu for b in figure_data(cells, peak_tflops=1000).throughput] == ["34.9%", "34.9%"]


def test_the_figure_draws_its_data_with_the_legend_off_the_bars():
    """The artists of the figure: MFU texts on the throughput bars, the predicted stack's
    rectangles summing to the marked peak, and the memory legend outside the axes."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = aggregate(_h200_rows())
    data = figure_data(cells)
    fig = report.draw_figure("gpu_zero_1b", cells, data, plt)
    try:
        throughput, memory = fig.axes[:2]
        assert sorted(t.get_text() for t in throughput.texts) == ["MFU 35.3%", "MFU 35.3%"]
        for index, bar in enumerate(data.memory):
            predicted = [r for r in memory.patches
                         if abs(r.get_x() + r.get_width() / 2 - (index + 0.2)) < 1e-9]
            assert sum(r.get_height() for r in predicted) == pytest.approx(bar.predicted_peak)
            marks = [c for c in memory.collections if c.get_gid() == "predicted peak"]
            assert any(pytest.approx(bar.predicted_peak) == segment[0][1]
                       for c in marks for segment in c.get_segments())
        fig.canvas.draw()
        legend = memory.get_legend().get_window_extent()
        assert legend.x0 >= memory.get_window_extent().x1  # beside the axes, never on a bar
        labels = [t.get_text() for t in memory.get_legend().get_texts()]
        assert "predicted peak" in labels and "predicted: step_buffers" in labels
    finally:
        plt.close(fig)


def _store(tmp_path, rows: list[Row]):
    store = Store(tmp_path / "results.db")
    for row in rows:
        store.write(row)
    store.close()
    return tmp_path / "results.db"
