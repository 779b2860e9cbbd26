"""`dsforge report RESULTS.db`: a markdown report with PNG plots from a bench store.

The report states the FLOPs formula and the peak used, lists every cell with its status, and
puts measured figures next to the planner's predictions (memory per GPU, pipeline bubble).
Where the cells' runs measured a step breakdown (docs/breakdown.md), a table and a stacked
bar per cell show where the step goes. The study's plot (its data: `figure_data`) puts each
cell's MFU on its throughput bar, and beside the measured memory peak the planner's parts at
the moment its estimate peaks (the last backward or the optimizer step), which add up to the
predicted peak of the table, marked, with the other moment's total dashed. Where cells stored
the planner's step time (bench/run.py step_time_prediction), a table and a plot put it against
the measured median step (its data: `step_time_points`), so every study is a calibration check
of the step-time model; rows without one say why (a CPU cell, or a row written before bench
stored it).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dsforge.bench.run import CENSUS_POINTS, largest_census
from dsforge.bench.store import Row, Store, unusable
from dsforge.files import write_atomic
from dsforge.hardware import gpu_for_device_name
from dsforge.job.metrics_file import PHASES, median_breakdown
from dsforge.units import GiB, MiB


def aggregate(rows: list[Row]) -> list[dict]:
    """One entry per cell: repeats pooled (step times over every measured step of every repeat)."""
    return [_cell_summary(repeats) for repeats in current_cells(rows)[0]]


def current_cells(rows: list[Row]) -> tuple[list[list[Row]], int]:
    """Each combination of axes' rows of the cell measured last, and how many cells that
    leaves out: cells of an earlier base recipe (bench/study.py: the key includes the base),
    kept in the database but superseded."""
    cells: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        cells[row.cell].append(row)
    latest: dict[str, list[Row]] = {}
    for repeats in cells.values():
        axes = json.dumps(repeats[0].axes, sort_keys=True)
        if axes not in latest or _finished(repeats) > _finished(latest[axes]):
            latest[axes] = repeats
    return list(latest.values()), len(cells) - len(latest)


def _finished(repeats: list[Row]) -> float:
    return max(r.finished or 0.0 for r in repeats)


def _cell_summary(repeats: list[Row]) -> dict:
    ok = [r for r in repeats if r.status == "ok" and r.figures]
    first = repeats[0]
    summary = {"axes": first.axes, "status": _status(repeats), "reason": _reason(repeats),
               "repeats": len(repeats), "prediction": next((r.prediction for r in repeats if r.prediction), None),
               "device": _device(repeats)}
    if ok:
        times = [t for r in ok for t in r.figures["step_times_s"]]
        pick = lambda key: statistics.median(r.figures[key] for r in ok) if ok[0].figures[key] is not None else None
        summary.update(step_time_median=statistics.median(times), measured_steps=len(times),
                       step_time_min=min(times),
                       step_time_max=max(times), tokens_per_s=pick("tokens_per_s"),
                       tokens_per_s_per_gpu=pick("tokens_per_s_per_gpu"), mfu=pick("mfu"), hfu=pick("hfu"),
                       first_loss=ok[0].figures.get("first_loss"), final_loss=ok[0].figures.get("final_loss"),
                       peak_memory_bytes=max(r.figures["peak_memory_bytes"] for r in ok),
                       memory_source=ok[0].figures["memory_source"],
                       tensor_bytes=largest_census(r.figures.get("tensor_bytes") for r in ok),
                       **{f"tensor_bytes_{point}": largest_census(r.figures.get(f"tensor_bytes_{point}") for r in ok)
                          for point in CENSUS_POINTS},
                       bubble=_max_bubble(ok),
                       breakdown_s=median_breakdown(r.figures.get("breakdown_s") for r in ok))
    return summary


def _status(repeats: list[Row]) -> str:
    statuses = sorted({r.status for r in repeats})
    return statuses[0] if len(statuses) == 1 else "/".join(statuses)


def _reason(repeats: list[Row]) -> str | None:
    return next((r.reason for r in repeats if r.reason), None)


def _device(repeats: list[Row]) -> str | None:
    manifest = next((r.manifest for r in repeats if r.manifest), None)
    return manifest["device"]["name"] if manifest else None


def _max_bubble(ok: list[Row]) -> float | None:
    shares = [s for r in ok for s in r.figures["bubble_share_by_stage"].values()]
    return max(shares) if shares else None


def write_report(store_path: Path, out_dir: Path, peak_tflops: float | None = None) -> Path:
    """OUT_DIR/report.md and a plot per study; BenchError (naming RESULTS or --out, the path,
    and a fix) for a file that is not a results database or an OUT_DIR that cannot be written.
    The database is only read."""
    store = Store(store_path, argument="RESULTS", read_only=True)
    try:
        rows = store.rows()
    finally:
        store.close()
    try:
        return _write(rows, out_dir, peak_tflops)
    except OSError as exc:
        raise unusable("--out", out_dir, "cannot write the report", exc, folder=True,
                       elsewhere="give another --out") from None


def _write(rows: list[Row], out_dir: Path, peak_tflops: float | None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    studies: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        studies[row.study].append(row)
    parts = ["# dsforge bench report", "", _formula_text(), ""]
    for study, study_rows in studies.items():
        parts += _study_section(study, aggregate(study_rows), out_dir, peak_tflops)
        superseded = current_cells(study_rows)[1]
        if superseded:
            parts += [f"{superseded} earlier cell(s) of {study}, measured for an earlier version "
                      "of its base recipe, are kept in the database and not shown.", ""]
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(parts) + "\n")
    return path


def _formula_text() -> str:
    return ("MFU counts model FLOPs per token = 6 N + 12 L s (heads x head_dim): N the active "
            "matmul parameters incl. the output layer, the full (not causally halved) attention "
            "score matrix (docs/flops.md). HFU adds recomputation. Peak: the device's dense BF16 "
            "figure from dsforge/hardware.py unless overridden; MFU is n/a without a known "
            "peak (CPU). Bubble: measured share of each pipeline stage's schedule spent waiting "
            "(max over stages) next to the theoretical (p-1)/(v m + p-1).")


def _study_section(study: str, cells: list[dict], out_dir: Path, peak_tflops: float | None) -> list[str]:
    device = next((c["device"] for c in cells if c["device"]), "unknown")
    lines = [f"## {study}", "", f"Device: {device}. {_peak_text(device, peak_tflops)}", ""]
    lines += _table(cells, peak_tflops)
    lines += _memory_split(cells)
    lines += _breakdown_table(cells)
    lines += _step_time_table(cells)
    for plot in _plots(study, cells, out_dir, peak_tflops):
        lines += ["", f"![{plot.stem}]({plot.name})"]
    return lines + [""]


def _peak_text(device: str, peak_tflops: float | None) -> str:
    if peak_tflops:
        return f"Peak used: {peak_tflops:g} TFLOP/s (study override)."
    gpu = gpu_for_device_name(device or "")
    return f"Peak used: {gpu.peak_bf16_flops / 1e12:g} TFLOP/s ({gpu.name})." if gpu else "Peak: unknown, MFU n/a."


def _table(cells: list[dict], peak_tflops: float | None) -> list[str]:
    axes = list(cells[0]["axes"]) if cells else []
    header = axes + ["status", "tok/s", "tok/s/GPU", "step ms (median [min-max])", "MFU", "HFU",
                     "peak mem GiB (meas.)", "mem GiB (pred.)", "bubble (meas.)", "bubble (theory)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in cells:
        lines.append("| " + " | ".join([str(c["axes"][a]) for a in axes] + _cells_figures(c, peak_tflops)) + " |")
    reasons = [(c["axes"], c["status"], c["reason"]) for c in cells if c["reason"]]
    if reasons:
        lines += ["", "Not ok:"] + [f"- {axes_}: {status}: {reason}" for axes_, status, reason in reasons]
    return lines


MEMORY_PARTS = ("params", "grads", "bucket", "optimizer", "activations", "buffers", "step_grads",
                "step_buffers", "step_bucket")


def _memory_split(cells: list[dict]) -> list[str]:
    """The planner's estimate per component next to what was measured: the peak as a total only
    (the CUDA allocator's on GPU, the process's RSS on CPU, which also holds the Python and
    torch runtime), and live-tensor censuses (runtime/loop/tensor_census.py): inside a step, when
    its last backward ends (before ZeRO reduces it) and before the optimizer step (the
    gradients ZeRO holds and its reduce bucket), and when the torch optimizer steps (the fp32
    gradient DeepSpeed made for it), and after training (params, optimizer, other)."""
    predicted = [c for c in cells if c["prediction"]]
    if not predicted:
        return []
    axes = list(cells[0]["axes"])
    header = axes + [f"{p} (pred.)" for p in MEMORY_PARTS] + [
        "total (pred.)", "peak (meas.)", "measured as", "grads (in backward)", "bucket (in backward)",
        "grads (before step)", "grads (optimizer step)", "step grads (optimizer step)",
        "params (live)", "optimizer (live)", "other (live)"]
    lines = ["", "Memory per GPU, MiB: the planner's split (worst pipeline rank), the measured peak, and "
             "live tensors (runtime/loop/tensor_census.py, the rank holding the most): the gradients ZeRO "
             "holds and its reduce bucket when the step's last backward ends (before ZeRO reduces it) "
             "and before the optimizer step; the gradients left and the fp32 gradient DeepSpeed made "
             "(step grads) when the torch optimizer steps; then parameters, optimizer master copies and "
             "state, and everything else still allocated after training (gradients are freed by then). "
             "The planner's step_grads and step_buffers are what it expects in the optimizer step, after "
             "the activations are freed; the peak is measured as a total only.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in predicted:
        memory = c["prediction"]["memory_bytes"]
        measured = f"{c['peak_memory_bytes'] / MiB:,.1f}" if "peak_memory_bytes" in c else "-"
        live = [_census_cell(c, "tensor_bytes_backward", "grads"), _census_cell(c, "tensor_bytes_backward", "bucket"),
                _census_cell(c, "tensor_bytes_step", "grads"),
                _census_cell(c, "tensor_bytes_optimizer", "grads"),
                _census_cell(c, "tensor_bytes_optimizer", "step_grads"),
                *(_census_cell(c, "tensor_bytes", k) for k in ("params", "optimizer", "other"))]
        lines.append("| " + " | ".join([str(c["axes"][a]) for a in axes]
                                       + [f"{memory[p] / MiB:,.2f}" if p in memory else "-" for p in MEMORY_PARTS]
                                       + [f"{memory['total'] / MiB:,.2f}", measured,
                                          c.get("memory_source") or "-", *live]) + " |")
    return lines


def _broken_down(cells: list[dict]) -> list[dict]:
    return [c for c in cells if c.get("breakdown_s")]


def _breakdown_table(cells: list[dict]) -> list[str]:
    """Median ms per phase of the reporting rank's steps (repeats: the median of their
    medians), next to the median step."""
    shown = _broken_down(cells)
    if not shown:
        return []
    axes = list(cells[0]["axes"])
    header = axes + ["step ms"] + [f"{phase} ms" for phase in PHASES]
    lines = ["", "Where the step goes (docs/breakdown.md): the median of each phase over the "
             "measured steps of the reporting rank, ms; phases are exclusive (a ZeRO gather "
             "inside a forward counts as dp_comm) and sum to each step's time, their medians "
             "only roughly to the median step.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in shown:
        phases = [f"{c['breakdown_s'].get(p, 0.0) * 1e3:,.1f}" for p in PHASES]
        lines.append("| " + " | ".join([str(c["axes"][a]) for a in axes]
                                       + [f"{c['step_time_median'] * 1e3:,.1f}", *phases]) + " |")
    return lines


# Rows written before dsforge bench stored the planner's step time have a prediction without it.
NOT_STORED = ("not stored: written by a dsforge bench that did not store the planner's step time "
              "yet (cells run since store it; this report does not compute it afterwards)")


@dataclass(frozen=True)
class StepTimePoint:
    """One ok cell with a stored step-time prediction: a point of the predicted-vs-measured
    plot, seconds per optimizer step."""
    label: str
    predicted_s: float
    measured_s: float  # the median over every measured step of every repeat
    gpu: str  # the profile's GPU key (dsforge/hardware.py)

    @property
    def error(self) -> float:
        """predicted / measured - 1: above 0 the planner predicts a slower step than measured."""
        return self.predicted_s / self.measured_s - 1


def step_time_of(cell: dict) -> tuple[float | None, str | None]:
    """The cell's stored step-time prediction in seconds, or None and why there is none (None,
    None for a cell with no prediction at all: a rejected one)."""
    pred = cell["prediction"]
    if not pred:
        return None, None
    if "step_time_s" not in pred:
        return None, NOT_STORED
    if pred["step_time_s"] is None:
        return None, pred.get("step_time_why") or "none stored"
    return pred["step_time_s"], None


def step_time_points(cells: list[dict]) -> tuple[StepTimePoint, ...]:
    """What the predicted-vs-measured step time plot draws: each ok cell with a prediction."""
    points = []
    for c in cells:
        predicted, _ = step_time_of(c)
        if predicted is not None and "step_time_median" in c:
            points.append(StepTimePoint(_label(c), predicted, c["step_time_median"],
                                        c["prediction"]["step_time_profile"]["gpu"]))
    return tuple(points)


def _label(cell: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell["axes"].items())


def _seconds(value: float) -> str:
    return f"{value:#.4g}"


def _step_time_table(cells: list[dict]) -> list[str]:
    """Per cell: the planner's step time, the measured median, the error and the model's
    non-zero terms; then why cells have none. Nothing for a study with no prediction at all."""
    shown = [c for c in cells if c["prediction"]]
    if not shown:
        return []
    lines = ["", "Predicted vs measured step time: the planner's step time (cost/step_time.py, "
             "docs/search.md \"The step-time model\") on the default profile of the GPU the cell "
             "ran on, against the measured median step; error = predicted / measured - 1 (above "
             "0: predicted slower than measured)."]
    missing: dict[str, list[dict]] = defaultdict(list)
    rows = []
    for c in shown:
        predicted, why = step_time_of(c)
        if predicted is None:
            missing[why].append(c)
            continue
        measured = c.get("step_time_median")
        terms = c["prediction"].get("step_time_terms") or {}
        parts = ", ".join(f"{name} {_seconds(value)}" for name, value in terms.items()
                          if name != "total" and value)
        rows.append([str(c["axes"][a]) for a in c["axes"]] + [
            c["status"], c["prediction"]["step_time_profile"]["gpu"], _seconds(predicted),
            _seconds(measured) if measured is not None else "-",
            f"{predicted / measured - 1:+.1%}" if measured else "-", parts or "-"])
    if rows:
        axes = list(cells[0]["axes"])
        header = axes + ["status", "profile", "predicted s", "measured s (median)", "error",
                         "model's terms s"]
        lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        errors = [abs(p.error) for p in step_time_points(cells)]
        if errors:
            lines += ["", f"Median |error| over {len(errors)} measured cell(s): "
                          f"{statistics.median(errors):.1%}."]
    for why, without in missing.items():
        which = ("any cell" if len(without) == len(shown)
                 else "; ".join(_label(c) for c in without))
        lines += ["", f"No step-time prediction for {which}: {why}."]
    return lines


def _census_cell(cell: dict, census: str, part: str) -> str:
    counted = cell.get(census) or {}
    return f"{counted[part] / MiB:,.2f}" if part in counted else "-"


def _cells_figures(c: dict, peak_tflops: float | None) -> list[str]:
    pred = c["prediction"] or {}
    predicted = f"{pred['memory_bytes']['total'] / GiB:.2f}" if pred else "-"
    theory = f"{pred['bubble_share_of_step']:.1%}" if pred else "-"
    if "step_time_median" not in c:
        return [c["status"], "-", "-", "-", "-", "-", "-", predicted, "-", theory]
    mfu, hfu = _utilisation(c, peak_tflops)
    bubble = f"{c['bubble']:.1%}" if c["bubble"] is not None else "-"
    return [c["status"], f"{c['tokens_per_s']:,.0f}", f"{c['tokens_per_s_per_gpu']:,.0f}",
            f"{c['step_time_median'] * 1e3:.1f} [{c['step_time_min'] * 1e3:.1f}-{c['step_time_max'] * 1e3:.1f}]",
            mfu, hfu, f"{c['peak_memory_bytes'] / GiB:.2f}", predicted, bubble, theory]


def _utilisation(c: dict, peak_tflops: float | None) -> tuple[str, str]:
    """MFU/HFU: recomputed from tok/s/GPU with the study's peak, else the run's own figures."""
    if peak_tflops and c["prediction"]:
        per_gpu = c["tokens_per_s_per_gpu"]
        return (f"{per_gpu * c['prediction']['flops_per_token'] / (peak_tflops * 1e12):.1%}",
                f"{per_gpu * c['prediction']['hardware_flops_per_token'] / (peak_tflops * 1e12):.1%}")
    show = lambda v: f"{v:.1%}" if v is not None else "n/a"
    return show(c["mfu"]), show(c["hfu"])


# The planner's two moments (estimate/memory.py MemoryEstimate), each a stack of its parts in
# this order, and one colour per part, the same in every report.
MOMENTS = {"backward": ("params", "grads", "bucket", "optimizer", "activations", "buffers"),
           "optimizer step": ("params", "step_grads", "step_bucket", "optimizer", "step_buffers")}
PART_COLORS = {"params": "#c44e52", "grads": "#dd8452", "bucket": "#ccb974",
               "optimizer": "#8c613c", "activations": "#da8bc3", "buffers": "#937860",
               "step_grads": "#f0b27a", "step_bucket": "#e5d8a0", "step_buffers": "#64b5cd"}


@dataclass(frozen=True)
class ThroughputBar:
    label: str
    tokens_per_s: float
    mfu: str  # as the table shows it: "35.3%" or "n/a"


@dataclass(frozen=True)
class MemoryBar:
    """One cell's bars in the memory plot, GiB: the measured peak, and the planner's parts at
    the moment its estimate peaks, which add up to `predicted_peak` (the table's mem GiB
    (pred.)); `other_moment` is the total of the moment that does not."""
    label: str
    measured: float
    moment: str | None  # "backward" or "optimizer step"; None without a prediction
    stack: tuple[tuple[str, float], ...]  # (part, GiB) from the bottom
    predicted_peak: float | None
    other_moment: tuple[str, float] | None


@dataclass(frozen=True)
class FigureData:
    """What the study's plot draws (tested as data, not pixels)."""
    throughput: tuple[ThroughputBar, ...]
    memory: tuple[MemoryBar, ...]
    memory_source: str | None


