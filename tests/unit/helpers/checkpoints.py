"""A checkpoint on disk that looks like dsforge saved it (ckpt/trust.py checks its `latest`,
its completion marker and its files), without training a model."""

from __future__ import annotations

import json
from pathlib import Path

RECIPE = {"name": "t", "model": {"num_layers": 2}, "parallel": {"tp": 1}, "zero": {"stage": 1},
          "train": {"steps": 6}, "data": {"source": "synthetic"}, "cluster": None}
FILES = {"mp_rank_00_model_states.pt": 100, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 300,
         "zero_pp_rank_1_mp_rank_00_optim_states.pt": 300, "dsforge_rng_rank00000.pt": 20,
         "dsforge_rng_rank00001.pt": 20}


def fake_checkpoint(run_dir: Path, step: int = 3, files: dict[str, int] | None = FILES,
                    world_size: int = 2, recipe: dict = RECIPE) -> Path:
    """Checkpoint `step` of 2 ranks in `run_dir`, published as `latest`; its root. `files`
    None: a marker without a file list (as older saves wrote it)."""
    root = run_dir / "checkpoints"
    tag = f"step{step:08d}"
    (root / tag).mkdir(parents=True)
    for name, size in (files or FILES).items():
        (root / tag / name).write_bytes(b"x" * size)
    record = {"step": step, "tag": tag, "world_size": world_size, "recipe": recipe}
    if files is not None:
        record["files"] = files
    (root / tag / "dsforge_complete.json").write_text(json.dumps(record))
    (root / "latest").write_text(tag)
    return root
