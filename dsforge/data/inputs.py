"""Input corpora: which files INPUT... names, and their documents as a stream of batches.

- A file ending in .jsonl, .ndjson or .json is JSON lines: one JSON object per line, the
  document in the field --text-key (Megatron-LM's preprocess_data.py reads the same files).
  Blank lines are skipped.
- Any other file is plain text and one whole document. It is read in pieces of at most
  PIECE_BYTES cut after a line break, so no file is ever held in memory whole; each piece is
  tokenized on its own and stored as one sequence of the document (the format's sequences
  within a document), each ending with the EOD (prepare.py _Encoder: Megatron's GPTDataset
  packs sequences, not documents). Tokens can differ from tokenizing the whole file at once
  only where a piece is cut, right after a newline.
- A folder stands for the files under it (recursively, hidden ones left out) whose names end in
  one of CORPUS_SUFFIXES; a glob (*, ?, [..], ** recursive) for the files it matches. Each
  INPUT's files are taken in sorted order, INPUTs in the order given, a file named twice once.

Batches hold documents in input order, so whatever the number of workers the output is the
same. This process only reads: JSON lines travel as bytes and the workers parse them (as in
Megatron-LM's tool), so parsing scales with --workers. A document whose text is only
whitespace is empty: counted, not tokenized.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from dsforge.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CORPUS_SUFFIXES = JSONL_SUFFIXES + (".txt", ".text")
PIECE_BYTES = 1 << 20  # longest piece of a plain text file tokenized at once
BATCH_BYTES = 1 << 18  # text per batch sent to a worker: large enough to amortize the IPC
BATCH_DOCUMENTS = 4096
ARGUMENT = "INPUT"


@dataclass(frozen=True)
class InputFile:
    path: Path
    jsonl: bool
    size: int  # bytes


@dataclass
class Batch:
    """Consecutive pieces of documents. A payload is a piece of text, or a JSON line (bytes)
    whose --text-key field is a whole document, parsed by the worker (`texts`) so that this
    process only reads lines. `starts[i]`/`ends[i]`: payload i begins/ends its document;
    `origins[i]`: its file and line, for errors. `input_bytes` and `empty_documents` count what
    the batch consumed."""

    index: int
    payloads: list[str | bytes] = field(default_factory=list)
    starts: list[bool] = field(default_factory=list)
    ends: list[bool] = field(default_factory=list)
    origins: list[tuple[str, int]] = field(default_factory=list)
    input_bytes: int = 0
    empty_documents: int = 0
    payload_bytes: int = 0

    def texts(self, text_key: str) -> list[str | None]:
        """Each payload's text; None for an empty document (only whitespace)."""
        texts = []
        for payload, (path, line) in zip(self.payloads, self.origins):
            text = payload if isinstance(payload, str) else \
                _document_text(path, line, payload, text_key)
            texts.append(None if isinstance(payload, bytes) and not text.strip() else text)
        return texts


def expand_inputs(patterns: Sequence[str]) -> list[InputFile]:
    """The files INPUT... names, each checked to be a readable regular file."""
    if not patterns:
        raise DataError(ARGUMENT, None, "no input given", "name JSON-lines or text files, "
                        "folders of them, or globs")
    files: dict[Path, InputFile] = {}
    for pattern in patterns:
        for path in _expand(pattern):
            if path.resolve() not in files:
                files[path.resolve()] = _input_file(path)
    return list(files.values())


def _expand(pattern: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not found:
            raise DataError(ARGUMENT, pattern, "this folder holds no corpus file (none ending "
                            f"in {', '.join(CORPUS_SUFFIXES)})",
                            "name the files themselves, or a glob that matches them")
        return found
    if path.exists() or os.path.lexists(path):
        return [path]
    if glob.has_magic(pattern):
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                       if os.path.isfile(p))
        if not found:
            raise DataError(ARGUMENT, pattern, "this glob matches no file",
                            "check the pattern (quote it so the shell leaves ** to dsforge)")
        return found
    raise DataError(ARGUMENT, pattern, "no such file or folder", "check the path")


def _input_file(path: Path) -> InputFile:
    if not path.is_file():
        raise DataError(ARGUMENT, str(path), "is not a regular file (a broken link, a device, "
                        "a pipe)", "name regular files, folders or globs")
    if not os.access(path, os.R_OK):
        raise DataError(ARGUMENT, str(path), "cannot be read (permission denied)",
                        "make it readable (chmod +r) or leave it out")
    return InputFile(path=path, jsonl=path.suffix in JSONL_SUFFIXES, size=path.stat().st_size)


