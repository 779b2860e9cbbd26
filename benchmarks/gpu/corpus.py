#!/usr/bin/env python3
"""The kit's real-token corpus, made without the network (issue 39): the Python standard
library's sources on this machine, a 32,000-token byte-level BPE trained on them with the
`tokenizers` library, and `dsforge data prepare` into a Megatron indexed dataset.

    python3 benchmarks/gpu/corpus.py [--dest benchmarks/gpu/wheels/corpus] [--max-mb 24]

build_kit.sh runs it; the dataset travels in the carried folder (PREFIX = DEST/pystdlib:
.bin, .idx, .tokenizer.json; the trained tokenizer.json; corpus.json saying what went in). Why this text: the GPU
kit's runs need several million tokens of real text (a 12-step 7B run at 32 sequences of 4,096
reads 1.6M), the presets' vocabulary is 32,000, and the machines reach only the package
registries. Source code is not prose, but a model trained on it learns (the loss falls within
the first steps), which is what a throughput figure must show; its tokens per byte differ from
English text, which changes no step time (the step sees ids, not bytes).

The files are read in sorted order and each is one document, so a build on the same Python
release gives the same tokenizer and the same ids.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[1]
DEST = KIT / "wheels" / "corpus"
NAME = "pystdlib"  # the dataset prefix inside DEST
VOCAB_SIZE = 32_000  # the presets' (Llama 2's) vocabulary: a model's vocab_size must hold it
EOD = "<|endoftext|>"
MAX_MB = 24.0  # ~6M tokens: a 7B run of 12 steps at 32 sequences reads 1.6M
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo",
                "ensurepip"}  # installed packages and bundled wheels are not the library


STAND_IN_BYTES = 256 * 1024  # the dry run's stand-in: the data rules ask for one global batch (32 x 4,096)
_stand_in: list[Path] = []  # made once per process


def prefix(dest: Path = DEST) -> Path:
    return dest / NAME


def built(dataset: Path) -> bool:
    return all(dataset.with_name(dataset.name + suffix).is_file() for suffix in (".bin", ".idx"))


def about(dataset: Path) -> dict:
    """corpus.json beside the dataset (what went in, how many tokens)."""
    return json.loads((dataset.parent / "corpus.json").read_text())


def stand_in() -> Path:
    """A small dataset of this repository's docs in UTF-8 bytes (vocabulary 257, which any
    model's fits), for checking recipes where the corpus is not built: a dry run on CI."""
    if not _stand_in:
        from dsforge.data.prepare import prepare as prepare_dataset

        folder = Path(tempfile.mkdtemp(prefix="dsforge-kit-corpus-"))
        atexit.register(shutil.rmtree, folder, True)
        text = (REPO / "README.md").read_text()
        (folder / "text.txt").write_text((text * (STAND_IN_BYTES // len(text) + 1))[:STAND_IN_BYTES])
        prepare_dataset([str(folder / "text.txt")], tokenizer="bytes", output=folder / NAME)
        _stand_in.append(folder / NAME)
    return _stand_in[0]


def sources(root: Path, max_bytes: int) -> list[Path]:
    """The library's .py files in sorted order, up to `max_bytes` of them."""
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS & set(path.relative_to(root).parts) or not path.is_file():
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def write_documents(files: list[Path], root: Path, out: Path) -> int:
    """One JSON-lines record a file (undecodable files left out); the number written."""
    written = 0
    with out.open("w") as f:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                f.write(json.dumps({"text": text, "file": str(path.relative_to(root))}) + "\n")
                written += 1
    return written


def train_tokenizer(documents: Path, out: Path) -> None:
    """A byte-level BPE (GPT-2's scheme) with VOCAB_SIZE ids, EOD among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (json.loads(line)["text"] for line in documents.open())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(out))


def prepare(documents: Path, tokenizer: Path, dest: Path) -> None:
    """`dsforge data prepare`, as a user would run it."""
    workers = str(min(8, os.cpu_count() or 1))
    subprocess.run([sys.executable, "-m", "dsforge", "data", "prepare", str(documents),
                    "--tokenizer", str(tokenizer), "--output", str(prefix(dest)), "--workers",
                    workers, "--overwrite", "--no-progress"], check=True, cwd=REPO)


def build(dest: Path, max_mb: float) -> dict:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sources(root, int(max_mb * 1024**2))
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = dest / "tokenizer.json"  # kept: the ids mean nothing without it
    with tempfile.TemporaryDirectory(prefix="dsforge-corpus-") as tmp:
        documents = Path(tmp) / "documents.jsonl"
        count = write_documents(files, root, documents)
        text_bytes = documents.stat().st_size
        train_tokenizer(documents, tokenizer)
        prepare(documents, tokenizer, dest)
    tokens = prefix(dest).with_suffix(".bin").stat().st_size // 2  # uint16 ids (vocab < 65,536)
    about = {"source": f"the Python {sys.version.split()[0]} standard library's .py files",
             "documents": count, "jsonl_bytes": text_bytes, "tokens": tokens,
             "vocab_size": VOCAB_SIZE, "eod": EOD, "prefix": NAME,
             "made_by": "benchmarks/gpu/corpus.py"}
    (dest / "corpus.json").write_text(json.dumps(about, indent=2) + "\n")
    return about


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEST)
    parser.add_argument("--max-mb", type=float, default=MAX_MB, help="source text to read")
    args = parser.parse_args(argv)
    about = build(args.dest, args.max_mb)
    print(f"corpus: {about['documents']} documents, {about['tokens'] / 1e6:.2f}M tokens "
          f"({VOCAB_SIZE} vocabulary) in {prefix(args.dest)}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
