"""The unfused loss's peak memory per logit on the CPU backend: Megatron's output layer and
vocab-parallel cross-entropy in bf16 (`model.kernels: torch`), one layer of the tiny model at a
large vocabulary, so the logits dominate the process's peak RSS.

    python tools/loss_peak_memory.py --vocab 65536 --tokens 2048

Prints the rise of the resident set's high-water mark (reset just before the forward) over
the forward and over the backward, per logit; the memory
model counts 6 bytes (estimate/memory.py logits_bytes). Its own process: the model needs a
process group, and the peak RSS is the process's."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dsforge.calibrate.layer_timing import build_layers, recipe_shaped, synthetic_batch  # noqa: E402
from dsforge.calibrate.optimizer_timing import init_world  # noqa: E402
from dsforge.recipe import resolve_file  # noqa: E402

SEQ_LEN = 512


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS: resident now, VmHWM: its high-water mark), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def reset_peak() -> None:
    """Start the high-water mark afresh from what is resident now (Linux 4.0+): the peak of
    the imports and the model's build would otherwise hide the loss's."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(vocab: int, tokens: int) -> dict[str, float]:
    micro_batch = max(1, tokens // SEQ_LEN)
    resolved = resolve_file(REPO / "recipes" / "tiny.yaml",
                            ["parallel.dp=1", f"model.vocab_size={vocab}", "model.kernels=torch",
                             f"model.max_seq_len={SEQ_LEN}", f"train.seq_len={SEQ_LEN}",
                             f"train.micro_batch={micro_batch}", "train.precision=bf16"],
                            world_size=1)
    init_world(torch.device("cpu"))
    one = recipe_shaped(resolved, 1, 0)
    model, _ = build_layers(one, torch.device("cpu"))
    model = model.to(torch.bfloat16)
    ids, positions = synthetic_batch(one, torch.device("cpu"))
    gc.collect()
    reset_peak()
    start = _status_bytes("VmRSS")
    loss = model(ids, positions, None, labels=ids)
    forward = _status_bytes("VmHWM")
    loss.float().mean().backward()
    logits = ids.numel() * vocab
    return {"forward": (forward - start) / logits,
            "backward": (_status_bytes("VmHWM") - start) / logits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    rise = measure(args.vocab, args.tokens)
    print(f"V {args.vocab:,}, {args.tokens:,} tokens: the peak RSS rose {rise['forward']:.2f} "
          f"bytes a logit in the forward, {rise['backward']:.2f} by the end of the backward "
          "(the memory model: 6)")


if __name__ == "__main__":
    main()
