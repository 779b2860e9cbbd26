"""dsforge data prepare: tokenizers and their identity, the Megatron indexed format in both
directions, determinism across worker counts, atomic output under failures and Ctrl-C, and a
clear refusal of every kind of bad input with nothing half-written left behind."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dsforge.cli import main
from dsforge.data import prepare as prepare_module
from dsforge.data.errors import DataError
from dsforge.data.identity import mismatches, read_record
from dsforge.data.indexed import megatron_indexed_dataset, open_dataset
from dsforge.data.inputs import batches, expand_inputs
from dsforge.data.prepare import FAULT_ENV, prepare, prepare_main
from dsforge.data.tokenizers import load_tokenizer
from tests.conftest import REPO, as_foreground_job
from tests.conftest import EOD, TEMPEST

DOCS = ["First document.", "", "   \n", "Ariel flies over the isle; Caliban grumbles.",
        "Unicode survives: é ü 漢字 🙂"]


def write_jsonl(path: Path, texts, key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def tempest_jsonl(path: Path) -> Path:
    """data/tempest.txt as one document per paragraph: 1,000+ small documents."""
    paragraphs = [p for p in TEMPEST.read_text().split("\n\n") if p.strip()]
    return write_jsonl(path, paragraphs)


def documents(prefix: Path) -> list[list[int]]:
    """Every document of PREFIX through Megatron-Core's own reader, its sequences joined."""
    dataset = megatron_indexed_dataset().IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [np.concatenate([dataset[s] for s in range(bounds[d], bounds[d + 1])]).tolist()
            for d in range(len(bounds) - 1)]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------- tokenizers

def test_bytes_tokenizer_needs_no_files_and_ends_documents_with_256():
    tokenizer = load_tokenizer("bytes")
    ids = tokenizer.encode(["é!"])[0]
    assert list(ids) == list("é!".encode())
    identity = tokenizer.identity
    assert (identity.kind, identity.vocab_size, identity.eod_id) == ("bytes", 257, 256)
    assert load_tokenizer("bytes").identity == identity  # the hash is fixed


def test_a_tokenizer_json_and_its_model_folder_have_one_identity(bpe_tokenizer, bpe_model_folder):
    from_file = load_tokenizer(str(bpe_tokenizer)).identity
    from_folder = load_tokenizer(str(bpe_model_folder)).identity
    assert from_file.kind == from_folder.kind == "tokenizers"
    assert from_file.vocab_size == 512 and from_file.eod_token == EOD and from_file.eod_id == 0
    assert from_file.special_ids == {EOD: 0}
    assert mismatches(from_file, from_folder) == []
    assert mismatches(from_file, load_tokenizer("bytes").identity)  # tells them apart


def test_a_model_folder_without_tokenizer_json_goes_through_transformers(bpe_tokenizer, tmp_path):
    pytest.importorskip("transformers", reason="needs transformers: pip install 'dsforge[hf]'")
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(bpe_tokenizer))
    bpe.model.save(str(tmp_path))  # vocab.json + merges.txt, as GPT-2's folder has
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOD, "bos_token": EOD,
         "unk_token": EOD}))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.identity.kind == "transformers"
    assert (tokenizer.identity.vocab_size, tokenizer.identity.eod_id) == (512, 0)
    text = "Full fathom five thy father lies"
    assert list(tokenizer.encode([text])[0]) == bpe.encode(text).ids


def test_tokenizer_errors_name_the_argument_the_value_and_a_fix(bpe_tokenizer, tmp_path):
    from tokenizers import Tokenizer, models

    with pytest.raises(DataError) as missing:
        load_tokenizer(str(tmp_path / "nope.json"))
    assert missing.value.argument == "--tokenizer" and "nope.json" in str(missing.value)
    assert "nothing is downloaded" in str(missing.value) and missing.value.fix

    hub_name = "gpt2"  # a hub name is never looked up
    with pytest.raises(DataError, match="no such file or folder"):
        load_tokenizer(hub_name)

    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json"):
        load_tokenizer(str(garbage))

    with pytest.raises(DataError) as unknown:
        load_tokenizer(prepare_module.TokenizerSpec(str(bpe_tokenizer), "<nope>"))
    assert unknown.value.argument == "--eod-token" and EOD in str(unknown.value)

    words = tmp_path / "words.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(words))
    with pytest.raises(DataError) as no_eod:
        load_tokenizer(str(words))
    assert "no end-of-document token" in str(no_eod.value) and "--eod-token" in no_eod.value.fix

    prepared = prepare([str(TEMPEST)], tokenizer=str(bpe_tokenizer), output=tmp_path / "p",
                       workers=0)
    with pytest.raises(DataError, match="is the record dsforge writes") as record:
        load_tokenizer(f"{prepared.prefix}.tokenizer.json")
    assert "tokenizer.path" in record.value.fix

    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    with pytest.raises(DataError, match="holds no tokenizer files"):
        load_tokenizer(str(empty_folder))


