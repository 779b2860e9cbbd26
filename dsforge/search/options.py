"""`dsforge plan --search`'s options, beside the search (click only: `dsforge` imports this
module for every command, the search itself only when it runs)."""

from __future__ import annotations

from pathlib import Path

import click

SEARCH_OPTIONS = (
    click.option("--search", is_flag=True,
                 help="Search every layout for RECIPE's model (or a preset name given instead)."),
    click.option("--gpus", type=click.IntRange(min=1), help="--search: GPUs to lay the model out on."),
    click.option("--gpus-per-node", type=click.IntRange(min=1), help="--search: GPUs per node [8]."),
    click.option("--gpu", help="--search: GPU type, e.g. h100, h200, a100 [h100]."),
    click.option("--global-batch-tokens", type=click.IntRange(min=1),
                 help="--search: tokens per optimizer step [the recipe's, else 1048576]."),
    click.option("--seq-len", type=click.IntRange(min=1), help="--search: sequence length [4096]."),
    click.option("--top", type=click.IntRange(min=1), default=5, show_default=True,
                 help="--search: how many layouts to show."),
    click.option("--write", type=click.Path(dir_okay=False, path_type=Path),
                 help="--search: write the best layout as a recipe here."),
    click.option("--html", type=click.Path(dir_okay=False, path_type=Path),
                 help="--search: write the explorer page (one self-contained file) here."),
    click.option("--profile", type=click.Path(dir_okay=False, path_type=Path),
                 help="--search: cluster profile YAML (bandwidths, efficiency, memory margin)."),
    click.option("--memory-headroom", type=float,
                 help="--search: share of GPU memory kept free for allocator fragmentation and what the "
                      "memory model does not count, a fraction in [0, 1) [0.1; the profile's memory_margin]."),
    click.option("--measure", is_flag=True,
                 help="--search: run short trials of the top layouts here and re-rank by measurement."),
    click.option("--measure-out", type=click.Path(file_okay=False, path_type=Path),
                 help="--measure: where the trials and results.db go [runs/search-MODEL-TIME]."),
)


def search_options(command):
    """The --search options, in the order `dsforge plan --help` lists them."""
    for option in reversed(SEARCH_OPTIONS):
        command = option(command)
    return command
