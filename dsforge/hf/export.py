"""`dsforge export`: a dsforge checkpoint -> a Hugging Face model folder.

In this order, so nothing is written before every check has passed and nothing half-written
is ever presented as a model folder:
  1. the target: OUT absent or an empty directory, no OUT.partial beside it (EX8);
  2. the checkpoint: RUN_DIR -> RUN_DIR/checkpoints/latest, or a checkpoint directory given
     directly; its completion marker read and every file it lists present with its size
     (runtime/checkpoint/save_load.py: CK1, CK3, CK4); it holds layout-free pieces (EX6);
  3. the model: exportable (config.py: EX1-EX4) and the checkpoint's tensors exactly the
     recipe's model (EX7);
  4. OUT.partial written: tokenizer files, config.json, generation_config.json, safetensors
     shards streamed one tensor at a time (shards.py); renamed to OUT at the end. Any failure
     removes OUT.partial.
The weights come from the fp32 master copy when the checkpoint has one (more exact than a
bf16/fp16 training copy when exporting fp32), else from the training-dtype copy; the default
output dtype is the training precision's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click
import torch

from dsforge.ckpt.format import COMPLETE, LATEST
from dsforge.ckpt.trust import CheckpointError, check_complete, newest_published, read_marker
from dsforge.files import fsync_directory, write_atomic
from dsforge.hf.config import TORCH_DTYPES, export_problems, generation_config, hf_config
from dsforge.hf.names import architecture, global_shapes, model_config, pieces, to_hf
from dsforge.hf.shards import Entry, parse_size, write_shards
from dsforge.hf.tokenizer import tokenizer_files
from dsforge.job.run_dir import RunDir
from dsforge.problems import EXIT_INVALID, Problem, print_problems

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Files a checkpoint holds when written before the layout-free pieces (DeepSpeed's engine
# files and dsforge's RNG, expert and completion files).
_NATIVE = re.compile(r"((bf16_)?zero_pp_rank_\d+_)?mp_rank_\d+_(model|optim)_states\.pt"
                     r"|expp_rank_\d+_mp_rank_\d+_optim_states\.pt"
                     r"|layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt"
                     r"|dsforge_(rng|experts)_rank\d+\.pt|" + re.escape(COMPLETE))


class ExportRefused(Exception):
    """Why a checkpoint was not exported: every problem names the thing, the value and the fix."""

    def __init__(self, problems: list[Problem]):
        self.problems = tuple(problems)
        super().__init__("\n".join(map(str, self.problems)))


@dataclass
class Exported:
    out: Path
    checkpoint: Path
    step: int
    architecture: str
    dtype: str
    state: str  # "fp32" (master weights) or "param" (the training-dtype copy)
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def export(source: Path, out: Path, *, dtype: str | None = None, max_shard_size: str = "5GB",
           open_state: Callable[[Path], Any] | None = None) -> Exported:
    """Export the checkpoint `source` names to the Hugging Face folder `out`. `open_state` is
    the checkpoint reader (default: dsforge.ckpt.reader.open_state). Raises ExportRefused."""
    max_bytes = _shard_bytes(max_shard_size)
    partial = _check_target(out)
    checkpoint, record = find_checkpoint(source)
    reader = _open(checkpoint, open_state)
    recipe = reader.recipe
    refused = export_problems(recipe)
    if refused:
        raise ExportRefused(refused)
    model = model_config(recipe)
    _check_tensors(reader, model, checkpoint)
    precision = recipe["train"]["precision"]
    dtype = dtype or precision
    state = "fp32" if reader.has_state("fp32") else "param"
    result = Exported(out=out, checkpoint=checkpoint, step=record["step"],
                      architecture=architecture(model), dtype=dtype, state=state)
    if DTYPES[dtype].itemsize > DTYPES[precision].itemsize and state == "param":
        result.notes.append(f"{dtype} weights from the {precision} training copy: this "
                            "checkpoint holds no fp32 master weights")
    partial.mkdir(parents=True)
    try:
        result.files = _write(partial, reader, model, recipe, dtype=dtype, state=state,
                              max_bytes=max_bytes, notes=result.notes, reader_dir=checkpoint)
        _publish(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return result


def _write(folder: Path, reader, model, recipe: dict[str, Any], *, dtype: str, state: str,
           max_bytes: int, notes: list[str], reader_dir: Path) -> list[str]:
    tokenizer = tokenizer_files(recipe, folder)
    notes.extend(tokenizer.notes)
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id}
    write_atomic(folder / "config.json",
                 json.dumps(hf_config(model, dtype=dtype, **ids), indent=2) + "\n")
    write_atomic(folder / "generation_config.json",
                 json.dumps(generation_config(**ids), indent=2) + "\n")
    padded = reader.padded_vocab_size
    entries = [Entry(p.hf_name, p.shape, DTYPES[dtype]) for p in pieces(model, padded)]
    tensors = ((piece.hf_name, tensor) for piece, tensor in
               to_hf(model, padded, lambda name: _read(reader, name, state)))
    try:
        shards = write_shards(folder, entries, tensors, max_bytes)
    except _ReadFailed as exc:
        raise ExportRefused([Problem(rule="EX6", fields={"checkpoint": str(reader_dir)},
                                     message=f"a tensor cannot be read: {exc}",
                                     fix="export an intact checkpoint, or restore its files")]) from None
    except ValueError as exc:  # a tensor whose shape is not the recipe's model
        raise ExportRefused([_other_model(str(exc))]) from None
    except OSError as exc:
        raise ExportRefused([Problem(rule="EX8", fields={"--to": str(folder)},
                                     message=f"cannot be written: {exc}",
                                     fix="free space there or choose another place")]) from None
    return shards + tokenizer.written + ["config.json", "generation_config.json"]


def _publish(partial: Path, out: Path) -> None:
    if out.is_dir():
        out.rmdir()  # empty (checked first); a directory cannot be renamed over otherwise
    os.rename(partial, out)
    fsync_directory(out.parent)


def _shard_bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ExportRefused([Problem(rule="EX9", fields={"--max-shard-size": text},
                                     message=f"is not a size ({exc})",
                                     fix="give bytes with a unit, e.g. 5GB, 500MB or 2GiB")]) from None


def _check_target(out: Path) -> Path:
    """OUT.partial, after checking that OUT may be written (EX8)."""
    partial = out.with_name(out.name + ".partial")
    problem = None
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        problem = Problem(rule="EX8", fields={"--to": str(out)}, message="exists and is not a "
                          "directory", fix="name a new directory, or remove this file")
    elif out.is_dir() and any(out.iterdir()):
        problem = Problem(rule="EX8", fields={"--to": str(out)},
                          message="exists and is not empty; export writes a whole folder and "
                                  "overwrites nothing",
                          fix="name a new or empty directory, or remove this one")
    elif partial.exists() or partial.is_symlink():
        problem = Problem(rule="EX8", fields={"--to": str(out)},
                          message=f"{partial} exists: an export to it is running or was killed",
                          fix=f"wait for the running export, or remove {partial}")
    if problem:
        raise ExportRefused([problem])
    return partial


def find_checkpoint(source: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory `source` names (a run directory, its checkpoints/ folder or
    one checkpoint) and its completion record, checked complete (CK1, CK3, CK4, EX5)."""
    try:
        return _find_checkpoint(source)
    except CheckpointError as exc:
        raise ExportRefused([exc.problem or Problem(rule="CK3", fields={"checkpoint": str(source)},
                                                    message=str(exc))]) from None


