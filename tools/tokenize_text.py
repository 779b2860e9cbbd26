#!/usr/bin/env python3
"""Turn a text file into a dsforge token file (flat uint16 byte-level token ids).

    python tools/tokenize_text.py data/tempest.txt data/tempest.u16.bin

Use the output as `data.source` with `data.token_dtype: uint16` and a model whose
vocab_size is at least 256 (the `tiny` presets). The file is written to a temporary name and
renamed, so a half-written token file is never left under the final name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsforge.tokenizer import encode  # noqa: E402


def tokenize_file(source: Path, target: Path) -> int:
    ids = encode(source.read_text(encoding="utf-8"))
    partial = target.with_name(target.name + ".partial")
    ids.tofile(partial)
    os.replace(partial, target)
    return len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    count = tokenize_file(args.text, args.output)
    print(f"{args.output}: {count:,} tokens (uint16, byte-level, vocabulary 256)")


if __name__ == "__main__":
    main()