def test_a_missing_library_names_the_extra_to_install(bpe_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(DataError) as exc:
        load_tokenizer(str(bpe_tokenizer))
    assert exc.value.fix == "pip install 'dsforge[data]'" and "'tokenizers'" in str(exc.value)


# ---------------------------------------------------------------------------- inputs

def test_inputs_expand_folders_and_globs_in_order_once(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("a.jsonl", "b/c.txt", "b/d.json", "b/skip.csv", ".hidden.txt"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    found = expand_inputs([str(tmp_path / "b" / "d.json"), str(tmp_path), str(tmp_path / "*.jsonl")])
    assert [f.path.relative_to(tmp_path).as_posix() for f in found] == ["b/d.json", "a.jsonl", "b/c.txt"]
    assert [f.jsonl for f in found] == [True, True, False]
    (tmp_path / "broken.txt").symlink_to(tmp_path / "nowhere")
    with pytest.raises(DataError, match="is not a regular file"):
        expand_inputs([str(tmp_path / "broken.txt")])


def test_plain_text_is_one_document_in_pieces_cut_after_newlines(tmp_path):
    text = "line one\nsecond line é漢\n" + "x" * 50 + "漢字" * 20 + "\nlast"
    path = tmp_path / "doc.txt"
    path.write_text(text)
    pieces = [(t, s, e) for b in batches(expand_inputs([str(path)]), batch_bytes=1, piece_bytes=16)
              for t, s, e in zip(b.texts("text"), b.starts, b.ends)]
    assert "".join(t for t, _, _ in pieces) == text
    assert len(pieces) > 3
    assert [s for _, s, _ in pieces] == [True] + [False] * (len(pieces) - 1)
    assert [e for _, _, e in pieces] == [False] * (len(pieces) - 1) + [True]


def test_a_long_text_file_is_one_document_of_several_sequences(bpe_tokenizer, tmp_path):
    result = prepare([str(TEMPEST), str(write_jsonl(tmp_path / "d.jsonl", ["after"]))],
                     tokenizer=str(bpe_tokenizer), output=tmp_path / "t", workers=2,
                     piece_bytes=8192, batch_bytes=4096)
    dataset = megatron_indexed_dataset().IndexedDataset(str(result.prefix))
    assert (result.documents, len(dataset.document_indices) - 1) == (2, 2)
    assert result.sequences == len(dataset) > 10
    tokenizer = load_tokenizer(str(bpe_tokenizer))
    pieces = [t for b in batches(expand_inputs([str(TEMPEST)]), piece_bytes=8192)
              for t in b.texts("text")]
    play, after = documents(result.prefix)
    # each piece ends with the EOD: Megatron's GPTDataset packs sequences, not documents
    assert play == [i for ids in tokenizer.encode(pieces) for i in [*ids, 0]]
    assert all(sequence[-1] == 0 for sequence in dataset)
    assert after == list(tokenizer.encode(["after"])[0]) + [0]


# ---------------------------------------------------------------------------- the format

def test_prepared_files_are_read_by_megatron_core(bpe_tokenizer, tmp_path):
    corpus = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    with corpus.open("a") as f:
        f.write("\n")  # a blank line is no document
    result = prepare([str(corpus), str(TEMPEST)], tokenizer=str(bpe_tokenizer),
                     output=tmp_path / "out" / "corpus", workers=0)
    assert (result.documents, result.empty_documents, result.dtype) == (4, 2, "uint16")

    tokenizer = load_tokenizer(str(bpe_tokenizer))
    texts = [t for t in DOCS if t.strip()] + [TEMPEST.read_text()]
    expected = [list(ids) + [0] for ids in tokenizer.encode(texts)]  # EOD <|endoftext|> = 0
    assert documents(result.prefix) == expected
    assert result.tokens == sum(map(len, expected))

    identity, dataset = read_record(result.prefix)
    assert identity == tokenizer.identity
    assert (dataset["documents"], dataset["tokens"], dataset["empty_documents_skipped"]) == \
        (4, result.tokens, 2)
    assert leftovers(tmp_path / "out") == ["corpus.bin", "corpus.idx", "corpus.tokenizer.json"]
    with open(f"{result.prefix}.idx", "rb") as f:  # Megatron's header, version 1, uint16 code 8
        assert f.read(18) == b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8])


def test_files_written_by_megatron_cores_builder_are_read_by_dsforge(tmp_path):
    """As Megatron-LM's tools/preprocess_data.py writes them: add_item + end_document, no
    dsforge record."""
    module = megatron_indexed_dataset()
    prefix = tmp_path / "megatron"
    dtype = module.DType.optimal_dtype(50257)
    builder = module.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    docs = [[5, 6, 7, 50256], [8, 50256], [9, 10, 11, 12, 50256]]
    for doc in docs:
        builder.add_item(torch.IntTensor(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")

    dataset, info = open_dataset(prefix)
    assert (info.documents, info.tokens, info.dtype, info.identity) == (3, 11, "uint16", None)
    assert [dataset[i].tolist() for i in range(3)] == docs


def test_a_vocabulary_of_65500_or_more_is_written_as_int32(tmp_path):
    pytest.importorskip("tokenizers", reason="needs the tokenizers package")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "big": 70_000, "small": 1, EOD: 2},
                                       unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    result = prepare([str(write_jsonl(tmp_path / "d.jsonl", ["big small big"]))],
                     tokenizer=str(tmp_path / "words.json"), output=tmp_path / "w", workers=0)
    assert result.dtype == "int32" and result.identity.vocab_size == 70_001
    assert documents(result.prefix) == [[70_000, 1, 70_000, 2]]


def test_open_dataset_refuses_incomplete_or_mismatched_files(tmp_path):
    result = prepare([str(TEMPEST)], tokenizer="bytes", output=tmp_path / "t", workers=0)
    record = Path(f"{result.prefix}.tokenizer.json")
    good = record.read_text()
    record.write_text(good.replace('"tokens": ', '"tokens": 1'))
    with pytest.raises(DataError, match="the record belongs to other files"):
        open_dataset(result.prefix)
    record.write_text("{}")
    with pytest.raises(DataError, match="is not a dsforge dataset record"):
        open_dataset(result.prefix)
    record.write_text(good)
    bin_path = Path(f"{result.prefix}.bin")
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 2)
    with pytest.raises(DataError, match="cut short"):
        open_dataset(result.prefix)
    Path(f"{result.prefix}.idx").unlink()
    with pytest.raises(DataError, match="t.idx missing") as exc:
        open_dataset(result.prefix)
    assert "dsforge data prepare" in exc.value.fix


# ---------------------------------------------------------------------------- determinism

def test_the_output_does_not_depend_on_the_number_of_workers(bpe_tokenizer, tmp_path):
    corpus = tempest_jsonl(tmp_path / "tempest.jsonl")
    outputs = {}
    for workers in (0, 1, 2):
        result = prepare([str(corpus), str(TEMPEST)], tokenizer=str(bpe_tokenizer),
                         output=tmp_path / f"w{workers}" / "t", workers=workers, batch_bytes=4096)
        outputs[workers] = [Path(f"{result.prefix}{suffix}").read_bytes()
                            for suffix in (".bin", ".idx", ".tokenizer.json")]
    assert result.documents > 500  # many batches went through the pool
    assert outputs[0] == outputs[1] == outputs[2]
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------------------- failures

@pytest.mark.parametrize("fault, raised", [("raise:3", RuntimeError),
                                           ("interrupt:3", KeyboardInterrupt)])
def test_a_failure_midway_leaves_nothing_that_looks_finished(fault, raised, bpe_tokenizer,
                                                            tmp_path, monkeypatch):
    corpus = tempest_jsonl(tmp_path / "tempest.jsonl")
    out = tmp_path / "out"
    monkeypatch.setenv(FAULT_ENV, fault)
    with pytest.raises(raised):
        prepare([str(corpus)], tokenizer=str(bpe_tokenizer), output=out / "t", workers=2,
                batch_bytes=2048)
    assert leftovers(out) == []
    assert multiprocessing.active_children() == []  # the pool was ended


@pytest.mark.parametrize("number, group, code", [(signal.SIGINT, True, 130),
                                                 (signal.SIGTERM, False, 143)],
                         ids=["ctrl-c-to-the-group", "sigterm"])
def test_a_stopped_command_ends_its_workers_and_removes_partial_files(number, group, code,
                                                                      tmp_path):
    """A real Ctrl-C to the process group (as a terminal sends it), or `kill PID`, while a
    worker is busy."""
    corpus = tempest_jsonl(tmp_path / "tempest.jsonl")
    out, marker = tmp_path / "out", uuid.uuid4().hex
    env = dict(os.environ, **{FAULT_ENV: "hang:0", "DSFORGE_TEST_MARK": marker})
    command = [sys.executable, "-m", "dsforge", "data", "prepare", str(corpus), "--tokenizer",
               "bytes", "--output", str(out / "t"), "--workers", "2"]
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True,
                               preexec_fn=as_foreground_job, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("t.bin.partial-*")) and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()
            time.sleep(0.2)
        time.sleep(1.0)  # the pool is running and batch 0 hangs in a worker
        (os.killpg if group else os.kill)(process.pid, number)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == code, stderr
    assert f"stopped by {signal.Signals(number).name}" in stderr and "Traceback" not in stderr
    assert leftovers(out) == []
    assert _processes_marked(marker) == []