def figure_data(cells: list[dict], peak_tflops: float | None = None) -> FigureData:
    ok = [c for c in cells if "step_time_median" in c]
    labels = [_label(c) for c in ok]
    throughput = tuple(ThroughputBar(label, c["tokens_per_s"], _utilisation(c, peak_tflops)[0])
                       for c, label in zip(ok, labels))
    memory = tuple(_memory_bar(c, label) for c, label in zip(ok, labels))
    return FigureData(throughput, memory, ok[0]["memory_source"] if ok else None)


def _memory_bar(cell: dict, label: str) -> MemoryBar:
    measured = cell["peak_memory_bytes"] / GiB
    memory = (cell["prediction"] or {}).get("memory_bytes")
    if not memory:
        return MemoryBar(label, measured, None, (), None, None)
    totals = {moment: sum(memory.get(part, 0) for part in parts) for moment, parts in MOMENTS.items()}
    # Rows stored before the planner had an optimizer-step moment lack "peak" and step parts.
    peak = memory.get("peak") if memory.get("peak") in MOMENTS else max(totals, key=totals.get)
    stack = tuple((part, memory.get(part, 0) / GiB) for part in MOMENTS[peak])
    other = next(m for m in MOMENTS if m != peak)
    has_other = any(part in memory for part in MOMENTS[other] if part not in MOMENTS[peak])
    return MemoryBar(label, measured, peak, stack, memory["total"] / GiB,
                     (other, totals[other] / GiB) if has_other else None)


