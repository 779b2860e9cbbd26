"""The tokenizer files an exported model folder carries.

Where the tokenizer comes from: the recipe's data.tokenizer, else the tokenizer recorded beside
the run's prepared dataset (PREFIX.tokenizer.json, data/identity.py). What is written:
- a model folder: its tokenizer files (data/tokenizers.py TOKENIZER_FILES) as they are;
- a tokenizer.json alone: the file, plus a tokenizer_config.json naming
  PreTrainedTokenizerFast (which loads a tokenizer.json as it is, with no model-specific
  normalisation) and the end-of-document token as eos_token;
- "bytes" (dsforge's UTF-8 byte ids, EOD 256): nothing, since no Hugging Face tokenizer has
  these ids; config.json still records eos_token_id 256.
The tokenizer must still be the one the run trained with: when the dataset's record holds a
hash and the file hashes otherwise now, nothing is copied and the export says so. A tokenizer
that is no longer on this machine is reported, not fatal: the weights are still the model.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dsforge.data.errors import DataError
from dsforge.data.identity import TokenizerIdentity, read_record
from dsforge.data.tokenizers import (BYTES, BYTES_EOD, TOKENIZER_FILES, TokenizerSpec,
                                     load_tokenizer)
from dsforge.files import write_atomic


@dataclass
class TokenizerFiles:
    written: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the user should know
    eos_token_id: int | None = None


def tokenizer_files(recipe: Mapping[str, Any], folder: Path) -> TokenizerFiles:
    """Copy the run's tokenizer into `folder`; what was written and the EOS id."""
    name, recorded = _tokenizer_of(recipe.get("data") or {})
    if name is None:
        return TokenizerFiles(notes=["no tokenizer: the run recorded none (synthetic data, or a "
                                     "dataset prepared by another tool); config.json has no "
                                     "eos_token_id"])
    if name == BYTES:
        return TokenizerFiles(eos_token_id=BYTES_EOD, notes=[
            f"no tokenizer files: the run used dsforge's bytes tokenizer (ids 0-{BYTES_EOD - 1} "
            f"are UTF-8 bytes, {BYTES_EOD} ends a document), which no Hugging Face tokenizer "
            "class reproduces"])
    eod_token = recorded.eod_token if recorded else None  # the dataset's --eod-token
    try:
        identity = load_tokenizer(TokenizerSpec(name, eod_token)).identity
    except DataError as exc:
        return TokenizerFiles(notes=[f"no tokenizer files: the run's tokenizer cannot be loaded "
                                     f"here ({exc})"])
    if recorded is not None and recorded.sha256 != identity.sha256:
        return TokenizerFiles(notes=[f"no tokenizer files: {name} has changed since the dataset "
                                     f"was prepared with it (sha256 {recorded.sha256[:12]} then, "
                                     f"{identity.sha256[:12]} now)"])
    identity = _trained_eod(identity, (recipe.get("data") or {}).get("eod_id"))
    return TokenizerFiles(written=_copy(Path(name).expanduser(), identity, folder),
                          eos_token_id=identity.eod_id)


def _trained_eod(identity: TokenizerIdentity, eod_id: int | None) -> TokenizerIdentity:
    """`identity` with the end-of-document id the run trained with: data.eod_id where the
    recipe names one (a token file, or a dataset without a record), else the tokenizer's."""
    if eod_id is None or eod_id == identity.eod_id:
        return identity
    token = next((t for t, i in identity.special_ids.items() if i == eod_id), None)
    return dataclasses.replace(identity, eod_id=eod_id, eod_token=token)


def _tokenizer_of(data: Mapping[str, Any]) -> tuple[str | None, TokenizerIdentity | None]:
    """The tokenizer the run named or its dataset recorded, and the dataset's record of it."""
    source = data.get("source")
    prefix = source[0]["path"] if isinstance(source, list) and source else source
    recorded = None
    if isinstance(prefix, str) and prefix != "synthetic":
        try:
            found = read_record(prefix)
        except DataError:
            found = None
        recorded = found[0] if found else None
    name = data.get("tokenizer")
    if name is None and recorded is not None:
        name = BYTES if recorded.kind == BYTES else recorded.path
    return name, recorded


def _copy(path: Path, identity: TokenizerIdentity, folder: Path) -> list[str]:
    if path.is_file() and (path.name != "tokenizer.json"
                           or not (path.parent / "tokenizer_config.json").is_file()):
        shutil.copyfile(path, folder / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": identity.eod_token,
                  "clean_up_tokenization_spaces": False}
        write_atomic(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
        return ["tokenizer.json", "tokenizer_config.json"]
    source = path if path.is_dir() else path.parent
    written = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in written:
        shutil.copyfile(source / name, folder / name)
    return written