def _processes_marked(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"DSFORGE_TEST_MARK={marker}".encode() in environ.split(b"\0"):
            found.append(int(pid))
    return found


def test_stale_partial_files_of_a_killed_run_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"t.bin.partial-{dead}"
    stale.write_bytes(b"half")
    prepare([str(TEMPEST)], tokenizer="bytes", output=tmp_path / "t", workers=0)
    assert leftovers(tmp_path) == ["t.bin", "t.idx", "t.tokenizer.json"]


# ---------------------------------------------------------------------------- bad input

BAD_JSONL = {
    "not json": ('{"text": "ok"}\n{"text": \n', "INPUT", "docs.jsonl:2", "is not a JSON object"),
    "a list": ('["a"]\n', "INPUT", "docs.jsonl:1", "not an object"),
    "no such key": ('{"body": "a"}\n', "--text-key", "text", "has no such key (its keys: 'body')"),
    "not a string": ('{"text": 3}\n', "--text-key", "text", "not a string"),
    "all empty": ('{"text": ""}\n{"text": " "}\n', "INPUT", None, "every document is empty"),
    "not utf-8": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "INPUT", "docs.jsonl:2", "is not UTF-8"),
}


@pytest.mark.parametrize("case", list(BAD_JSONL))
def test_bad_documents_are_refused_naming_the_place_and_a_fix(case, tmp_path):
    content, argument, value, message = BAD_JSONL[case]
    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(content) if isinstance(content, bytes) else docs.write_text(content)
    out = tmp_path / "out"
    with pytest.raises(DataError) as exc:
        prepare([str(tmp_path / "docs.jsonl")], tokenizer="bytes", output=out / "t", workers=1)
    assert exc.value.argument == argument and message in str(exc.value) and exc.value.fix
    if value:
        assert value in str(exc.value.value)
    assert leftovers(out) == []