def batches(files: Sequence[InputFile], *, batch_bytes: int = BATCH_BYTES,
            piece_bytes: int = PIECE_BYTES) -> Iterator[Batch]:
    """Every document of `files` in order, grouped into batches of about `batch_bytes`."""
    batch = Batch(index=0)
    for payload, start, end, consumed, origin in _pieces(files, piece_bytes=piece_bytes):
        batch.input_bytes += consumed
        if payload is None:  # an empty document
            batch.empty_documents += 1
        if not payload:
            continue
        batch.payloads.append(payload)
        batch.starts.append(start)
        batch.ends.append(end)
        batch.origins.append(origin)
        batch.payload_bytes += len(payload)
        if batch.payload_bytes >= batch_bytes or len(batch.payloads) >= BATCH_DOCUMENTS:
            yield batch
            batch = Batch(index=batch.index + 1)
    if batch.payloads or batch.input_bytes or batch.empty_documents:
        yield batch


def _pieces(files, *, piece_bytes):
    """(payload, starts document, ends document, input bytes consumed, (file, line)); the
    payload is None for an empty document, empty for input that holds none (a blank line)."""
    for file in files:
        try:
            if file.jsonl:
                yield from _jsonl_lines(file.path)
            else:
                yield from _text_pieces(file.path, piece_bytes)
        except OSError as exc:
            raise DataError(ARGUMENT, str(file.path), f"cannot be read ({exc.strerror or exc})",
                            "check the file (permissions, the disk) or leave it out") from None


def _jsonl_lines(path: Path):
    name = str(path)
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            yield (line if line.strip() else b""), True, True, len(line), (name, number)


def _document_text(path: str, number: int, line: bytes, text_key: str) -> str:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except UnicodeDecodeError as exc:
        raise DataError(ARGUMENT, where, f"is not UTF-8 ({exc.reason} at byte {exc.start} of the "
                        "line)", "convert the file to UTF-8 or leave it out") from None
    except ValueError as exc:
        raise DataError(ARGUMENT, where, f"is not a JSON object ({exc})",
                        "JSON-lines files (.jsonl, .ndjson, .json) hold one JSON object per "
                        "line; name plain text files .txt") from None
    if not isinstance(record, dict):
        raise DataError(ARGUMENT, where, f"is a JSON {type(record).__name__}, not an object",
                        "write one JSON object per line, its text under --text-key")
    if text_key not in record:
        keys = ", ".join(map(repr, list(record)[:10])) or "none"
        raise DataError("--text-key", text_key, f"{where} has no such key (its keys: {keys})",
                        "pass --text-key with the key that holds the document's text")
    text = record[text_key]
    if not isinstance(text, str):
        raise DataError("--text-key", text_key, f"{where}: the value is a JSON "
                        f"{type(text).__name__}, not a string",
                        "pass --text-key with the key that holds the document's text")
    return text


def _text_pieces(path: Path, piece_bytes: int):
    """A plain text file as one document, in pieces (the last one ends the document)."""
    with open(path, "rb") as f:
        pieces = _read_pieces(f, path, piece_bytes)
        current, start = next(pieces, ("", 0)), True
        origin = (str(path), 0)
        for following in pieces:
            yield current[0], start, False, current[1], origin
            current, start = following, False
        text, consumed = current
        yield (None if start and not text.strip() else text), start, True, consumed, origin


def _read_pieces(f, path: Path, piece_bytes: int):
    """(text, bytes read) of pieces of about piece_bytes cut after a newline (inside a longer
    line anywhere: the incremental decoder keeps a character split between reads whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, pending = 0, 0
    while raw := f.read(piece_bytes):
        if not raw.endswith(b"\n"):
            raw += f.readline(piece_bytes)
        text = _decode(decoder, raw, path, offset, final=False)
        offset += len(raw)
        pending += len(raw)
        if text:
            yield text, pending
            pending = 0
    _decode(decoder, b"", path, offset, final=True)  # a character cut off by the end


def _decode(decoder, raw: bytes, path: Path, offset: int, *, final: bool) -> str:
    try:
        return decoder.decode(raw, final=final)
    except UnicodeDecodeError as exc:
        raise DataError(ARGUMENT, str(path), f"is not UTF-8 text ({exc.reason} at byte "
                        f"{offset + exc.start})", "convert it to UTF-8 (e.g. iconv -f latin1 "
                        "-t utf-8) or leave it out") from None
