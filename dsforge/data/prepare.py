"""`dsforge data prepare`: corpora -> a Megatron indexed dataset, PREFIX.bin + PREFIX.idx.

The shape of Megatron-LM's tools/preprocess_data.py: this process reads the inputs into
batches of documents (inputs.py); worker processes parse and tokenize them (each worker
builds its own tokenizer from a TokenizerSpec when it starts) and append the
end-of-document token to every document (Megatron's --append-eod); this process writes the
sequences in input order with Megatron-Core's own IndexedDatasetBuilder, in the dtype Megatron
chooses for the vocabulary (DType.optimal_dtype: uint16 below 65500 ids, else int32). The
files are therefore the ones Megatron-LM's and GPT-NeoX's tools write and read.

- Deterministic: batches are cut before any worker sees them and written back in batch order,
  so the output does not depend on --workers (0 tokenizes in this process).
- Streaming: at most IN_FLIGHT_PER_WORKER batches per worker are between the reader and the
  writer; only the index (a few numbers per document) grows with the corpus, in the builder.
- Atomic: both files are written under temporary names beside their final ones
  (PREFIX.bin.partial-PID), synced, then renamed: .bin first, the PREFIX.tokenizer.json
  record (identity.py), .idx last, so a dataset that looks complete (PREFIX.idx present) is
  complete. Any exception or Ctrl-C/SIGTERM ends the workers and removes the partial
  files; partial files of a killed run (its PID gone) are removed by the next run to the same
  PREFIX.

The worker processes are forked (where the platform can) before any thread is started here.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

import dsforge
from dsforge.data.errors import EXIT_INVALID, DataError
from dsforge.data.identity import TokenizerIdentity, record_path, write_record
from dsforge.data.indexed import megatron_indexed_dataset
from dsforge.data.inputs import BATCH_BYTES, PIECE_BYTES, Batch, InputFile, batches, expand_inputs
from dsforge.data.tokenizers import TokenizerSpec, load_tokenizer
from dsforge.files import fsync_directory

# DSFORGE_PREPARE_FAULT=KIND:BATCH rehearses failures (the tests use it): raise | hang in the
# worker that tokenizes batch BATCH; interrupt: a KeyboardInterrupt here after writing it.
FAULT_ENV = "DSFORGE_PREPARE_FAULT"
IN_FLIGHT_PER_WORKER = 2  # batches sent to a worker ahead of its result
STOPPED = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + signal


@dataclass(frozen=True, kw_only=True)
class PrepareResult:
    prefix: Path
    identity: TokenizerIdentity
    input_files: int
    input_bytes: int
    documents: int
    empty_documents: int  # skipped: no text, or no tokens before the EOD
    sequences: int  # documents plus the extra pieces of long plain text files
    tokens: int  # EODs included
    dtype: str
    workers: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def summary(self) -> str:
        return (f"{self.prefix}.bin/.idx: {self.documents:,} documents "
                f"({self.empty_documents:,} empty skipped), {self.tokens:,} tokens ({self.dtype}, "
                f"vocabulary {self.identity.vocab_size:,}, EOD {self.identity.eod_id}) from "
                f"{self.input_files:,} files, {self.input_bytes / 1e6:,.2f} MB in "
                f"{self.seconds:.2f} s: {self.mb_per_s:,.2f} MB/s, {self.tokens_per_s:,.0f} "
                f"tokens/s, {self.workers} workers; tokenizer record {record_path(self.prefix)}")

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(prefix=str(self.prefix), mb_per_s=self.mb_per_s, tokens_per_s=self.tokens_per_s)
        return data


def prepare(inputs: Sequence[str], *, tokenizer: str, output: str | Path, text_key: str = "text",
            workers: int = 1, eod_token: str | None = None, overwrite: bool = False,
            progress: bool | None = None, batch_bytes: int = BATCH_BYTES,
            piece_bytes: int = PIECE_BYTES) -> PrepareResult:
    """Tokenize every document of INPUTs into PREFIX.bin/.idx (+ PREFIX.tokenizer.json).
    Raises DataError for bad input, before anything is written where it can be told then.
    progress: a bar on stderr; None shows it when stderr is a terminal."""
    if workers < 0:
        raise DataError("--workers", workers, "is negative", "give 0 (tokenize in this "
                        "process) or the number of worker processes")
    files = expand_inputs(inputs)
    spec = TokenizerSpec(tokenizer, eod_token)
    identity = load_tokenizer(spec).identity
    prefix = _output_prefix(output, overwrite=overwrite)
    dtype = megatron_indexed_dataset().DType.optimal_dtype(identity.vocab_size)
    fault = os.environ.get(FAULT_ENV, "")
    started = time.perf_counter()
    with _PartialOutput(prefix) as partial:
        counts = _write(batches(files, batch_bytes=batch_bytes, piece_bytes=piece_bytes),
                        partial=partial, spec=spec,
                        text_key=text_key, dtype=dtype, workers=workers, fault=fault,
                        total_bytes=sum(f.size for f in files), progress=progress)
        if counts.documents == 0:
            raise DataError("INPUT", list(inputs), f"every document is empty "
                            f"({counts.empty_documents:,} documents, no text)",
                            "check --text-key and the files; nothing was written")
        result = PrepareResult(prefix=prefix, identity=identity, input_files=len(files),
                               workers=workers, dtype=np.dtype(dtype).name,
                               seconds=time.perf_counter() - started, **asdict(counts))
        partial.commit(identity, _dataset_record(result, files, text_key))
    return result


def prepare_main(inputs: Sequence[str], **options) -> int:
    """prepare() for the command line: the summary on stdout, a refusal on stderr. Exit status
    0 done, 2 bad input (nothing written), 130/143/129 stopped by Ctrl-C/SIGTERM/SIGHUP (the
    pool ended, partial files removed)."""
    try:
        with _signals_stop():
            result = prepare(inputs, **options)
    except DataError as exc:
        print(f"dsforge data prepare: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt as exc:
        number = exc.signal if isinstance(exc, Stopped) else signal.SIGINT
        print(f"\ndsforge data prepare: stopped by {signal.Signals(number).name}; partial files "
              "removed, nothing written", file=sys.stderr)
        return STOPPED[number]
    print(result.summary())
    return 0


@dataclass
class _Counts:
    input_bytes: int = 0
    documents: int = 0
    empty_documents: int = 0
    sequences: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class _Encoded:
    """A tokenized batch: `tokens` concatenated, `lengths[i]` of piece i (EOD included, 0 for an
    empty document), `ends[i]` piece i ends its document."""

    index: int
    tokens: np.ndarray
    lengths: np.ndarray
    ends: np.ndarray
    input_bytes: int
    empty_documents: int


def _write(stream: Iterable[Batch], *, partial: "_PartialOutput", spec: TokenizerSpec,
           text_key: str, dtype, workers: int, fault: str, total_bytes: int,
           progress: bool | None) -> _Counts:
    builder = megatron_indexed_dataset().IndexedDatasetBuilder(str(partial.bin), dtype=dtype)
    writer = _Writer(builder)
    try:
        encoder = _EncoderSpec(spec, text_key, np.dtype(dtype).name, fault)
        with _Encoders(encoder, workers) as encode, _bar(total_bytes, progress) as bar:
            for encoded in encode(stream):
                writer.add(encoded)
                bar.update(encoded.input_bytes)
                bar.set_postfix_str(f"docs={writer.counts.documents:,} "
                                    f"tokens={writer.counts.tokens:,}", refresh=False)
                _inject(fault, "interrupt", encoded.index)
        builder.finalize(str(partial.idx))
    finally:
        builder.data_file.close()  # already closed by finalize; open after an exception
    return writer.counts


class _Writer:
    """Tokenized batches into Megatron-Core's builder: a sequence per piece, a document ended
    after its last piece (which may come batches later: long plain text files)."""

    def __init__(self, builder):
        import torch  # imported with megatron.core already

        self.builder, self.from_numpy = builder, torch.from_numpy
        self.counts, self.open_document = _Counts(), False

    def add(self, encoded: _Encoded) -> None:
        offset = 0
        for length, end in zip(encoded.lengths.tolist(), encoded.ends.tolist()):
            if not length:  # an empty document, or a piece without tokens (never the last)
                continue
            sequence = encoded.tokens[offset:offset + length]
            offset += length
            self.counts.sequences += 1
            if end and not self.open_document:  # a whole document (twice as fast as add_item)
                self.builder.add_document(sequence, [length])
            else:
                self.builder.add_item(self.from_numpy(sequence))
                if end:
                    self.builder.end_document()
            self.open_document = not end
            self.counts.documents += end
        self.counts.tokens += offset
        self.counts.input_bytes += encoded.input_bytes
        self.counts.empty_documents += encoded.empty_documents


@dataclass(frozen=True)
class _EncoderSpec:
    """What a worker needs to build its encoder (picklable)."""

    tokenizer: TokenizerSpec
    text_key: str
    dtype: str
    fault: str


class _Encoders:
    """encode(batches) -> _Encoded in batch order, from `workers` processes (or this process
    for 0). Each worker has its own pipe: batch i goes to worker i mod workers, at most
    IN_FLIGHT_PER_WORKER batches ahead of its result, and results are taken back in batch
    order. A thread in each worker reads its pipe as batches come (_work), so a send from here
    never waits for a busy worker, and a worker waiting to send a result waits only for this
    process, which is reading results in order. Nothing is shared between processes:
    multiprocessing.Pool's terminate() could hang for good joining its task thread, stuck on
    its queue's lock (seen in this project's test suite). Leaving the block after an exception
    ends every worker (SIGTERM; busy or not)."""

    def __init__(self, spec: _EncoderSpec, workers: int):
        self.spec, self.workers = spec, workers
        self.processes: list = []
        self.pipes: list = []

    def __enter__(self):
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        for _ in range(self.workers):
            ours, theirs = context.Pipe()
            # the worker closes the ends it inherits but does not use, so it sees EOF when
            # this process is gone
            process = context.Process(target=_work, args=(theirs, self.spec, [*self.pipes, ours]),
                                      daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        return self.encode

    def encode(self, stream: Iterable[Batch]) -> Iterator[_Encoded]:
        if not self.workers:
            yield from map(_Encoder(self.spec), stream)
            return
        ahead = IN_FLIGHT_PER_WORKER * self.workers
        sent = 0
        for batch in stream:
            self.pipes[sent % self.workers].send(batch)
            sent += 1
            if sent > ahead:
                yield self._take((sent - ahead - 1) % self.workers)
        for index in range(max(0, sent - ahead), sent):
            yield self._take(index % self.workers)

    def _take(self, worker: int) -> _Encoded:
        try:
            kind, value = self.pipes[worker].recv()
        except EOFError:
            process = self.processes[worker]
            process.join(timeout=5)
            raise RuntimeError(f"tokenizer worker {process.pid} ended without a result "
                               f"(exit code {process.exitcode})") from None
        if kind == "error":
            raise value
        return value

    def __exit__(self, exc_type, exc, traceback):
        for pipe, process in zip(self.pipes, self.processes):
            if exc_type is None and process.is_alive():
                pipe.send(None)  # no more batches: the worker returns
            elif process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()


def _work(pipe, spec: _EncoderSpec, unused) -> None:
    """A worker: batches from `pipe` until None (or the parent is gone), each answered in
    order with ("ok", encoded) or ("error", the exception it raised). A thread takes the
    batches off the pipe as they come, so the parent's sends never wait for the encoding."""
    for end in unused:
        end.close()
    _init_worker(spec)
    batches: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(pipe, batches), daemon=True).start()
    while (batch := batches.get()) is not None:
        try:
            result = ("ok", _WORKER(batch))
        except Exception as exc:  # raised in the parent, where the batch was asked for
            result = ("error", exc)
        pipe.send(result)


