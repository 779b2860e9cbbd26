"""Plain text -> JSON lines, one document per paragraph (text between blank lines).

`dsforge data prepare` reads a plain text file as one document; Megatron-Core splits a dataset
into train/validation/test by documents, so a single-document corpus cannot be split. This
cuts a text into its paragraphs first:

    python tools/text_to_jsonl.py data/tempest.txt > data/tempest.jsonl
    dsforge data prepare data/tempest.jsonl --tokenizer bytes --output data/tempest
"""

from __future__ import annotations

import json
import sys


def paragraphs(text: str) -> list[str]:
    return [part.strip() for part in text.split("\n\n") if part.strip()]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/text_to_jsonl.py TEXT_FILE > OUT.jsonl", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        for paragraph in paragraphs(f.read()):
            sys.stdout.write(json.dumps({"text": paragraph}, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