def _saved_steps(source: Path) -> str:
    """The checkpoints beside a missing one (RUN_DIR/checkpoints/step00000009 mistyped)."""
    beside = source.parent.glob("step*") if source.parent.is_dir() else []
    saved = sorted(p.name for p in beside if (p / COMPLETE).exists())
    return f"; this run saved {', '.join(saved)}" if saved else ""


def _find_checkpoint(source: Path) -> tuple[Path, dict[str, Any]]:
    if not source.is_dir():
        what = "is not a directory" if source.exists() else "does not exist"
        raise ExportRefused([Problem(rule="EX5", fields={"checkpoint": str(source)}, message=what,
                                     fix="name a run directory or one of its checkpoints "
                                         "(RUN_DIR/checkpoints/stepNNNNNNNN)" + _saved_steps(source))])
    if (source / COMPLETE).exists():
        root, tag = source.parent, source.name
    else:
        checkpoints = RunDir(source).checkpoints
        root = checkpoints if checkpoints.is_dir() else source
        tag = newest_published(root)
        if tag is None:
            raise ExportRefused([Problem(
                rule="EX5", fields={"checkpoint": str(source)},
                message=f"holds no complete checkpoint (no {LATEST} file naming one, no "
                        f"{COMPLETE}; a checkpoint whose save never finished has none)",
                fix="name a run directory whose run saved a checkpoint "
                    "(train.checkpoint_every > 0), or a checkpoint directory "
                    "RUN_DIR/checkpoints/stepNNNNNNNN")])
    record = read_marker(root, tag)
    check_complete(root, record)
    return root / tag, record


