"""Score dsforge's step-time model against published training measurements
(tools/published_runs.py) and write benchmarks/search/published.md.

    python tools/published_compare.py --out benchmarks/search/published.md              # "after"
    python tools/published_compare.py --label before --stats-only --out benchmarks/search/published.md

Each run writes one labelled section of the file and keeps the others, so the "before"
figures (computed in a worktree of an older commit, see benchmarks/search/published.md) and
the current ones live side by side.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

# Beside this file: python puts its folder on sys.path.
from published_refit import MIN_MODELS, GroupFit, Refitted, group_fits, refit_all
from published_runs import (ROWS, Choice, ScaleOut, Scored, Stats, first_choices, fit_rejections,
                            scale_out_pairs, score_all, statistics_table)

from dsforge.hardware import gpu_by_key
from dsforge.units import GiB

HEADER = """# dsforge's predicted MFU against published measurements

Written by `tools/published_compare.py` (data and scoring: tools/published_runs.py):

```bash
python tools/published_compare.py --out benchmarks/search/published.md            # section "after"
# "before": written once, by the scoring of b8eacba (2026-11-22; its data and scoring lived in
# dsforge/search/published.py) in a worktree of the baseline commit (from the repository root)
git worktree add ../dsforge-before 5b31f63e76a8e04a20ac8bfc955a64aaa49b3298
git show b8eacba:dsforge/search/published.py > ../dsforge-before/dsforge/search/published.py
git show b8eacba:tools/published_compare.py > ../dsforge-before/tools/published_compare.py
(cd ../dsforge-before && PYTHONPATH=. python tools/published_compare.py \\
    --label before --stats-only --out "$OLDPWD/benchmarks/search/published.md")
git worktree remove --force ../dsforge-before
```

The "before" section keeps that day's data and scoring (today's tools import modules the
baseline lacks); both changed since (`git log --follow tools/published_runs.py`). Among the
changes: torchtitan's per-op selective checkpointing is charged the matmuls it recomputes
(`per_op_sac_flops`), which the "before" figures do not count.

