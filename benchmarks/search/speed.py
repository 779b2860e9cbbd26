#!/usr/bin/env python3
"""How long `dsforge plan --search` takes, search by search (benchmarks/search/README.md, "Speed").

    python benchmarks/search/speed.py [--repeats 3] [--only TEXT] [--markdown]

Runs each search of SEARCHES as its own `dsforge plan --search ... --json` process (a fresh
process each time, so no cache of an earlier run helps a later one), --repeats times, and
prints the median of the command's `seconds` field (enumeration, validation, memory and
step-time estimates, ranking; not the import of the stack), the counts, and the command.
The searches: the README's, `mpt-70b` (benchmarks/search/mpt-70b.yaml) at LLM-Foundry's
published H100 scenarios, and the scenarios of tools/search_anchors.py, 21 in all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MPT_70B = "benchmarks/search/mpt-70b.yaml"
SEQ_2048 = 2048


def _mpt(gpus: int, sequences: int) -> str:
    return f"{MPT_70B} --gpus {gpus} --gpu h100 --global-batch-tokens {sequences * SEQ_2048}"


def _anchor(model: str, gpus: int, gpu: str, sequences: int) -> str:
    # tools/search_anchors.py: 8 GPUs per node, sequences of 4096 tokens
    return (f"{model} --gpus {gpus} --gpus-per-node 8 --gpu {gpu} --seq-len 4096 "
            f"--global-batch-tokens {sequences * 4096}")


SEARCHES = (
    *(f"llama3-70b --gpus {n} --gpus-per-node 8 --gpu h100" for n in (8, 64, 512, 6144, 16384)),
    "llama2-7b --gpus 8",
    "llama3-70b --gpus 32 --gpu h200",
    "llama3-70b --gpus 128 --gpu h100",
    "mixtral-8x7b --gpus 64",
    "mixtral-8x7b --gpus 256",
    # LLM-Foundry's H100 rows of MPT-70B: (GPUs, global batch in sequences)
    *(_mpt(gpus, batch) for gpus, batch in ((512, 4096), (256, 2048), (128, 1024), (64, 2048), (32, 1024))),
    _anchor("llama3-8b", 4, "h200", 64),
    _anchor("llama2-13b", 8, "h200", 64),
    _anchor("llama2-13b", 32, "h200", 128),
    _anchor("llama3-70b", 32, "h200", 128),
    _anchor("llama3-8b", 8, "h100", 64),
    _anchor("mixtral-8x7b", 32, "h100", 128),
    # Long sequences, where the search has a cp axis (space.CP_MIN_SEQ_LEN)
    "recipes/8b_32k_cp4.yaml",
    "recipes/8b_32k_cp4.yaml --gpus 64 --global-batch-tokens 4194304",
    "mixtral-8x7b --gpus 64 --seq-len 32768 --global-batch-tokens 4194304",
)


def run_once(search: str) -> dict:
    """One search in a fresh process: its --json output."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "dsforge", "plan", "--search", *search.split(), "--json"],
                         cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def measure(search: str, repeats: int) -> tuple[dict, float]:
    """The counts and the median of the searches' own `seconds`."""
    runs = [run_once(search) for _ in range(repeats)]
    return runs[0]["counts"], statistics.median(r["seconds"] for r in runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="run the searches whose command contains this")
    args = parser.parse_args(argv)
    print("| search (`dsforge plan --search ...`) | considered | valid | fit | ranked | seconds |")
    print("|---|---|---|---|---|---|")
    for search in SEARCHES:
        if args.only not in search:
            continue
        counts, seconds = measure(search, args.repeats)
        print(f"| `{search}` | {counts['considered']:,} | {counts['valid']:,} | {counts['fit']:,} | "
              f"{counts['ranked']:,} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
