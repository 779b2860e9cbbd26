"""A Hugging Face model folder read without torch: config.json and the safetensors headers.

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
every tensor's dtype, shape and offsets, so a folder's tensors are known from their headers
alone. `model.init_from`'s checks against a recipe's model (rules I1-I5) are
recipe/init_from.py's; reading the tensors themselves is load.py's.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.problems import Problem

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
LLAMA_ARCH, MIXTRAL_ARCH = "LlamaForCausalLM", "MixtralForCausalLM"
FIELD = "model.init_from"
_MAX_HEADER = 100 << 20  # bytes; safetensors itself refuses headers over 100 MB


@dataclass(frozen=True)
class Tensor:
    """One tensor of the folder, from its file's header."""

    file: str
    dtype: str
    shape: tuple[int, ...]


class FolderError(ValueError):
    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of `folder` (FolderError I1 when there is none that reads as an object)."""
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a directory"
        raise FolderError(folder_problem("I1", folder, f"{what}; model.init_from names a Hugging Face "
                                   "model folder (config.json and safetensors weights)",
                                   "give the path of such a folder (relative paths are read "
                                   "from the recipe's directory), or remove model.init_from"))
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FolderError(folder_problem("I1", folder, f"has no {CONFIG}, so it is not a Hugging Face "
                                   "model folder", "name the folder that holds config.json and "
                                   "the *.safetensors files")) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FolderError(folder_problem("I1", folder, f"its {CONFIG} cannot be read as JSON ({exc})",
                                   "use an intact model folder")) from None
    if not isinstance(config, dict):
        raise FolderError(folder_problem("I1", folder, f"its {CONFIG} is not a JSON object",
                                   "use an intact model folder"))
    return config


def architecture_of(config: dict[str, Any]) -> str | None:
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    return {"llama": LLAMA_ARCH, "mixtral": MIXTRAL_ARCH}.get(config.get("model_type"))


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the folder's safetensors weights, from the headers (FolderError I5)."""
    index, single = folder / INDEX, folder / SINGLE
    if index.is_file():
        files = _weight_map(index, folder)
    elif single.is_file():
        files = None
    else:
        raise FolderError(_no_safetensors(folder))
    tensors: dict[str, Tensor] = {}
    for file in sorted(set(files.values())) if files is not None else [SINGLE]:
        for name, tensor in _header(folder / file, folder).items():
            if files is None or files.get(name) == file:
                tensors[name] = tensor
    if files is not None:
        absent = sorted(set(files) - set(tensors))
        if absent:
            raise FolderError(folder_problem("I5", folder, f"{INDEX} names {len(absent)} tensors its "
                                       f"files do not hold ({some_names(absent)})",
                                       "use an intact model folder (download it again)"))
    return tensors


def _no_safetensors(folder: Path) -> Problem:
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles:
        return folder_problem(
            "I5", folder, f"holds PyTorch pickles ({some_names(pickles)}) and no safetensors; dsforge "
            "reads safetensors only and never unpickles (loading a pickle can run code)",
            "convert the folder once, where you trust its files: python -c \"from transformers "
            "import AutoModelForCausalLM as M; M.from_pretrained('IN').save_pretrained('OUT')\" "
            "(writes safetensors), then set model.init_from: OUT")
    return folder_problem("I5", folder, f"holds no weights ({SINGLE}, or {INDEX} and its shards)",
                    "name the folder that holds the *.safetensors files")


def _weight_map(index: Path, folder: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        files = data["weight_map"]
        if not isinstance(files, dict) or not all(isinstance(f, str) for f in files.values()):
            raise ValueError("weight_map is not a mapping of tensor names to file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise FolderError(folder_problem("I5", folder, f"its {INDEX} cannot be read ({exc!r})",
                                   "use an intact model folder")) from None
    outside = sorted({f for f in files.values() if Path(f).name != f})
    if outside:
        raise FolderError(folder_problem("I5", folder, f"its {INDEX} names files outside the folder "
                                   f"({some_names(outside)})", "use an intact model folder"))
    missing = sorted({f for f in files.values() if not (folder / f).is_file()})
    if missing:
        raise FolderError(folder_problem("I5", folder, f"its {INDEX} names files that are not there "
                                   f"({some_names(missing)})",
                                   "download the missing shards, or use an intact folder"))
    return files


def _header(path: Path, folder: Path) -> dict[str, Tensor]:
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length).decode("utf-8"))
        return {name: Tensor(path.name, str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
                for name, entry in header.items() if name != "__metadata__"}
    except (OSError, struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError,
            AttributeError) as exc:
        raise FolderError(folder_problem("I5", folder, f"{path.name} is not a safetensors file "
                                   f"({type(exc).__name__}: {exc})",
                                   "use an intact model folder (download it again)")) from None


def some_names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def folder_problem(rule: str, folder: Path | str, message: str, fix: str) -> Problem:
    return Problem(rule=rule, fields={FIELD: str(folder)}, message=message, fix=fix)