def _receive(pipe, batches: "queue.SimpleQueue") -> None:
    while True:
        try:
            batch = pipe.recv()
        except EOFError:  # the parent is gone
            batch = None
        batches.put(batch)
        if batch is None:
            return


class _Encoder:
    """A batch -> its token ids: JSON lines parsed, texts tokenized, the EOD appended to each
    piece with tokens and to each document's last piece; a document without text or tokens
    counted as empty, length 0. Every sequence ends with the EOD because Megatron's GPTDataset
    shuffles, splits and packs sequences, not documents: a long text's piece without one would
    run straight into whatever sequence the shuffle put after it, one text to the model and to
    data.document_masking."""

    def __init__(self, spec: _EncoderSpec):
        self.tokenizer = load_tokenizer(spec.tokenizer)
        self.text_key, self.dtype, self.fault = spec.text_key, np.dtype(spec.dtype), spec.fault
        self.eod = np.array([self.tokenizer.identity.eod_id], dtype=self.dtype)

    def __call__(self, batch: Batch) -> _Encoded:
        _inject(self.fault, "raise", batch.index)
        _inject(self.fault, "hang", batch.index)
        texts = batch.texts(self.text_key)
        encoded = iter(self.tokenizer.encode([t for t in texts if t is not None]))
        pieces, lengths, empty = [], [], batch.empty_documents
        for text, start, end in zip(texts, batch.starts, batch.ends):
            ids = np.asarray(next(encoded) if text is not None else [], dtype=self.dtype)
            if start and end and not len(ids):  # a whole document without a token: skipped
                empty += 1
            elif end or len(ids):
                ids = np.concatenate([ids, self.eod])
            pieces.append(ids)
            lengths.append(len(ids))
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)
        return _Encoded(index=batch.index, tokens=tokens, lengths=np.array(lengths, np.int64),
                        ends=np.array(batch.ends, bool), input_bytes=batch.input_bytes,
                        empty_documents=empty)


