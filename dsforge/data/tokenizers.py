"""Tokenizers for preparing corpora; nothing is ever downloaded.

`load_tokenizer(name)` accepts
- "bytes": UTF-8 bytes are the ids 0-255 and 256 is the end-of-document token (vocabulary 257).
  The same ids as dsforge/tokenizer.py, which the flat token files use, plus the EOD.
- a local tokenizer.json (the `tokenizers` library: pip install 'dsforge[data]');
- a local Hugging Face model folder: its tokenizer.json when it has one, otherwise
  `transformers.AutoTokenizer` with local_files_only (pip install 'dsforge[hf]').

Every tokenizer encodes with the tokenizer's own special tokens (add_special_tokens=True, a
BOS where its post-processor adds one), as Megatron-LM's and GPT-NeoX's preprocessing tools do;
the end-of-document token is appended by prepare.py, not here. The EOD is `eod_token` when
given, else the tokenizer's own eos where a config beside it names one (tokenizer_config.json /
special_tokens_map.json `eos_token`, else config.json / generation_config.json `eos_token_id`;
a transformers tokenizer's `eos_token`), else the first token named like one (EOD_NAMES: the
names of the common tokenizer families, Megatron-LM's `<eod>` and GPT-NeoX's `<|endoftext|>`).
`<|im_end|>` ends a chat turn, so it is the EOD only where a config names it the eos.

Worker processes rebuild a tokenizer from its `TokenizerSpec` (a name and an EOD token: small
and picklable), as Megatron-LM's preprocess_data.py builds one per worker in its initializer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from dsforge import tokenizer as byte_level
from dsforge.data.errors import DataError, missing_library
from dsforge.data.identity import TokenizerIdentity, is_record

BYTES = "bytes"
BYTES_EOD = byte_level.VOCAB_SIZE  # 256: the first id after the bytes
ARGUMENT = "--tokenizer"
# Tokens that end a document by their name alone, first found first: GPT-2/GPT-NeoX/Qwen,
# Llama 3, Llama 2/Mistral/T5, Gemma, others; Megatron-LM's own (its GPT2 tokenizer's `eod`).
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<eod>",
             "<|eod|>")
# Ends a chat turn (ChatML), not a document: the EOD only where a config names it the eos_token.
EOS_ONLY_NAMES = ("<|im_end|>",)
# Special tokens that never end a document (unknown, padding, masks, beginnings): left out of
# the candidates a refusal suggests.
_NEVER_EOD = ("unk", "pad", "mask", "cls", "bos", "begin", "start", "<s>")
# Files of a model folder that define its tokenization (hashed into the identity).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


@dataclass(frozen=True)
class TokenizerSpec:
    name: str  # "bytes", a tokenizer.json or a model folder
    eod_token: str | None = None


class Tokenizer(Protocol):
    identity: TokenizerIdentity

    def encode(self, texts: Sequence[str]) -> list[Sequence[int]]:
        """Ids of each text, with the tokenizer's special tokens and without the EOD."""


def load_tokenizer(spec: TokenizerSpec | str) -> Tokenizer:
    spec = TokenizerSpec(spec) if isinstance(spec, str) else spec
    if spec.name == BYTES:
        return ByteTokenizer(spec.eod_token)
    path = Path(spec.name).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return JsonTokenizer(spec, path / "tokenizer.json", config_dir=path)
        return TransformersTokenizer(spec, path)
    if path.is_file():
        config_dir = path.parent if path.name == "tokenizer.json" else None
        return JsonTokenizer(spec, path, config_dir=config_dir)
    raise DataError(ARGUMENT, spec.name, "no such file or folder (nothing is downloaded: a hub "
                    "name such as 'gpt2' is not looked up)",
                    "give a local tokenizer.json, a local Hugging Face model folder (e.g. one "
                    "saved with save_pretrained or fetched beforehand with `hf download`), "
                    "or 'bytes'")


class ByteTokenizer:
    def __init__(self, eod_token: str | None = None):
        if eod_token is not None:
            raise DataError("--eod-token", eod_token, "the bytes tokenizer has one fixed "
                            f"end-of-document id ({BYTES_EOD})", "leave --eod-token out")
        description = (f"dsforge bytes: ids 0-{BYTES_EOD - 1} are UTF-8 bytes, "
                       f"{BYTES_EOD} ends a document")
        self.identity = TokenizerIdentity(
            kind="bytes", name=BYTES, path=None, vocab_size=BYTES_EOD + 1, eod_id=BYTES_EOD,
            eod_token=None, special_ids={"<eod>": BYTES_EOD},
            sha256=hashlib.sha256(description.encode()).hexdigest())

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [byte_level.encode(text) for text in texts]


class JsonTokenizer:
    """A tokenizer.json through the `tokenizers` library."""

    def __init__(self, spec: TokenizerSpec, file: Path, *, config_dir: Path | None):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise missing_library("tokenizers", "data", ARGUMENT, spec.name) from None
        try:
            self._tokenizer = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise _not_a_tokenizer(spec.name, file, exc) from None
        self._encode_batch = getattr(self._tokenizer, "encode_batch_fast", None) \
            or self._tokenizer.encode_batch  # _fast (0.20+) skips the offsets
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        specials = {token.content: int(index) for index, token in
                    self._tokenizer.get_added_tokens_decoder().items() if token.special}
        configured = _configured_eos(config_dir, vocab) if config_dir else None
        eod_token = _eod_token(spec, vocab, specials, configured, configs_read=bool(config_dir))
        self.identity = TokenizerIdentity(
            kind="tokenizers", name=spec.name, path=str(Path(spec.name).resolve()),
            vocab_size=max(vocab.values()) + 1, eod_id=vocab[eod_token], eod_token=eod_token,
            special_ids=specials, sha256=_sha256([file]))

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._encode_batch(list(texts), add_special_tokens=True)]


