"""Compare `dsforge plan --search` with published best layouts (../shared/reference/
performance-anchors.md) and write the table committed as benchmarks/search/anchors.md.

For each published scenario: the published layouts in the order of their measured MFU, the
rank and predicted MFU dsforge gives the same parallel shape (the fastest fitting candidate
with that tp/pp/dp/ZeRO, other knobs free), and dsforge's own first choice.

    python tools/search_anchors.py --out benchmarks/search/anchors.md
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from dsforge.cost.profile import default_profile
from dsforge.recipe.loader import build_recipe
from dsforge.search.search import Ranked, SearchResult, search
from dsforge.search.space import MICRO_BATCHES, Space


@dataclass(frozen=True)
class Published:
    name: str  # as the source writes it
    tp: int
    pp: int
    dp: int
    zero: int | None  # FSDP full shard = ZeRO-3; None = not stated (any stage)
    mfu: float | None
    source: str
    microbatches: int | None = None  # when the source fixed it (else the target batch decides)
    vpp: int | None = None  # None: any schedule dsforge finds best


@dataclass(frozen=True)
class Scenario:
    model: str
    gpus: int
    gpu: str
    seq_len: int
    global_batch: int  # sequences
    layouts: tuple[Published, ...]  # best measured first


KF = "KempnerForge benchmarks"
SCENARIOS = (
    Scenario("llama3-8b", 4, "h200", 4096, 64, (
        Published("FSDP=4", 1, 1, 4, 3, 0.538, KF),
        Published("TP=4", 4, 1, 1, None, 0.347, KF))),
    Scenario("llama2-13b", 8, "h200", 4096, 64, (
        Published("FSDP=8", 1, 1, 8, 3, 0.444, KF),)),
    Scenario("llama2-13b", 32, "h200", 4096, 128, (
        Published("TP4 x FSDP8", 4, 1, 8, 3, 0.327, KF),
        Published("TP4 PP2 FSDP4", 4, 2, 4, None, 0.165, KF + " (config_validation), 1F1B assumed", 4, 1))),
    Scenario("llama3-70b", 32, "h200", 4096, 128, (
        Published("TP4 x FSDP8", 4, 1, 8, 3, 0.254, KF),
        Published("TP4 PP4 FSDP2", 4, 4, 2, None, 0.110, KF + " (config_validation), 1F1B assumed", 4, 1))),
    Scenario("llama3-8b", 8, "h100", 4096, 64, (
        Published("DP2 PP4 ZeRO-1", 1, 4, 2, 1, 0.452, "Ultra-Scale Playbook (stated MFU)"),)),
    Scenario("mixtral-8x7b", 32, "h100", 4096, 128, ()),
)


def _base(s: Scenario):
    return build_recipe({"name": "anchor", "model": {"preset": s.model},
                         "train": {"seq_len": s.seq_len, "steps": 100, "lr": 3e-4, "precision": "bf16"}})


def run_scenario(s: Scenario, global_batch: int | None = None) -> SearchResult:
    space = Space(gpus=s.gpus, gpus_per_node=8, global_batch=global_batch or s.global_batch, gpu=s.gpu)
    return search(_base(s), space, default_profile(s.gpu))


def _matches(r: Ranked, p: Published) -> bool:
    lay = r.resolved.layout
    return ((lay.tp, lay.pp, lay.dp) == (p.tp, p.pp, p.dp) and p.zero in (None, r.resolved.recipe.zero.stage)
            and p.microbatches in (None, lay.grad_accum) and p.vpp in (None, lay.vpp))


def best_with_shape(s: Scenario, result: SearchResult, p: Published) -> tuple[int | None, Ranked] | None:
    """(1-based rank in the search's order, candidate) of the fastest fitting candidate with
    the published shape.

    With a published microbatch count the shape is searched at the global batch that gives
    it (its rank is then not comparable with the scenario's list: None)."""
    if p.microbatches is not None:
        for micro in MICRO_BATCHES:
            other = run_scenario(s, global_batch=p.dp * p.microbatches * micro)
            found = [r for r in other.ranked if _matches(r, p)]
            if found:
                return None, min(found, key=lambda r: r.time.total)
        return None
    # The fastest match, not the first listed: ties put a simpler layout of the same shape
    # (e.g. vpp 1 when the source leaves vpp open) above faster ones.
    found = [(index + 1, r) for index, r in enumerate(result.ranked) if _matches(r, p)]
    return min(found, key=lambda pair: pair[1].time.total) if found else None


def table() -> str:
    lines = ["| scenario | published layout | published MFU | dsforge rank of that shape | "
             "predicted MFU | dsforge's first choice | predicted MFU |", "|---|---|---|---|---|---|---|"]
    for s in SCENARIOS:
        result = run_scenario(s)
        title = f"{s.model} on {s.gpus} {s.gpu.upper()}, batch {s.global_batch}x{s.seq_len}"
        top = result.ranked[0]
        first = f"{top.shape()} | {top.mfu:.1%}"
        for p in s.layouts or (None,):
            if p is None:
                lines.append(f"| {title} | (no published layout comparison) | | | | {first} |")
                continue
            found = best_with_shape(s, result, p)
            mfu = f"{p.mfu:.1%}" if p.mfu is not None else "-"
            if found is None:
                where = "not among the fitting, valid layouts | -"
            elif found[0] is None:
                where = (f"with its {p.microbatches} microbatches: {found[1].shape()}, step "
                         f"{found[1].time.total:.1f} s | {found[1].mfu:.1%}")
            else:
                where = f"{found[0]} of {len(result.ranked)} ({found[1].shape()}) | {found[1].mfu:.1%}"
            lines.append(f"| {title} | {p.name} ({p.source}) | {mfu} | {where} | {first} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = table()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
