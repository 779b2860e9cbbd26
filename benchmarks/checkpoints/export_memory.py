"""Export streams: peak resident memory of `dsforge export` on a ~1B-parameter checkpoint.

    python benchmarks/checkpoints/export_memory.py [--workdir /tmp/dsforge-export-bench]
        [--layers 18] [--hidden 2048] [--ffn 5632] [--vocab 32000] [--keep] [--reuse]

1. Writes a synthetic Llama-shaped checkpoint in dsforge's layout-free format
   (dsforge/ckpt/format.py) as a tp2 x dp2 ZeRO-1 run would: every tensor-parallel shard split
   into two data-parallel ranges, replicated parameters (norms) written by tensor-parallel rank
   0 only, three states per parameter (fp32, exp_avg, exp_avg_sq), four rank files, state.json,
   dsforge_complete.json with the resolved recipe and every file's size, checkpoints/latest.
   Each rank file is streamed: its header first, then one piece at a time, so the generator
   holds one piece.
2. Times the layout-free read path: StateReader.full for every parameter (fp32), in a child.
3. Runs `dsforge export RUN --to OUT` (fp32 and bf16) in a child, whose peak RSS is its own
   VmHWM (/proc/self/status, at exit), next to a bare `python -c "import dsforge.hf.export"`
   child. Results and the reading: README.md beside this file.

Prints the sizes (largest parameter, output shard, model) and the ratios of the peak to them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from dsforge.ckpt.format import (COMPLETE, FORMAT_VERSION, STATE_DIR, STATE_FILE,  # noqa: E402
                                 STATES, Piece, piece_key, rank_file)
from dsforge.hf.names import global_shapes, model_config  # noqa: E402
from dsforge.units import GiB

TP, DP = 2, 2


def recipe_dict(args) -> dict:
    from dsforge.recipe import Topology, resolve
    from dsforge.recipe.loader import build_recipe

    raw = {
        "name": "bench-1b",
        "model": {"num_layers": args.layers, "hidden_size": args.hidden,
                  "ffn_hidden_size": args.ffn, "num_attention_heads": args.hidden // 128,
                  "num_kv_heads": args.hidden // 128, "vocab_size": args.vocab,
                  "max_seq_len": 2048},
        "parallel": {"tp": TP, "pp": 1, "dp": DP},
        "zero": {"stage": 1},
        "train": {"seq_len": 2048, "global_batch": 8, "micro_batch": 1, "steps": 100,
                  "lr": 3e-4, "precision": "bf16", "checkpoint_every": 50},
        "data": {"source": str(REPO / "data" / "tempest.u16.bin")},
    }
    resolved = resolve(build_recipe(raw), Topology(world_size=TP * DP))
    return json.loads(json.dumps(dataclasses.asdict(resolved.recipe)))


def split_rule(name: str) -> tuple[int | None, int]:
    """(tp_dim, stride) as Megatron shards the parameter (dsforge/ckpt/names.py)."""
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return 0, 1
    if name.endswith("linear_fc1.weight"):
        return 0, 2  # [gate; up], rank r holds [gate_r; up_r]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1, 1
    return None, 1  # norms: replicated


def plan_pieces(shapes: dict[str, tuple[int, ...]]) -> dict[int, list[Piece]]:
    """rank -> its pieces; rank = dp_rank * TP + tp_rank."""
    by_rank: dict[int, list[Piece]] = {r: [] for r in range(TP * DP)}
    for name, full in shapes.items():
        dim, stride = split_rule(name)
        tp_size = TP if dim is not None else 1
        local = list(full)
        if dim is not None:
            local[dim] //= TP
        numel = 1
        for s in local:
            numel *= s
        half = numel // 2
        for tp_rank in range(tp_size):
            for dp_rank, (start, count) in enumerate(((0, half), (half, numel - half))):
                for state in STATES:
                    by_rank[dp_rank * TP + tp_rank].append(Piece(
                        key=piece_key(state, name, tp_rank, start), name=name, state=state,
                        full_shape=tuple(full), tp_dim=dim, stride=stride, tp_rank=tp_rank,
                        tp_size=tp_size, local_shape=tuple(local), start=start, numel=count))
    return by_rank


def write_rank_file(path: Path, pieces: list[Piece], seed: int) -> None:
    """A safetensors file as safetensors' save_file lays it out (keys sorted), streamed."""
    pieces = sorted(pieces, key=lambda p: p.key)
    fields: dict[str, object] = {"__metadata__": {
        "format": "pt", "pieces": json.dumps([p.to_json() for p in pieces])}}
    offset = 0
    for p in pieces:
        fields[p.key] = {"dtype": "F32", "shape": [p.numel], "data_offsets": [offset, offset + 4 * p.numel]}
        offset += 4 * p.numel
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for p in pieces:
            if p.state == "fp32":
                data = torch.randn(p.numel, generator=g) * 0.02
            else:  # moments: cheap to make; export never reads them
                data = torch.full((p.numel,), 1e-4 if p.state == "exp_avg" else 1e-8)
            f.write(data.view(torch.uint8).numpy())
            del data