class TransformersTokenizer:
    """A model folder without tokenizer.json (e.g. vocab.json + merges.txt, or a SentencePiece
    model) through transformers.AutoTokenizer, never reaching the hub."""

    def __init__(self, spec: TokenizerSpec, folder: Path):
        present = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
        if not present:
            raise DataError(ARGUMENT, spec.name, "this folder holds no tokenizer files "
                            f"(none of {', '.join(TOKENIZER_FILES)})",
                            "give the folder a Hugging Face tokenizer was saved to, or its "
                            "tokenizer.json")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise missing_library("transformers", "hf", ARGUMENT, spec.name) from None
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises many kinds here
            raise DataError(ARGUMENT, spec.name, f"transformers cannot load a tokenizer from "
                            f"this folder ({type(exc).__name__}: {_first_line(exc)})",
                            "check that the folder is a complete save_pretrained output, or "
                            "give a tokenizer.json") from None
        vocab = self._tokenizer.get_vocab()
        specials = dict(zip(self._tokenizer.all_special_tokens, self._tokenizer.all_special_ids))
        configured = self._tokenizer.eos_token or _configured_eos(folder, vocab)
        eod_token = _eod_token(spec, vocab, specials, configured)
        self.identity = TokenizerIdentity(
            kind="transformers", name=spec.name, path=str(folder.resolve()),
            vocab_size=max(max(vocab.values()) + 1, len(self._tokenizer)),
            eod_id=vocab[eod_token], eod_token=eod_token, special_ids=specials,
            sha256=_sha256(present))

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tokenizer(list(texts), add_special_tokens=True, verbose=False)["input_ids"]


def _eod_token(spec: TokenizerSpec, vocab: dict[str, int], specials: dict[str, int],
               configured: str | None, *, configs_read: bool = True) -> str:
    """--eod-token, else the eos a config names (`configured`), else the first of EOD_NAMES the
    tokenizer has; a refusal that names the candidate when there is one. `configs_read`: False
    for a tokenizer file not named tokenizer.json, whose folder's configs are not read."""
    if spec.eod_token is not None:
        if spec.eod_token not in vocab:
            raise DataError("--eod-token", spec.eod_token, f"is not a token of {spec.name} "
                            f"(its special tokens: {', '.join(specials) or 'none'})",
                            "give one of its special tokens")
        return spec.eod_token
    if configured in vocab:
        return configured
    for name in EOD_NAMES:
        if name in specials or name in vocab:
            return name
    candidates = [token for token in specials if _may_end_documents(token)]
    if len(candidates) == 1:
        fix = (f"pass --eod-token {_quoted(candidates[0])} if that token ends a document (it is "
               "the one special token that could), or the token that does")
    elif candidates:
        fix = f"pass --eod-token with the token that ends a document, one of {', '.join(candidates)}"
    else:
        fix = ("pass --eod-token with the token that ends a document (this tokenizer has no "
               "special token that could: add one, e.g. <|endoftext|>, when training it)")
    configs = ("no eos_token in a config beside it (tokenizer_config.json, "
               "special_tokens_map.json, config.json, generation_config.json)" if configs_read
               else "no config read (only a file named tokenizer.json or a model folder has "
               "its folder's configs read)")
    raise DataError(ARGUMENT, spec.name, f"has no end-of-document token: {configs} and none of "
                    f"{', '.join(EOD_NAMES)} (the first found would be picked; "
                    f"{', '.join(EOS_ONLY_NAMES)} only where a config names it the eos_token); "
                    f"its special tokens: {', '.join(specials) or 'none'}", fix)


def _may_end_documents(token: str) -> bool:
    lowered = token.lower()
    return not any(word in lowered for word in _NEVER_EOD)


def _quoted(token: str) -> str:
    """A token as a shell word: '<|im_end|>' (a token with a quote in it is rare)."""
    return "'" + token.replace("'", "'\\''") + "'"


def _configured_eos(folder: Path, vocab: dict[str, int]) -> str | None:
    """The eos a model folder's configs name: tokenizer_config.json's or special_tokens_map.json's
    eos_token (a string or {"content": ...}), else config.json's or generation_config.json's
    eos_token_id (an id or a list of them, the first taken) as its token."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        value = _config_value(folder / name, "eos_token")
        if isinstance(value, dict):  # {"content": "</s>", "lstrip": false, ...}
            value = value.get("content")
        if isinstance(value, str):
            return value
    tokens = None
    for name in ("config.json", "generation_config.json"):
        value = _config_value(folder / name, "eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            tokens = tokens or {index: token for token, index in vocab.items()}
            if value in tokens:
                return tokens[value]
    return None


def _config_value(file: Path, key: str):
    try:
        return json.loads(file.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _not_a_tokenizer(name: str, file: Path, exc: Exception) -> DataError:
    try:
        is_dsforge_record = is_record(json.loads(file.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        is_dsforge_record = False
    if is_dsforge_record:
        return DataError(ARGUMENT, name, "is the record dsforge writes beside a prepared "
                         "dataset, not a tokenizer", "give the tokenizer its 'tokenizer.path' "
                         "names")
    return DataError(ARGUMENT, name, f"is not a Hugging Face tokenizer.json ({_first_line(exc)})",
                     "give a tokenizer.json saved by the tokenizers or transformers library, a "
                     "model folder, or 'bytes'")


def _sha256(files: Sequence[Path]) -> str:
    """Of one file: its bytes (whatever it is called); of several: their names and bytes."""
    if len(files) == 1:
        return hashlib.sha256(files[0].read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda f: f.name):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