def _plots(study: str, cells: list[dict], out_dir: Path, peak_tflops: float | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in cells if "step_time_median" in c]
    if not ok:
        return []
    data = figure_data(ok, peak_tflops)
    fig = draw_figure(study, ok, data, plt)
    path = out_dir / f"{study}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends outside the axes included
    plt.close(fig)
    return ([path] + _breakdown_plot(study, ok, [b.label for b in data.throughput], out_dir, plt)
            + _step_time_plot(study, step_time_points(ok), out_dir, plt))


def _step_time_plot(study: str, points: tuple[StepTimePoint, ...], out_dir: Path, plt) -> list[Path]:
    if not points:
        return []
    fig = draw_step_time(study, points, plt)
    path = out_dir / f"{study}-step-time.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def draw_step_time(study: str, points: tuple[StepTimePoint, ...], plt):
    """Predicted step time on x, measured on y, one labelled point per cell, and the diagonal
    (predicted = measured): points above it ran slower than predicted. Labels of points close
    together are stacked apart, each with a line to its point."""
    fig, axis = plt.subplots(figsize=(7, 6))
    axis.scatter([p.predicted_s for p in points], [p.measured_s for p in points], color="#4c72b0",
                 zorder=3, gid="cells")
    values = [v for p in points for v in (p.predicted_s, p.measured_s)]
    low, high = 0.9 * min(values), 1.1 * max(values)
    gap = 0.05 * (high - low)
    label_y: dict[int, float] = {}
    below = float("-inf")
    for i in sorted(range(len(points)), key=lambda i: points[i].measured_s):
        label_y[i] = below = max(points[i].measured_s, below + gap)
    high = max(high, below + gap)
    for i, p in enumerate(points):
        moved = abs(label_y[i] - p.measured_s) > 1e-12
        axis.annotate(f"{p.label} ({p.error:+.1%})", (p.predicted_s, p.measured_s),
                      xytext=(p.predicted_s + 0.03 * (high - low), label_y[i]), textcoords="data",
                      va="center", fontsize=8,
                      arrowprops={"arrowstyle": "-", "color": "grey", "linewidth": 0.6} if moved else None)
    axis.plot([low, high], [low, high], color="black", linestyle="dashed", linewidth=1,
              label="predicted = measured", gid="diagonal")
    axis.set_xlim(low, high)
    axis.set_ylim(low, high)
    axis.set_aspect("equal")
    axis.set_xlabel("predicted step time, s (planner, " + ", ".join(sorted({p.gpu for p in points}))
                    + " profile)")
    axis.set_ylabel("measured step time, s (median)")
    axis.set_title(f"{study}: predicted vs measured step time")
    axis.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def draw_figure(study: str, ok: list[dict], data: FigureData, plt):
    """Throughput with each bar's MFU on it; memory: the measured peak beside the planner's
    parts at its peak moment, the predicted peak marked; legends outside the axes."""
    pipelined = any(c["bubble"] is not None or (c["prediction"] or {}).get("bubble_share_of_step")
                    for c in ok)
    fig, axes = plt.subplots(3 if pipelined else 2, 1,
                             figsize=(max(6, 1.4 * len(ok)) + 3, 10 if pipelined else 7.5))
    throughput, memory = axes[0], axes[1]
    x = list(range(len(ok)))
    bars = throughput.bar(x, [b.tokens_per_s for b in data.throughput], color="#4c72b0")
    throughput.bar_label(bars, labels=[f"MFU {b.mfu}" for b in data.throughput], padding=2,
                         fontsize=8)
    throughput.set_ylim(0, 1.12 * max(b.tokens_per_s for b in data.throughput))
    throughput.set_ylabel("tokens/s")
    throughput.set_title(f"{study}: throughput (MFU on each bar)")
    width = 0.4
    memory.bar([i - width / 2 for i in x], [b.measured for b in data.memory], width,
               label=f"measured peak ({data.memory_source})", color="#55a868")
    drawn: set[str] = set()
    for i, bar in zip(x, data.memory):
        bottom = 0.0
        for part, height in bar.stack:
            if height <= 0:
                continue
            memory.bar(i + width / 2, height, width, bottom=bottom, color=PART_COLORS[part],
                       label=None if part in drawn else f"predicted: {part}")
            drawn.add(part)
            bottom += height
        if bar.predicted_peak is None:
            continue
        memory.hlines(bar.predicted_peak, i, i + width, colors="black", linewidth=2,
                      label=None if "peak" in drawn else "predicted peak", gid="predicted peak")
        drawn.add("peak")
        memory.annotate(f"{bar.predicted_peak:.2f}\n({bar.moment})", (i + width / 2, bar.predicted_peak),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=7)
        if bar.other_moment:
            memory.hlines(bar.other_moment[1], i, i + width, colors="black", linestyles="dashed",
                          linewidth=1, label=None if "other" in drawn else "predicted, other moment")
            drawn.add("other")
    memory.set_ylabel("GiB per GPU")
    memory.set_title("memory: measured peak | predicted parts at the predicted peak's moment")
    memory.set_ylim(0, 1.15 * max([b.measured for b in data.memory]
                                  + [b.predicted_peak or 0 for b in data.memory]))
    memory.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if pipelined:  # no bubble panel for studies without pipeline cells
        bubble = axes[2]
        bubble.bar([i - width / 2 for i in x], [c["bubble"] or 0 for c in ok], width, label="measured",
                   color="#8172b2")
        bubble.bar([i + width / 2 for i in x],
                   [(c["prediction"] or {}).get("bubble_share_of_step", 0) for c in ok],
                   width, label="theoretical (p-1)/(vm+p-1)", color="#ccb974")
        bubble.set_ylabel("bubble share of step")
        bubble.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for axis in axes:
        axis.set_xticks(x)
        axis.set_xticklabels([b.label for b in data.throughput], rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    return fig


# One colour per phase, the same in every report.
PHASE_COLORS = {"data": "#8c8c8c", "forward": "#4c72b0", "backward": "#dd8452",
                "recompute": "#da8bc3", "experts": "#64b5cd", "optimizer": "#55a868",
                "dp_comm": "#c44e52", "pipeline_wait": "#8172b2", "guard": "#937860",
                "other": "#ccb974"}


def _breakdown_plot(study: str, ok: list[dict], labels: list[str], out_dir: Path, plt) -> list[Path]:
    """A stacked bar per cell: its median ms per phase."""
    cells = [(c, label) for c, label in zip(ok, labels) if c.get("breakdown_s")]
    if not cells:
        return []
    fig, axis = plt.subplots(figsize=(max(6, 1.2 * len(cells)), 5))
    x = list(range(len(cells)))
    bottom = [0.0] * len(cells)
    for phase in PHASES:
        # .get: cells stored before a phase existed (experts) lack it
        heights = [c["breakdown_s"].get(phase, 0.0) * 1e3 for c, _ in cells]
        axis.bar(x, heights, bottom=bottom, color=PHASE_COLORS[phase], label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axis.set_ylabel("ms per step (median of each phase)")
    axis.set_title(f"{study}: where the step goes")
    axis.set_xticks(x)
    axis.set_xticklabels([label for _, label in cells], rotation=20, ha="right", fontsize=8)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = out_dir / f"{study}-breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
