#!/usr/bin/env python3
"""Opening a 10 GiB Megatron indexed dataset: start-up time, resident memory and what is read
(benchmarks/data/README.md, "Opening a 10 GB dataset").

    python benchmarks/data/bench_open.py [--gib 10] [--doc-tokens 2048] [--steps 1000] [--work DIR]

Makes in DIR (a temporary folder unless given; the files are removed at the end, also on
Ctrl-C/SIGTERM) a dataset `big` of --gib GiB of uint16 tokens without writing them:
- big.bin: a sparse file (truncate to the size: no block allocated, reads of it are zeros);
- big.idx: the index of documents of --doc-tokens tokens each (10 GiB / 2048 -> 2,621,440
  documents), written by Megatron-Core's own index writer (indexed_dataset._IndexWriter);
- big.tokenizer.json: dsforge's record (bytes tokenizer identity, the counts), as
  `dsforge data prepare --tokenizer bytes` writes it.
Then, each in a fresh Python process, for `big` and, for reference, the shipped data/tempest
(784 documents, 195 KB: what importing and starting cost by themselves):
  open      dsforge.data.indexed.open_dataset(PREFIX) (its megatron.core import timed apart);
  validate  dsforge validate recipes/smoke.yaml --set data.source=PREFIX --set model.vocab_size=257
  build     dsforge.data.samples.build_splits for recipes/smoke.yaml with train.steps=--steps
            (16 x 128-token samples a step, split 90,5,5), twice on the same cache directory:
            the first builds the indices (cache miss), the second memory-maps them (hit);
            then reads 48 training samples (3 steps) with the .bin out of the page cache, as
            Megatron-Core maps it and with madvise(MADV_RANDOM) on its mapping;
and reports for each: wall time of the process and of the operation, peak RSS (ru_maxrss),
the process's CPU seconds, bytes read from disk by the operation (/proc/self/io read_bytes,
before/after) and by the whole process (ru_inblock), and the part of big.bin resident in the
page cache afterwards (mincore). Before every process the page cache is emptied of the
dataset's and the index cache's files (posix_fadvise DONTNEED), so each starts cold.

A sparse file has no blocks, so reading it costs no disk I/O and read_bytes cannot show a full
read of big.bin: the page-cache residency of big.bin (pages some process touched, holes
included) and the peak RSS can; read_bytes shows the .idx and the cache files being read.
Then (--dense-mib, 0: skip) the same 48 cold sample reads on a small dataset whose .bin is
really written (token ids 0..255 repeated), where they show as read_bytes.
Prints the figures and writes results_open.json beside this script.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from common import ENV, RECIPE, REPO, TEMPEST, loadavg  # noqa: E402 (beside this script)
CHILD_LIMIT_S = 1800
GIB = 1 << 30
MB = 1e6


# --------------------------------------------------------------------------- in a child process

def proc_io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {key: int(fields[key]) for key in ("rchar", "read_bytes")}


def io_delta(before: dict[str, int]) -> dict[str, int]:
    after = proc_io()
    return {key: after[key] - before[key] for key in before}


def child_make(prefix: Path, documents: int, doc_tokens: int) -> dict:
    import numpy as np

    from dsforge.data.identity import write_record
    from dsforge.data.indexed import megatron_indexed_dataset
    from dsforge.data.tokenizers import load_tokenizer

    module = megatron_indexed_dataset()
    started = time.perf_counter()
    tokens = documents * doc_tokens
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(tokens * 2)  # uint16: a hole, no block written
    lengths = np.full(documents, doc_tokens, dtype=np.int32)
    with module._IndexWriter(f"{prefix}.idx", np.uint16) as writer:
        writer.write(lengths, None, np.arange(documents + 1, dtype=np.int64))
    identity = load_tokenizer("bytes").identity
    write_record(prefix, identity, {"documents": documents, "sequences": documents,
                                    "tokens": tokens, "dtype": "uint16", "append_eod": False,
                                    "synthetic": "sparse .bin of zeros (bench_open.py)"})
    return {"make_s": time.perf_counter() - started}


def child_open(prefix: Path) -> dict:
    from dsforge.data.indexed import megatron_indexed_dataset, open_dataset

    started = time.perf_counter()
    megatron_indexed_dataset()
    imported = time.perf_counter()
    io = proc_io()
    _, info = open_dataset(prefix)
    opened = time.perf_counter()
    return {"import_s": imported - started, "op_s": opened - imported, "op_io": io_delta(io),
            "documents": info.documents, "tokens": info.tokens}


def child_build(prefix: Path, cache: Path, steps: int) -> dict:
    from dsforge.data.indexed import inspect_dataset
    from dsforge.data.samples import build_splits
    from dsforge.recipe import resolve_file

    started = time.perf_counter()
    resolved = resolve_file(RECIPE, [f"data.source={prefix}", "model.vocab_size=257",
                                     f"train.steps={steps}", f"data.cache_dir={cache}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import blended_megatron_dataset_builder, gpt_dataset  # noqa
    ready = time.perf_counter()
    recipe, layout = resolved.recipe, resolved.layout
    train, data = recipe.train, recipe.data
    io = proc_io()
    parts = [(part.path, part.weight) for part in data.blend]
    splits = build_splits(parts, split=data.split, seq_len=train.seq_len, seed=train.seed,
                          train_samples=train.steps * layout.global_batch,
                          validation_samples=train.eval_iters * layout.global_batch,
                          identity=inspect_dataset(parts[0][0]).identity, cache_dir=cache)
    built = time.perf_counter()
    build_io = io_delta(io)
    return {"resolve_and_import_s": ready - started, "op_s": built - ready, "op_io": build_io,
            "bin_resident_after_op_mb": resident_bytes(Path(f"{prefix}.bin")) / MB,
            "train_samples": len(splits.train),
            "validation_samples": len(splits.validation) if splits.validation else 0,
            "reads": sample_reads(splits.train, Path(f"{prefix}.bin"))}


def sample_reads(dataset, bin_path: Path, count: int = 48) -> dict[str, dict]:
    """Read `count` training samples (3 steps of the smoke recipe: 16 a step) with the .bin
    out of the page cache: as Megatron-Core maps it, then with madvise(MADV_RANDOM) on its
    mapping (no read-ahead around each page fault). Each mode reads other samples, so none
    was touched before: what lands in the page cache and what is read from disk per sample."""
    import mmap

    from dsforge.data.samples import MegatronSamples

    source, results = MegatronSamples(dataset, what="training samples"), {}
    for mode, first in (("default", 0), ("MADV_RANDOM", 10_000)):
        if mode == "MADV_RANDOM":
            dataset.dataset.bin_reader._bin_buffer_mmap._mmap.madvise(mmap.MADV_RANDOM)
        evict([bin_path])
        io, started = proc_io(), time.perf_counter()
        for index in range(first, first + count):
            source.sample(index)
        seconds = time.perf_counter() - started
        results[mode] = {"samples": count, "ms": 1e3 * seconds,
                         "read_bytes": io_delta(io)["read_bytes"],
                         "bin_resident_bytes": resident_bytes(bin_path)}
    return results


def child_dense(prefix: Path, documents: int, doc_tokens: int, cache: Path) -> dict:
    """A dataset whose .bin is really on disk (token ids 0..255 repeated): sample reads from
    it show in read_bytes, which a sparse file's cannot."""
    import numpy as np

    from dsforge.data.indexed import inspect_dataset
    from dsforge.data.samples import build_splits

    child_make(prefix, documents, doc_tokens)
    block = (np.arange(1 << 20) % 256).astype(np.uint16).tobytes()
    size = documents * doc_tokens * 2
    with open(f"{prefix}.bin", "r+b") as f:
        for start in range(0, size, len(block)):
            f.write(block[:size - start])
    splits = build_splits([(str(prefix), 1.0)], split="90,5,5", seq_len=128, seed=1234,
                          train_samples=16_000, validation_samples=32,
                          identity=inspect_dataset(prefix).identity, cache_dir=cache)
    return {"bin_mb": size / MB, "reads": sample_reads(splits.train, Path(f"{prefix}.bin"))}


