#!/usr/bin/env python3
"""Throughput of `dsforge data prepare` on data/tempest.txt made larger (benchmarks/data/README.md).

    python benchmarks/data/bench_prepare.py [--copies 150] [--workers 1 2] [--work DIR]

Makes in DIR (a temporary folder unless given):
- tempest.jsonl: the play's paragraphs (split at blank lines), one JSON document each, the
  whole play repeated --copies times;
- tempest.txt: the play repeated --copies times, one plain text document;
- bpe/tokenizer.json: a byte-level BPE (vocabulary 4096) trained on data/tempest.txt;
then runs, for each corpus, tokenizer ('bytes' and the BPE) and worker count,
    dsforge data prepare CORPUS --tokenizer T --output OUT --workers N --no-progress
and records the command's wall time (the megatron.core import included), the MB/s of input
and tokens/s it reports (reading, tokenizing and writing only), the CPU seconds it used
(workers included) and the cores other processes used meanwhile (from /proc/stat): on a
shared machine a run during which others used more than --quiet cores is taken again, up to
--tries times. Prints a markdown table and writes results.json beside this script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPEST = REPO / "data" / "tempest.txt"
SUMMARY = re.compile(r"([\d,]+) documents .*?, ([\d,]+) tokens .*?([\d.,]+) MB in ([\d.]+) s: "
                     r"([\d.,]+) MB/s, ([\d,]+) tokens/s")


def make_corpora(work: Path, copies: int) -> dict[str, Path]:
    play = TEMPEST.read_text()
    paragraphs = [p for p in play.split("\n\n") if p.strip()]
    jsonl, text = work / "tempest.jsonl", work / "tempest.txt"
    with jsonl.open("w") as f:
        for _ in range(copies):
            f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs)
    with text.open("w") as f:
        for _ in range(copies):
            f.write(play)
    return {"jsonl (paragraph documents)": jsonl, "txt (one document)": text}


def train_bpe(work: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(TEMPEST)], trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = work / "bpe" / "tokenizer.json"
    path.parent.mkdir(exist_ok=True)
    tokenizer.save(str(path))
    return path


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, everyone's)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command and its reaped workers
    return usage.ru_utime + usage.ru_stime


def run(corpus: Path, tokenizer: str, workers: int, out: Path, tries: int, quiet: float) -> dict:
    """The command's figures, taken again (up to `tries` times) while other processes on this
    shared machine used more than `quiet` of a core during it; the least disturbed try."""
    rows = []
    for attempt in range(1, tries + 1):
        wait_for_quiet(quiet)
        rows.append(dict(run_once(corpus, tokenizer, workers, out), attempt=attempt))
        if rows[-1]["others_cores"] <= quiet:
            break
    return min(rows, key=lambda row: row["others_cores"])


def wait_for_quiet(quiet: float, longest: float = 120.0) -> None:
    """Until other processes have used at most `quiet` cores for 5 s (or `longest` seconds)."""
    deadline = time.monotonic() + longest
    while time.monotonic() < deadline:
        busy = busy_cpu_seconds()
        time.sleep(5)
        if (busy_cpu_seconds() - busy) / 5 <= quiet:
            return


def run_once(corpus: Path, tokenizer: str, workers: int, out: Path) -> dict:
    command = ["dsforge", "data", "prepare", str(corpus), "--tokenizer", tokenizer, "--output",
               str(out), "--workers", str(workers), "--no-progress", "--overwrite"]
    busy, own, started = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dsforge", *command[1:]], cwd=REPO,
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    own = own_cpu_seconds() - own
    others = max(0.0, busy_cpu_seconds() - busy - own)
    documents, tokens, mb, seconds, mb_s, tokens_s = SUMMARY.search(done.stdout).groups()
    number = lambda text: float(text.replace(",", ""))  # noqa: E731
    return {"command": " ".join(command), "workers": workers, "documents": int(number(documents)),
            "tokens": int(number(tokens)), "input_mb": number(mb), "seconds": number(seconds),
            "mb_per_s": number(mb_s), "tokens_per_s": number(tokens_s), "wall_s": round(wall, 2),
            "cpu_s": round(own, 2), "others_cores": round(others / wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=150)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--tries", type=int, default=5,
                        help="Runs of one configuration while the machine is not quiet.")
    parser.add_argument("--quiet", type=float, default=0.15,
                        help="Most cores other processes may use during a counted run.")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dsforge-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    corpora = make_corpora(work, args.copies)
    tokenizers = {"bytes": "bytes", "BPE 4096": str(train_bpe(work))}
    rows = []
    for corpus_name, corpus in corpora.items():
        for tokenizer_name, tokenizer in tokenizers.items():
            for workers in args.workers:
                row = run(corpus, tokenizer, workers, work / "out" / "prepared", args.tries,
                          args.quiet)
                row.update(corpus=corpus_name, tokenizer=tokenizer_name)
                rows.append(row)
                write_results(args, work, rows)  # after every row: a stopped run keeps its rows
                print(f"| {corpus_name} | {tokenizer_name} | {workers} | {row['input_mb']:.1f} | "
                      f"{row['tokens']:,} | {row['seconds']:.2f} | {row['mb_per_s']:.2f} | "
                      f"{row['tokens_per_s']:,.0f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
                      f"{row['others_cores']:.2f} |", flush=True)


def write_results(args, work: Path, rows: list[dict]) -> None:
    machine = {"python": platform.python_version(), "cpus": _cpus(), "platform": platform.platform()}
    results = {"copies": args.copies, "quiet": args.quiet, "machine": machine, "work": str(work),
               "runs": rows}
    (Path(__file__).parent / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    main()