def test_text_that_is_not_utf8_is_refused_with_its_byte_offset(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"fine text\n" * 3 + b"caf\xe9\n")
    with pytest.raises(DataError) as exc:
        prepare([str(bad)], tokenizer="bytes", output=tmp_path / "out" / "t", workers=0)
    assert "is not UTF-8 text" in str(exc.value) and "at byte 33" in str(exc.value)
    assert "iconv" in exc.value.fix
    assert leftovers(tmp_path / "out") == []


def test_a_file_that_fails_while_being_read_is_named(tmp_path, monkeypatch):
    """EIO or a permission lost midway (root reads any file, so the failure is simulated)."""
    good, bad = write_jsonl(tmp_path / "a.jsonl", ["one"]), write_jsonl(tmp_path / "b.jsonl", ["two"])
    real_open = open

    def failing_open(path, *args, **kwargs):
        if Path(path) == bad:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("dsforge.data.inputs.open", failing_open, raising=False)
    with pytest.raises(DataError) as exc:
        prepare([str(good), str(bad)], tokenizer="bytes", output=tmp_path / "out" / "t",
                workers=1)
    assert exc.value.argument == "INPUT" and exc.value.value == str(bad)
    assert "cannot be read (Permission denied)" in str(exc.value)
    assert leftovers(tmp_path / "out") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without read permission")