Each row is a published run with its full layout (source file and commit in
tools/published_runs.py). dsforge builds the recipe of exactly that layout, validates it
as `dsforge run` would, and predicts its MFU (`search.evaluate`, the GPU's default profile).
"Measured" is the published tokens/s turned into MFU with dsforge's own FLOPs formula
(docs/flops.md: 6N + 12 L s h, causal mask not halved) and BF16 peak (A100 312, H100/H200 989
TFLOP/s), so both columns share a numerator; the source's own figure is in "published".
Error = predicted - measured, in MFU points. Spearman = rank correlation of predicted and
measured within the group. "fits" is dsforge's memory model on the scored layout against the
GPU's memory less the search's default headroom (10%). Every row trained, so a "no" is either
the headroom at work (the estimate fits the GPU: the run used more of it than the search
leaves itself) or an estimate above the whole GPU: an error of the memory model unless the
row names why the source's engine needs less than dsforge's ("over GPU": such rows, and in
brackets the ones nothing explains).

Caveats: the sources run other software (PyTorch FSDP with torch.compile, Transformer Engine,
communication overlap, async TP, Composer) and MPT/GPT models are GPT-style (GELU MLP of 4h,
written as a SwiGLU of equal weight). The comparison calibrates orders and magnitudes, not
identity. Rows dsforge cannot score (FP8, context parallelism) stay in the table, marked.
"""


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def stats_lines(stats: list[Stats]) -> list[str]:
    lines = ["| source | rows | scored | median abs error | worst abs error | mean error | Spearman | "
             "fit rejects | over GPU (unexplained) | median rel error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in stats:
        lines.append(f"| {s.group} | {s.rows} | {s.scored} | {_num(s.median_abs_error)} | "
                     f"{_num(s.worst_abs_error)} | {_num(s.mean_error, 1)} | {_num(s.spearman, 2)} | "
                     f"{s.rejected_by_fit} | {s.over_gpu} ({s.over_gpu_unexplained}) | "
                     f"{_pct(s.median_relative_error)}% |")
    return lines


def _fits(s: Scored) -> str:
    if s.fits is None:
        return "-"
    return f"{'yes' if s.fits else 'NO'} ({s.memory_gib:.0f}/{s.usable_gib:.0f} GiB)"


def _published_note(s: Scored) -> str:
    p = s.row.published_mfu
    if p is None:
        return "-"
    flag = " (differs)" if abs(p - s.measured) > 0.005 else ""
    return f"{_pct(p)}{flag}"


def _refit_cell(r: Refitted) -> str:
    if not r.refitted:
        return "-"
    return f"{_pct(r.scored.predicted)} ({100 * r.scored.error:+.1f})"


def row_lines(scored: list[Scored], refits: list[Refitted]) -> list[str]:
    header = ("| source | run | model | GPUs | layout | published MFU | measured MFU | predicted MFU | "
              "error | refitted (error) | fits? | notes |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, refit in zip(scored, refits):
        r = s.row
        error = "-" if s.error is None else f"{100 * s.error:+.1f}"
        notes = "; ".join(filter(None, [f"scored as {s.scored_as}" if s.scored_as else "",
                                        f"NOT SCORED: {s.reason}" if s.reason else "", r.note]))
        lines.append(f"| {r.source} | {r.label} | {r.model.describe()} s{r.seq_len} | {r.gpus} {r.gpu.upper()} | "
                     f"{r.layout()} | {_published_note(s)} | {_pct(s.measured)} | {_pct(s.predicted)} | "
                     f"{error} | {_refit_cell(refit)} | {_fits(s)} | {notes} |")
    return lines


def _group_fit_line(g: GroupFit) -> str:
    c, after = g.coefficients, g.after
    communication = "hidden (0)" if c["communication"] < 1e-3 else f"x{c['communication']:.2f}"
    return (f"| {g.source} | {g.gpu.upper()} | {g.models} | {g.runs} | {after.compute_efficiency:.3f} | "
            f"{after.attention_efficiency:.3f} | {c['other']:.3g} | {c['fixed'] * 1e3:.3g} | "
            f"{communication} |")


def refit_lines(refits: list[Refitted], fits: list[GroupFit]) -> list[str]:
    """The runs predicted after a refit on their engine's other models: the statistics, then
    what each group's refit on all its runs finds."""
    lines = stats_lines(statistics_table([r.scored for r in refits]))
    kept = [r.scored for r in refits if r.scored.predicted is not None and not r.refitted]
    models: dict[str, set[str]] = {}
    for s in kept:
        models.setdefault(f"{s.row.source} on {s.row.gpu.upper()}", set()).add(s.row.model.name)
    groups = "; ".join(f"{group}: {len(names)}" for group, names in models.items())
    lines += ["", f"{len(kept)} scored runs are in groups of fewer than {MIN_MODELS} models and "
              f"keep the default profile's prediction (models: {groups or 'none'}).", "",
              "Each group refitted on all its runs (the engine on that GPU as dsforge's terms "
              "see it; the default profiles' figures are the GPUs' defaults above):", "",
              "| source | GPU | models | runs | compute_efficiency | attention_efficiency | "
              "other s a token, layer and hidden unit | fixed ms a microbatch and layer | "
              "communication |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [_group_fit_line(g) for g in fits]
    choices = first_choices([r.scored for r in refits])
    if choices:
        regrets = [c.regret for c in choices]
        lines += ["", f"First choices with the refitted predictions: {len(choices)} scenarios, median "
                  f"regret {statistics.median(regrets):.1f}, worst {max(regrets):.1f} MFU points."]
    return lines


def _rejection(s: Scored) -> str:
    r = s.row
    gpu = gpu_by_key(r.gpu).memory_bytes / GiB
    why = f": {r.memory_note}" if s.over_gpu and r.memory_note else ""
    return (f"- {r.source}: {r.label} ({r.model.describe()}, seq {r.seq_len}, {r.gpus} {r.gpu.upper()}, "
            f"{r.layout()}): {s.memory_gib:.1f} GiB of {gpu:.1f} ({s.usable_gib:.1f} usable){why}")


def rejection_lines(scored: list[Scored]) -> list[str]:
    rejected = fit_rejections(scored)
    over = [s for s in rejected if s.over_gpu]
    inside = [s for s in rejected if not s.over_gpu]
    return [f"Estimated above the GPU's memory ({len(over)}):", "", *(map(_rejection, over) if over else ["None."]),
            "", f"Inside the GPU's memory, over the headroom ({len(inside)}):", "",
            *(map(_rejection, inside) if inside else ["None."])]


def choice_lines(choices: list[Choice]) -> list[str]:
    """The planner's pick among each scenario's published layouts against the best measured:
    the regret per source (median over its scenarios), then each scenario."""
    by_source: dict[str, list[Choice]] = {}
    for c in choices:
        by_source.setdefault(c.source, []).append(c)
    lines = ["| source | scenarios | median regret | worst regret | picked the best |",
             "|---|---|---|---|---|"]
    for source, group in [*by_source.items(), ("all", choices)]:
        regrets = [c.regret for c in group]
        lines.append(f"| {source} | {len(group)} | {statistics.median(regrets):.1f} | "
                     f"{max(regrets):.1f} | {sum(r < 0.05 for r in regrets)} |")
    lines += ["", "| source | scenario | layouts | dsforge's pick (predicted / measured MFU) | "
              "best measured | regret |", "|---|---|---|---|---|---|"]
    for c in choices:
        lines.append(f"| {c.source} | {c.scenario} | {c.layouts} | {c.pick.row.label}: "
                     f"{_pct(c.pick.predicted)} / {_pct(c.pick.measured)} | {c.best.row.label}: "
                     f"{_pct(c.best.measured)} | {c.regret:.1f} |")
    return lines


def scale_out_lines(pairs: list[ScaleOut]) -> list[str]:
    """Each run on one node and on several: the share of its MFU it kept, measured and
    predicted, and the mean gap."""
    if not pairs:
        return ["None."]
    gaps = [abs(p.predicted_ratio - p.measured_ratio) for p in pairs]
    lines = [f"{len(pairs)} pairs: mean |predicted - measured share kept| {statistics.fmean(gaps):.3f}, "
             f"largest {max(gaps):.3f}.", "",
             "| source | run | measured: share kept | predicted: share kept |", "|---|---|---|---|"]
    lines += [f"| {p.source} | {p.run} | {p.measured_ratio:.3f} | {p.predicted_ratio:.3f} |"
              for p in pairs]
    return lines


def _code_version() -> str:
    """The commit the scoring ran on, and whether the tree had local changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  cwd=Path(__file__).resolve().parent).stdout.rstrip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return head + (f" with local changes to {', '.join(changed)}" if changed else "")


def section(label: str, stats_only: bool) -> str:
    scored = score_all(ROWS)
    stats = statistics_table(scored)
    parts = [f"## {label}", "", f"dsforge at {_code_version()}.", "", *stats_lines(stats), "",
             "Error in MFU points (predicted - measured); mean error > 0: dsforge over-predicts. "
             "Rel error = median |predicted / measured - 1| of the throughput; the one of \"all\" is the "
             "band `dsforge plan --search` puts on each predicted step time (docs/search.md).", ""]
    parts += [f"Published layouts the memory fit rejects ({len(fit_rejections(scored))}):", "",
              *rejection_lines(scored), ""]
    parts += ["### First choices among the published layouts", "",
              "A scenario is one source's runs of one model, sequence length, GPU type and count "
              "that measured two or more different layouts (runs that differ only in what dsforge "
              "does not model, such as torch.compile, float8 or async TP, are one layout). "
              "dsforge's pick is the one it predicts fastest. Regret = the best measured MFU of "
              "the scenario less the pick's, in MFU points.", "",
              *choice_lines(first_choices(scored)), ""]
    parts += ["### Scaling out across nodes", "",
              "Each run measured on one node and again on several with the same per-GPU layout: "
              "the share of its one-node MFU it kept, measured and predicted. The inter-node "
              "bandwidth model decides the prediction (docs/search.md, \"The step-time model\").",
              "", *scale_out_lines(scale_out_pairs(scored)), ""]
    refits = refit_all(scored)
    parts += ["### Refitted on each engine's other models", "",
              "The loop `dsforge plan --search --measure` runs (predict, measure, refit, predict "
              "again) with the published runs as the measured ones: the runs are grouped by "
              "source and GPU type (one engine on one GPU), and each run is predicted by "
              "`dsforge.cost.fit.fit` refitted on its group's runs of other models "
              "(leave one model out), from the GPU's default profile with the attention at a "
              "rate of its own (tools/published_refit.py). Nothing of the row predicted enters "
              "its refit.", "", *refit_lines(refits, group_fits(scored)), ""]
    if not stats_only:
        parts += ["### Every row", "", *row_lines(scored, refits), ""]
    return "\n".join(parts)


def merge(existing: str, label: str, body: str) -> str:
    """The file with this label's section replaced (or added); other sections kept, in label order."""
    pattern = re.compile(r"<!-- section:(\S+) -->\n(.*?)<!-- /section:\1 -->\n", re.DOTALL)
    sections = {m.group(1): m.group(2) for m in pattern.finditer(existing)}
    sections[label] = body + "\n"
    order = sorted(sections, key=lambda name: (name != "before", name != "after", name))
    blocks = [f"<!-- section:{name} -->\n{sections[name]}<!-- /section:{name} -->\n" for name in order]
    return HEADER + "\n" + "\n".join(blocks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="markdown file to write this section into")
    parser.add_argument("--label", default="after", help="section name (default: after)")
    parser.add_argument("--stats-only", action="store_true", help="statistics and fit rejections, no row table")
    args = parser.parse_args(argv)
    body = section(args.label, args.stats_only)
    sys.stdout.write(body + "\n")
    if args.out:
        existing = args.out.read_text() if args.out.exists() else ""
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(merge(existing, args.label, body))


if __name__ == "__main__":
    main()
