"""A Hugging Face folder's tensors as dsforge global tensors, one global tensor at a time.

`model.init_from` starts a model from a Llama or Mixtral folder: every rank asks, for each of
its own parameters, for that parameter's global tensor (runtime/assemble/init.py), and keeps its shard.
`HFWeights.full(name)` reads only the Hugging Face tensors that make that one tensor
(names.by_source: q/k/v for linear_qkv, gate/up for linear_fc1), from the file the index names
(safetensors' safe_open memory-maps it and reads a tensor's bytes on request), so a rank's
peak is its largest full parameter, never the model. The folder was checked before any rank
started (recipe/init_from.py, rules I1-I5); the reads here only fail on a folder changed since.

The vocabulary rows Megatron pads (to a multiple of 128 x tp) are zeros (names._assemble), as a
drawn model's are: the model masks their logits out of every loss and they get no gradient
(runtime/assemble/vocab.py), so the imported model's loss is the folder's on every tp.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from dsforge.hf.folder import INDEX, SINGLE, read_tensors
from dsforge.hf.names import by_source, global_tensor
from dsforge.schema import ModelConfig


class HFWeights:
    """The global tensors of `model` from the safetensors of `folder`; a context manager. The
    files one global tensor is read from are closed once it is read, so an importing rank
    holds one parameter's pages at a time, not the folder's (docs/export.md)."""

    def __init__(self, folder: Path, model: ModelConfig, padded_vocab: int):
        self.folder, self.model, self.padded_vocab = Path(folder), model, padded_vocab
        self._parts = by_source(model, padded_vocab)
        self._files = {name: t.file for name, t in read_tensors(self.folder).items()}
        self._open: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc) -> None:
        self._close_files()

    def names(self) -> list[str]:
        """Every global tensor name the model has."""
        return list(self._parts)

    def full(self, name: str) -> torch.Tensor:
        """The global tensor `name` (vocabulary tensors padded to padded_vocab with zeros)."""
        if name not in self._parts:
            raise KeyError(f"{name} is not a tensor of the recipe's model as a Hugging Face "
                           f"{'Mixtral' if self.model.moe else 'Llama'} holds it")
        parts = self._parts[name]
        try:
            return global_tensor(self.model, self.padded_vocab, parts,
                                 {p.hf_name: self.read_tensor(p.hf_name) for p in parts})
        finally:  # pages read through an open map stay resident (ckpt/reader.py): one tensor's only
            self._close_files()

    def _close_files(self) -> None:
        self._open.clear()
        self._stack.close()
        self._stack = contextlib.ExitStack()

    def read_tensor(self, hf_name: str) -> torch.Tensor:
        file = self._files.get(hf_name)
        if file is None:
            raise KeyError(f"{self.folder} holds no tensor {hf_name} (in {SINGLE} or the files "
                           f"{INDEX} names)")
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = self._stack.enter_context(
                safe_open(str(self.folder / file), framework="pt", device="cpu"))
        return self._open[file].get_tensor(hf_name)