def test_an_unreadable_file_is_refused_before_anything_is_written(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["one"])
    path.chmod(0)
    with pytest.raises(DataError, match="permission denied"):
        prepare([str(path)], tokenizer="bytes", output=tmp_path / "out" / "t")


@pytest.mark.parametrize("make, message", [
    (lambda d: str(d / "missing.jsonl"), "no such file or folder"),
    (lambda d: str(d / "*.jsonl"), "this glob matches no file"),
    (lambda d: str(d), "this folder holds no corpus file"),
])
def test_an_empty_input_set_is_refused(make, message, tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=message) as exc:
        prepare([make(tmp_path)], tokenizer="bytes", output=tmp_path / "out" / "t")
    assert exc.value.argument == "INPUT" and exc.value.fix
    with pytest.raises(DataError, match="no input given"):
        prepare([], tokenizer="bytes", output=tmp_path / "out" / "t")


def test_the_output_is_not_replaced_without_overwrite(tmp_path):
    prepare([str(TEMPEST)], tokenizer="bytes", output=tmp_path / "t", workers=0)
    with pytest.raises(DataError, match="already exist") as exc:
        prepare([str(TEMPEST)], tokenizer="bytes", output=tmp_path / "t", workers=0)
    assert exc.value.argument == "--output" and "--overwrite" in exc.value.fix
    prepare([str(TEMPEST)], tokenizer="bytes", output=tmp_path / "t", workers=0, overwrite=True)
    with pytest.raises(DataError, match="dsforge adds .bin and .idx"):
        prepare([str(TEMPEST)], tokenizer="bytes", output=tmp_path / "t.bin", workers=0)


# ---------------------------------------------------------------------------- the command

def test_the_command_prepares_and_refuses_with_exit_codes(tmp_path):
    out = tmp_path / "t"
    ok = CliRunner().invoke(main, ["data", "prepare", str(TEMPEST), "--tokenizer", "bytes",
                                   "--output", str(out), "--workers", "0"])
    assert ok.exit_code == 0, ok.output
    assert "1 documents (0 empty skipped)" in ok.output and "MB/s" in ok.output
    assert open_dataset(out)[1].documents == 1

    missing = CliRunner().invoke(main, ["data", "prepare", str(TEMPEST), "--tokenizer",
                                        str(tmp_path / "tok.json"), "--output", str(tmp_path / "u")])
    assert missing.exit_code == 2
    assert "--tokenizer=" in missing.output and "Fix:" in missing.output
    assert not list(tmp_path.glob("u*"))

    no_input = CliRunner().invoke(main, ["data", "prepare", "--tokenizer", "bytes", "--output", "x"])
    assert no_input.exit_code == 2 and "INPUT" in no_input.output


def test_prepare_main_reports_an_interruption_with_exit_130(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "interrupt:0")
    code = prepare_main([str(TEMPEST)], tokenizer="bytes", output=tmp_path / "t", workers=0)
    assert code == 130 and "stopped by SIGINT" in capsys.readouterr().err
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------- the EOD token

def _special_tokenizer(path: Path, specials: list[str]) -> Path:
    """A word-level tokenizer.json whose special tokens are `specials` (and nothing named like
    an EOD unless listed)."""
    pytest.importorskip("tokenizers", reason="needs the tokenizers package")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.add_special_tokens([AddedToken(s, special=True) for s in specials])
    path.parent.mkdir(parents=True, exist_ok=True)
    words.save(str(path))
    return path


