#!/usr/bin/env python3
"""The peer a user writes instead of a framework: transformers' LlamaForCausalLM in a plain
PyTorch loop on one GPU, built to be a fair, well-tuned baseline (issue 39), not a straw man.

    python3 benchmarks/gpu/peer_loop.py --model MODEL.json --data PREFIX --seq-len 4096 \
        --micro-batch 1 --global-batch 8 --steps 12 --warmup 2 --compile layers --out OUT.json

What it does, as the transformers and PyTorch documentation recommend for one GPU:
- the model built and initialised on the GPU (no slow CPU init), with
  torch's SDPA attention (flash / cuDNN kernels) and fp32 master weights under bf16 autocast:
  the same precision as dsforge's bf16 (bf16 matmuls, fp32 weights, gradients reduced and
  Adam states in fp32; 16 bytes a parameter either way);
- torch's fused AdamW (one kernel for all parameters), dsforge's recipe's learning rate,
  warm-up, weight decay, betas and gradient clipping;
- `--compile layers`: every decoder layer compiled (`module.compile()`, torchtitan's regional
  compilation: one graph compiled once and reused by the identical layers); `none`: eager;
- `--checkpointing auto`: no activation checkpointing first; if the first step runs out of
  memory, everything is freed and the run starts again with full checkpointing (transformers'
  gradient_checkpointing_enable, non-reentrant): the fastest setting that fits, as a user
  tuning a loop would find it. `none` or `full` forces one.
- tokens: the kit's corpus (a Megatron .bin of uint16 ids) read in order, seq_len + 1 tokens a
  sample; the same text and tokenizer as dsforge's runs, not the same sample order.

It writes OUT.json: its settings, versions, each step's time and loss, the peak memory, the
median step time of the measured steps and tokens/s. MFU is computed by the kit with
dsforge's formula (kit_peers.py), so both frameworks are counted the same way.
`--device cpu` runs the same loop on the CPU (fp32, for the kit's tests).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the shape, as kit_peers.model_json writes it")
    p.add_argument("--data", type=Path, required=True, help="a Megatron dataset prefix (PREFIX.bin)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the figures")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-steps", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--compile", choices=("none", "layers"), default="none")
    p.add_argument("--checkpointing", choices=("auto", "none", "full"), default="auto")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def build_model(shape: dict, device, checkpointing: bool, compile_layers: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["ffn_hidden_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=shape["max_seq_len"],
        rope_theta=float(shape["rotary_base"]), rms_norm_eps=shape["norm_epsilon"],
        tie_word_embeddings=shape["tie_embeddings"], initializer_range=shape["init_std"],
        attention_bias=False, mlp_bias=False, use_cache=False, attn_implementation="sdpa")
    with device:  # built and initialised (transformers' own init) on the GPU: no slow CPU init
        model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    model.train()
    return model


class Tokens:
    """The corpus's ids in order: sample i is ids[i*s : i*s + s + 1]."""

    def __init__(self, prefix: Path, seq_len: int):
        import numpy as np

        self.ids = np.memmap(prefix.with_name(prefix.name + ".bin"), dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.samples = (len(self.ids) - 1) // seq_len
        self.next = 0

    def batch(self, size: int, device):
        import numpy as np
        import torch

        rows = []
        for _ in range(size):
            start = (self.next % self.samples) * self.seq_len
            rows.append(np.asarray(self.ids[start:start + self.seq_len + 1], dtype=np.int64))
            self.next += 1
        data = torch.from_numpy(np.stack(rows)).to(device, non_blocking=True)
        return data[:, :-1], data[:, 1:]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to the peak, then cosine to 10% over the run (dsforge's defaults:
    train.lr_decay cosine, min_lr_ratio 0.1)."""
    if step < args.lr_warmup_steps:
        return args.lr * (step + 1) / args.lr_warmup_steps
    progress = (step - args.lr_warmup_steps) / max(1, args.steps - args.lr_warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(model, optimizer, tokens: Tokens, args, device, autocast) -> float:
    import torch

    accumulation = args.global_batch // args.micro_batch
    total = torch.zeros((), device=device)
    for _ in range(accumulation):
        inputs, labels = tokens.batch(args.micro_batch, device)
        with autocast():
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        (loss / accumulation).backward()
        total += loss.detach() / accumulation
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def run(args: argparse.Namespace, shape: dict, checkpointing: bool) -> dict:
    import contextlib

    import torch

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    model = build_model(shape, device, checkpointing, args.compile == "layers")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=args.lr,
                                  betas=(0.9, 0.95), eps=1e-8, fused=gpu)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if gpu else contextlib.nullcontext
    tokens = Tokens(args.data, args.seq_len)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    steps = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        sync()
        started = time.perf_counter()
        loss = float(train_step(model, optimizer, tokens, args, device, autocast))  # waits
        sync()
        steps.append({"step": step, "step_time_s": time.perf_counter() - started, "loss": loss,
                      "warmup": step < args.warmup})
        print(f"peer_loop: step {step} loss {loss:.4f} {steps[-1]['step_time_s']:.3f} s", flush=True)
    return {"steps": steps, "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if gpu else None}


def first_fit(args: argparse.Namespace, shape: dict) -> tuple[dict, str]:
    """The run at the fastest checkpointing that fits, and what was tried."""
    import torch

    order = {"auto": (False, True), "none": (False,), "full": (True,)}[args.checkpointing]
    tried = []
    for checkpointing in order:
        try:
            return run(args, shape, checkpointing), "; ".join(tried + ["full" if checkpointing else "none"])
        except torch.OutOfMemoryError:
            if checkpointing or len(order) == 1:
                raise
        # Out of the except clause, the error and the frames holding the model are gone.
        tried.append("none ran out of memory")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    raise AssertionError("unreachable")


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.global_batch % args.micro_batch:
        print("peer_loop: --global-batch must be a multiple of --micro-batch", file=sys.stderr)
        return 2
    shape = json.loads(args.model.read_text())
    result, checkpointing = first_fit(args, shape)
    measured = [s["step_time_s"] for s in result["steps"] if not s["warmup"]]
    median = statistics.median(measured) if measured else None
    tokens = args.global_batch * args.seq_len
    out = {"framework": "transformers+torch loop", "versions": versions(),
           "settings": {"compile": args.compile, "checkpointing": checkpointing,
                        "attention": "sdpa", "optimizer": "torch AdamW (fused)" if args.device == "cuda"
                        else "torch AdamW", "precision": "bf16 autocast, fp32 weights"
                        if args.device == "cuda" else "fp32", "micro_batch": args.micro_batch},
           "seq_len": args.seq_len, "global_batch": args.global_batch, "global_batch_tokens": tokens,
           "measured_steps": len(measured), "median_step_time_s": median,
           "tokens_per_s": tokens / median if median else None, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"peer_loop: {len(measured)} measured steps, median {median:.3f} s, "
          f"{out['tokens_per_s']:,.0f} tokens/s ({checkpointing})" if median else "peer_loop: nothing measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