def child_main(argv: list[str]) -> None:
    what, prefix = argv[0], Path(argv[1])
    if what == "make":
        result = child_make(prefix, int(argv[2]), int(argv[3]))
    elif what == "open":
        result = child_open(prefix)
    elif what == "dense":
        result = child_dense(prefix, int(argv[2]), int(argv[3]), Path(argv[4]))
    else:
        result = child_build(prefix, Path(argv[2]), int(argv[3]))
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- in the benchmark

def evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (so the next process reads cold)."""
    for path in paths:
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(path: Path) -> int:
    """How much of `path` is in the page cache now (mincore over a read-only mapping)."""
    import numpy as np

    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = resource.getpagesize()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 0x1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vector = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(address, size, vector):
                raise OSError(ctypes.get_errno(), "mincore failed")
            return int((np.frombuffer(vector, dtype=np.uint8) & 1).sum()) * page
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def run_child(command: list[str], label: str) -> dict:
    """Run `command` in a fresh process: its wall time, rusage (wait4) and RESULT line."""
    with tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=ENV, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   text=True)
        timer = threading.Timer(CHILD_LIMIT_S, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        out.seek(0)
        text = out.read()
    if process.returncode:
        raise SystemExit(f"{label}: {' '.join(command)} failed ({process.returncode}):\n{text}")
    result = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")),
                  {})
    return {**result, "label": label, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss * 1024 / MB,
            "cpu_s": usage.ru_utime + usage.ru_stime, "process_read_mb": usage.ru_inblock * 512 / MB,
            "major_faults": usage.ru_majflt, "output": text.strip().splitlines()[-3:]}


def child(*args: object) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", *map(str, args)]


def dataset_files(prefix: Path) -> list[Path]:
    return [Path(f"{prefix}{suffix}") for suffix in (".bin", ".idx", ".tokenizer.json")]


def measure(label: str, command: list[str], prefix: Path, cache: Path | None) -> dict:
    files = dataset_files(prefix) + (sorted(cache.glob("*")) if cache and cache.is_dir() else [])
    evict(files)
    before = loadavg()
    result = run_child(command, label)
    result["bin_resident_mb"] = resident_bytes(Path(f"{prefix}.bin")) / MB
    result["idx_resident_mb"] = resident_bytes(Path(f"{prefix}.idx")) / MB
    result["loadavg"] = f"{before} -> {loadavg()}"
    return result


def show(r: dict) -> None:
    parts = [f"{r['label']:<34} process {r['wall_s']:6.2f} s"]
    if "import_s" in r:
        parts.append(f"import {r['import_s']:.2f} s")
    if "resolve_and_import_s" in r:
        parts.append(f"resolve+import {r['resolve_and_import_s']:.2f} s")
    if "op_s" in r:
        parts.append(f"op {r['op_s']:.3f} s, op read_bytes {r['op_io']['read_bytes'] / MB:.1f} MB")
    if "bin_resident_after_op_mb" in r:
        parts.append(f".bin resident after op {r['bin_resident_after_op_mb']:.2f} MB")
    parts.append(f"peak RSS {r['peak_rss_mb']:.0f} MB, CPU {r['cpu_s']:.1f} s, process read "
                 f"{r['process_read_mb']:.1f} MB, .bin resident at exit {r['bin_resident_mb']:.2f} MB, "
                 f".idx resident {r['idx_resident_mb']:.1f} MB; load {r['loadavg']}")
    print("  " + "; ".join(parts))
    for mode, read in r.get("reads", {}).items():
        print(f"      {read['samples']} cold samples, {mode + ':':<12} {read['ms']:7.1f} ms, "
              f"read_bytes {read['read_bytes'] / MB:6.1f} MB, .bin in page cache after "
              f"{read['bin_resident_bytes'] / MB:6.1f} MB "
              f"({read['bin_resident_bytes'] / read['samples'] / MB:.2f} MB per sample)")


def read_ahead_kb(path: Path) -> int | None:
    """The read-ahead of the block device holding `path` (sets the window a page fault reads)."""
    try:
        device = os.stat(path).st_dev
        queue = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
        for candidate in (queue / "queue", queue / ".." / "queue"):
            if (candidate / "read_ahead_kb").is_file():
                return int((candidate / "read_ahead_kb").read_text())
    except OSError:
        pass
    return None


def directory_mb(path: Path) -> float:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file()) / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=10)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--dense-mib", type=int, default=512)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # common.py has put the checkout on sys.path
        child_main(args.child)
        return

    def stop(signum, _frame):
        raise SystemExit(128 + signum)  # run the finally: below

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    work = args.work or Path(tempfile.mkdtemp(prefix="dsforge-bench-open-"))
    work.mkdir(parents=True, exist_ok=True)
    prefix = work / "big"
    documents = int(args.gib * GIB) // 2 // args.doc_tokens
    idx_bytes = 34 + documents * (4 + 8 + 8) + 8
    try:
        free = shutil.disk_usage(work).free
        print(f"{work}: {free / GIB:.1f} GiB free; load average {loadavg()} ({os.cpu_count()} CPUs); "
              f"device read-ahead {read_ahead_kb(work)} KiB")
        wanted = idx_bytes + 2 * GIB + args.dense_mib * (1 << 20)  # + index caches (~0.5 GB)
        if free < wanted:
            raise SystemExit(f"{work}: {free / GIB:.1f} GiB free, want {wanted / GIB:.1f}")
        made = run_child(child("make", prefix, documents, args.doc_tokens), "make")
        bin_path = Path(f"{prefix}.bin")
        allocated = bin_path.stat().st_blocks * 512
        print(f"made {prefix}: .bin {bin_path.stat().st_size / GIB:.2f} GiB (allocated on disk "
              f"{allocated / MB:.1f} MB: sparse), .idx {Path(f'{prefix}.idx').stat().st_size / MB:.1f}"
              f" MB, {documents:,} documents of {args.doc_tokens} tokens in {made['make_s']:.1f} s")
        if allocated > 64 * MB:
            raise SystemExit(f"{work}: the file system does not keep {bin_path.name} sparse")

        results: dict[str, dict] = {}
        # the recipe relative to the checkout the children run in: validate quotes it, and the
        # results then name no machine's checkout
        recipe = str(RECIPE.relative_to(REPO))
        for name, target in (("tempest", TEMPEST), ("big", prefix)):
            cache = work / f"cache-{name}"
            print(f"\n{name} ({target}):")
            steps = [
                ("open", "(a) open_dataset", child("open", target), None),
                ("validate", "(b) dsforge validate",
                 [sys.executable, "-m", "dsforge", "validate", recipe, "--set",
                  f"data.source={target}", "--set", "model.vocab_size=257"], None),
                ("build_miss", f"(c) build_splits {args.steps} steps, miss",
                 child("build", target, cache, args.steps), cache),
                ("build_hit", f"(c) build_splits {args.steps} steps, hit",
                 child("build", target, cache, args.steps), cache),
            ]
            for key, label, command, cache_dir in steps:
                r = measure(label, command, target, cache_dir)
                if key == "validate":
                    r["said"] = r["output"][-1]
                if key == "build_miss":
                    r["cache_mb"] = directory_mb(cache)
                results[f"{name}.{key}"] = r
                show(r)
            print(f"  index cache for {args.steps} steps: {results[f'{name}.build_miss']['cache_mb']:.1f}"
                  f" MB on disk ({results[f'{name}.build_miss']['train_samples']:,} training samples "
                  f"indexed); validate said: {results[f'{name}.validate']['said']}")
        if args.dense_mib:
            dense = work / "dense"
            dense_docs = args.dense_mib * (1 << 20) // 2 // args.doc_tokens
            print(f"\ndense ({args.dense_mib} MiB written, {dense_docs:,} documents):")
            r = measure("(e) cold sample reads", child("dense", dense, dense_docs, args.doc_tokens,
                                                       work / "cache-dense"), dense, None)
            results["dense.reads"] = r
            show(r)
        out = Path(__file__).with_name("results_open.json")
        out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "python": platform.python_version(), "gib": args.gib, "documents": documents,
            "doc_tokens": args.doc_tokens, "steps": args.steps, "dense_mib": args.dense_mib,
            "read_ahead_kb": read_ahead_kb(work), "make_s": made["make_s"],
            "results": results}, indent=2) + "\n")
        print(f"\nraw figures: {out}")
    finally:
        for path in dataset_files(prefix) + dataset_files(work / "dense"):
            path.unlink(missing_ok=True)
        for cache in work.glob("cache-*"):
            shutil.rmtree(cache, ignore_errors=True)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        print(f"removed the dataset and index caches under {work}")


if __name__ == "__main__":
    main()