@pytest.mark.parametrize("name", ["<eod>", "<|eod|>"])
def test_megatron_and_neox_eod_names_are_recognised(name, tmp_path):
    """Issue 25 item 1: Megatron-LM's `<eod>` (and `<|eod|>`) end a document without --eod-token."""
    path = _special_tokenizer(tmp_path / "t.json", ["[UNK]", name])
    identity = load_tokenizer(str(path)).identity
    assert identity.eod_token == name and identity.eod_id == 3
    result = prepare([str(write_jsonl(tmp_path / "d.jsonl", ["a b", "b"]))], tokenizer=str(path),
                     output=tmp_path / "p", workers=0)
    assert documents(result.prefix) == [[1, 2, 3], [2, 3]]


def test_the_existing_eod_names_keep_their_order(tmp_path):
    path = _special_tokenizer(tmp_path / "t.json", ["<eod>", "</s>", "<|endoftext|>"])
    assert load_tokenizer(str(path)).identity.eod_token == "<|endoftext|>"


def test_im_end_is_the_eod_only_where_it_is_the_tokenizers_eos(tmp_path):
    """<|im_end|> ends a chat turn: the EOD only where a config names it the eos_token; a bare
    tokenizer.json with it is refused, and the refusal names it as the one candidate."""
    bare = _special_tokenizer(tmp_path / "bare.json", ["[UNK]", "<|im_start|>", "<|im_end|>"])
    with pytest.raises(DataError) as refused:
        load_tokenizer(str(bare))
    message = str(refused.value)
    assert refused.value.argument == "--tokenizer" and str(bare) in message
    assert "<eod>" in message and "<|im_end|>" in message
    assert "--eod-token '<|im_end|>'" in refused.value.fix  # the one candidate, ready to copy

    folder = tmp_path / "chat"
    _special_tokenizer(folder / "tokenizer.json", ["[UNK]", "<|im_start|>", "<|im_end|>",
                                                     "<|endoftext|>"])
    assert load_tokenizer(str(folder)).identity.eod_token == "<|endoftext|>"  # no config yet
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"}}))
    assert load_tokenizer(str(folder)).identity.eod_token == "<|im_end|>"
    assert load_tokenizer(str(folder / "tokenizer.json")).identity.eod_token == "<|im_end|>"


@pytest.mark.parametrize("config, expected", [
    ({"tokenizer_config.json": {"eos_token": "<end>"}}, "<end>"),
    ({"tokenizer_config.json": {"eos_token": {"content": "<end>"}}}, "<end>"),
    ({"special_tokens_map.json": {"eos_token": "<end>"}}, "<end>"),
    ({"tokenizer_config.json": {"eos_token": None}, "config.json": {"eos_token_id": 3}}, "<end>"),
    ({"generation_config.json": {"eos_token_id": [3, 4]}}, "<end>"),
])
def test_the_tokenizers_own_eos_token_is_the_eod_wherever_a_config_names_it(config, expected,
                                                                            tmp_path):
    """Any name, as long as a config calls it the eos: tokenizer_config.json or
    special_tokens_map.json's eos_token (a string or {"content": ...}), else config.json or
    generation_config.json's eos_token_id (the first of a list)."""
    folder = tmp_path / "model"
    _special_tokenizer(folder / "tokenizer.json", ["[UNK]", "<end>", "<other>"])
    for name, content in config.items():
        (folder / name).write_text(json.dumps(content))
    assert load_tokenizer(str(folder)).identity.eod_token == expected


@pytest.mark.parametrize("specials, fix", [
    (["[UNK]", "<sep>", "[PAD]"], "--eod-token '<sep>'"),
    (["[UNK]", "<x>", "<y>"], "one of <x>, <y>"),
    (["[UNK]", "[PAD]"], "has no special token"),
])
def test_the_refusal_says_which_token_would_be_picked(specials, fix, tmp_path):
    """The message lists the names looked for, in order, and the special tokens found; the
    fix names the candidate when there is exactly one (unknown, padding, mask and beginning
    tokens never end a document), else the candidates."""
    path = _special_tokenizer(tmp_path / "t.json", specials)
    result = CliRunner().invoke(main, ["data", "prepare", str(TEMPEST), "--tokenizer", str(path),
                                       "--output", str(tmp_path / "p")])
    assert result.exit_code == 2, result.output
    assert f"--tokenizer='{path}'" in result.output and "Fix:" in result.output
    assert fix in result.output.split("Fix:")[1]
    assert "<|endoftext|>, <|end_of_text|>, </s>, <eos>, <|eos|>, [EOS], <eod>, <|eod|>" in result.output