_WORKER: _Encoder | None = None  # this worker process's encoder, built by _init_worker


def _init_worker(spec: _EncoderSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: main decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ending the workers must end a busy one
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers means cores
    global _WORKER
    _WORKER = _Encoder(spec)


def _inject(fault: str, kind: str, index: int) -> None:
    if not fault:
        return
    want, _, at = fault.partition(":")
    if want != kind or at != str(index):
        return
    if kind == "raise":
        raise RuntimeError(f"{FAULT_ENV}={fault}: injected failure tokenizing batch {index}")
    if kind == "hang":
        time.sleep(3600)
    if kind == "interrupt":
        raise KeyboardInterrupt


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, stopping prepare like Ctrl-C."""

    def __init__(self, number: int):
        super().__init__(number)
        self.signal = number


class _signals_stop:
    """SIGTERM and SIGHUP raise Stopped (so the pool ends and partial files go) while inside."""

    def __enter__(self):
        self.previous = {number: signal.signal(number, self._raise) for number in
                         (signal.SIGTERM, signal.SIGHUP)}

    @staticmethod
    def _raise(number, frame):
        raise Stopped(number)

    def __exit__(self, *exc):
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def _bar(total_bytes: int, progress: bool | None):
    from tqdm import tqdm  # a dependency of deepspeed

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
                disable=None if progress is None else not progress, mininterval=0.5,
                dynamic_ncols=True)


def _output_prefix(output: str | Path, *, overwrite: bool) -> Path:
    prefix = Path(output).expanduser()
    if prefix.suffix in (".bin", ".idx"):
        raise DataError("--output", str(output), "is a prefix: dsforge adds .bin and .idx",
                        f"use --output {prefix.with_suffix('')}")
    if prefix.is_dir():
        raise DataError("--output", str(output), "is a folder; PREFIX names the files",
                        f"use e.g. --output {prefix / 'corpus'}")
    finals = [p for p in _final_paths(prefix) if p.exists()]
    if finals and not overwrite:
        raise DataError("--output", str(output), f"{', '.join(p.name for p in finals)} already "
                        "exist", "pass --overwrite to replace them, or choose another --output")
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError("--output", str(output), f"its folder cannot be created "
                        f"({exc.strerror or exc})", "choose a writable location") from None
    if not os.access(prefix.parent, os.W_OK):
        raise DataError("--output", str(output), f"its folder {prefix.parent} is not writable",
                        "choose a writable location")
    return prefix


def _final_paths(prefix: Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


class _PartialOutput:
    """PREFIX.bin/.idx written under temporary names; renamed by commit(), removed otherwise."""

    def __init__(self, prefix: Path):
        self.prefix, self.committed = prefix, False
        self.final_bin, self.final_idx = _final_paths(prefix)
        self.bin, self.idx = (Path(f"{p}.partial-{os.getpid()}") for p in _final_paths(prefix))

    def __enter__(self) -> "_PartialOutput":
        _remove_stale_partials(self.prefix)
        return self

    def commit(self, identity: TokenizerIdentity, dataset: dict) -> None:
        for path in (self.bin, self.idx):
            _fsync(path)
        self.final_idx.unlink(missing_ok=True)  # --overwrite: never an old index with new data
        os.replace(self.bin, self.final_bin)
        write_record(self.prefix, identity, dataset)
        os.replace(self.idx, self.final_idx)  # last: from now on the dataset looks complete
        fsync_directory(self.prefix.parent)
        self.committed = True

    def __exit__(self, *exc) -> None:
        if not self.committed:
            for path in (self.bin, self.idx):
                path.unlink(missing_ok=True)


def _remove_stale_partials(prefix: Path) -> None:
    for path in prefix.parent.glob(f"{prefix.name}.*.partial-*"):
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _dataset_record(result: PrepareResult, files: Sequence[InputFile], text_key: str) -> dict:
    inputs = [_relative_to_record(f.path, result.prefix) for f in files[:1000]]
    return {"documents": result.documents, "empty_documents_skipped": result.empty_documents,
            "sequences": result.sequences, "tokens": result.tokens, "dtype": result.dtype,
            "append_eod": True, "text_key": text_key, "input_bytes": result.input_bytes,
            "input_files": len(files), "inputs": inputs, "dsforge_version": dsforge.__version__}


def _relative_to_record(path: Path, prefix: Path) -> str:
    """An input's path relative to the folder of PREFIX.tokenizer.json: the record moves with
    its dataset and a shipped one names no machine's checkout or home folder."""
    return os.path.relpath(path.resolve(), Path(prefix).resolve().parent)