def _open(checkpoint: Path, open_state: Callable[[Path], Any] | None):
    old = Problem(rule="EX6", fields={"checkpoint": str(checkpoint)},
                  message="was written by a dsforge that saved only layout-bound DeepSpeed "
                          "files, which export cannot read",
                  fix="resume it once with this dsforge (dsforge run RECIPE --run-dir RUN_DIR "
                      "--resume, with train.checkpoint_every set) and let it save, then export "
                      "that checkpoint")
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    if all(_NATIVE.fullmatch(str(p.relative_to(checkpoint))) for p in files):
        raise ExportRefused([old])
    if open_state is None:
        try:
            from dsforge.ckpt.reader import open_state
        except ImportError:
            raise ExportRefused([old]) from None
    try:
        return open_state(checkpoint)
    except CheckpointError as exc:
        raise ExportRefused([exc.problem or _unreadable(checkpoint, exc)]) from None
    except (RuntimeError, OSError, ValueError) as exc:  # the reader's StateError is a RuntimeError
        raise ExportRefused([_unreadable(checkpoint, exc)]) from None


def _unreadable(checkpoint: Path, exc: Exception) -> Problem:
    return Problem(rule="EX6", fields={"checkpoint": str(checkpoint)},
                   message=f"its layout-free state cannot be read: {exc}",
                   fix="export an intact checkpoint (an earlier one: RUN_DIR/checkpoints/"
                       "stepNNNNNNNN), or restore the files named")


class _ReadFailed(Exception):
    pass


def _read(reader, name: str, state: str) -> torch.Tensor:
    try:
        return reader.full(name, state=state)
    except (RuntimeError, OSError, ValueError) as exc:
        raise _ReadFailed(f"{name} ({state}): {exc}") from exc


def _check_tensors(reader, model, checkpoint: Path) -> None:
    """EX7: the checkpoint holds exactly the tensors of the recipe's model."""
    if reader.padded_vocab_size < model.vocab_size:
        raise ExportRefused([_other_model(
            f"its padded vocabulary ({reader.padded_vocab_size}) is smaller than "
            f"model.vocab_size ({model.vocab_size})")])
    expected, found = set(global_shapes(model, reader.padded_vocab_size)), set(reader.names())
    missing, extra = sorted(expected - found), sorted(found - expected)
    if missing or extra:
        parts = [f"{len(names)} {what} ({_some(names)})"
                 for names, what in ((missing, "missing"), (extra, "not in the model")) if names]
        raise ExportRefused([_other_model("its tensors are not the recipe's model's: "
                                          + "; ".join(parts))])


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _other_model(message: str) -> Problem:
    return Problem(rule="EX7", fields={}, message=f"the checkpoint does not hold the model its "
                   f"recipe describes: {message}",
                   fix="the checkpoint's files were changed or mixed with another run's: export "
                       "an intact checkpoint")


def export_main(source: Path, out: Path, *, dtype: str | None, max_shard_size: str) -> int:
    """The command: export, print what was written or every problem; the exit status."""
    try:
        result = export(source, out, dtype=dtype, max_shard_size=max_shard_size)
    except ExportRefused as exc:
        print_problems(f"dsforge export {source}", exc.problems)
        return EXIT_INVALID
    weights = "fp32 master weights" if result.state == "fp32" else "training weights"
    click.echo(f"exported step {result.step} of {result.checkpoint} as {result.architecture} "
               f"({TORCH_DTYPES[result.dtype]}, from the {weights}) to {result.out}:")
    click.echo("  " + ", ".join(result.files))
    for note in result.notes:
        click.echo(f"  note: {note}", err=True)
    return 0