def make_checkpoint(run: Path, recipe: dict, padded: int) -> dict:
    model = model_config(recipe)
    shapes = global_shapes(model, padded)
    tag = "step00000050"
    directory = run / "checkpoints" / tag
    (directory / STATE_DIR).mkdir(parents=True)
    for rank, pieces in plan_pieces(shapes).items():
        write_rank_file(directory / STATE_DIR / rank_file(rank), pieces, seed=rank)
    (directory / STATE_DIR / STATE_FILE).write_text(json.dumps({
        "format": FORMAT_VERSION, "step": 50, "ranks": TP * DP, "padded_vocab_size": padded,
        "adam_step": 50, "param_group": {}, "lr_scheduler": None, "global_steps": 50,
        "global_samples": 400, "skipped_steps": 0, "loss_scaler": None}))
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / COMPLETE).write_text(json.dumps(
        {"step": 50, "tag": tag, "world_size": TP * DP, "recipe": recipe, "files": files}))
    (run / "checkpoints" / "latest").write_text(tag)
    return shapes


# The child reports its own peak from /proc/self/status at exit: VmHWM belongs to the process
# image (exec starts a new one). wait4's ru_maxrss would not do: a child forked from this
# process (torch imported, ~0.4 GiB) inherits this process's high-water mark.
PEAK = """
import atexit, runpy, sys

def _peak():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print("PEAK", *(fields[k].split()[0] for k in ("VmHWM", "RssAnon", "RssFile")), file=sys.stderr)

atexit.register(_peak)
sys.argv = sys.argv[1:]
if sys.argv[0] == "-c":
    sys.argv = sys.argv[1:]
    exec(compile(sys.argv[0], "<child>", "exec"), {"__name__": "__main__"})
else:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def child(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS GiB, output) of `python ARGV...` (argv: "-c CODE ARGS" or
    "MODULE ARGS")."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK, *argv], cwd=REPO, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{argv} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    peak = [line.split()[1:] for line in proc.stderr.splitlines() if line.startswith("PEAK ")][-1]
    hwm, anon, file = (int(v) * 1024 / GiB for v in peak)
    print(f"    (at exit: RssAnon {anon:.3f} GiB, RssFile {file:.3f} GiB)")
    return wall, hwm, proc.stdout


READ_ALL = """
import sys, time
from dsforge.ckpt.reader import open_state
start = time.perf_counter()
reader = open_state(sys.argv[1])
opened = time.perf_counter() - start
total = 0
for name in reader.names():
    total += reader.full(name, "fp32").numel()
print(f"opened {opened:.2f} s; joined {total} elements in {time.perf_counter() - start:.2f} s")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dsforge-export-bench"))
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (for --reuse)")
    parser.add_argument("--reuse", action="store_true",
                        help="measure the checkpoint a --keep run left in --workdir")
    args = parser.parse_args()
    work = args.workdir
    recipe = recipe_dict(args)
    padded = -(-args.vocab // (128 * TP)) * 128 * TP
    if not args.reuse:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
    try:
        start = time.perf_counter()
        if args.reuse:
            shapes = global_shapes(model_config(recipe), padded)
        else:
            shapes = make_checkpoint(work / "run", recipe, padded)
        made = time.perf_counter() - start
        numels = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
        params = sum(numels.values())
        largest = max(numels, key=numels.get)
        state_bytes = sum(f.stat().st_size for f in (work / "run").rglob("*.safetensors"))
        print(f"checkpoint: {params / 1e9:.3f} B parameters ({len(shapes)} tensors), tp{TP} x dp{DP}"
              f" pieces, {state_bytes / GiB:.2f} GiB of layout-free state"
              + ("" if args.reuse else f", written in {made:.1f} s"))
        print(f"largest parameter: {largest} {tuple(shapes[largest])} = "
              f"{numels[largest] * 4 / GiB:.3f} GiB fp32")

        wall, rss, _ = child(["-c", "import dsforge.hf.export, dsforge.ckpt.reader"])
        base = rss
        print(f"baseline (import dsforge.hf.export): peak RSS {base:.3f} GiB, {wall:.1f} s")
        ckpt = work / "run" / "checkpoints" / "step00000050"
        wall, rss, out = child(["-c", READ_ALL, str(ckpt)])
        print(f"read path (StateReader.full, every parameter, fp32): {out.strip()}; "
              f"wall {wall:.1f} s, peak RSS {rss:.3f} GiB")

        rows = []
        for dtype in ("fp32", "bf16"):
            out_dir = work / f"hf-{dtype}"
            wall, rss, out = child(["dsforge", "export", str(work / "run"),
                                    "--to", str(out_dir), "--dtype", dtype,
                                    "--max-shard-size", args.max_shard_size])
            shards = sorted(out_dir.glob("*.safetensors"))
            shard = max(p.stat().st_size for p in shards)
            model = sum(p.stat().st_size for p in shards)
            item = 4 if dtype == "fp32" else 2
            big = numels[largest] * 4  # read as fp32, whatever the output dtype
            rows.append((dtype, wall, rss, big, shard, model))
            print(f"export {dtype}: {wall:.1f} s, peak RSS {rss:.3f} GiB; largest parameter "
                  f"{big / GiB:.3f} GiB (fp32 read; {numels[largest] * item / GiB:.3f} GiB "
                  f"written), largest shard {shard / GiB:.3f} GiB ({len(shards)} shards), "
                  f"model {model / GiB:.3f} GiB; above baseline {rss - base:.3f} GiB = "
                  f"{(rss - base) * GiB / big:.2f} x largest parameter, "
                  f"{(rss - base) * GiB / model:.3f} x model")
            shutil.rmtree(out_dir, ignore_errors=True)
        import safetensors

        print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, torch {torch.__version__}, safetensors "
              f"{safetensors.__version__}")
        print(json.dumps({"params": params, "state_gib": state_bytes / GiB, "baseline_gib": base,
                          "exports": [dict(zip(("dtype", "seconds", "peak_rss_gib",
                                                    "largest_param_bytes", "largest_shard_bytes",
                                                    "model_bytes"), r)) for r in rows]}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
