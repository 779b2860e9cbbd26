"""Set up a rank (groups, model, engine, data) and run training steps with metrics."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.hardware import gpu_for_device_name
from dsforge.recipe import Resolved
from dsforge.runtime import checkpoint
from dsforge.runtime import data as data_mod
from dsforge.runtime.engine import init_distributed, init_parallel_state, wrap_with_deepspeed
from dsforge.runtime.init import init_layout_invariant
from dsforge.runtime.metrics import MetricsWriter, format_summary, make_record
from dsforge.runtime.model import build_model_chunks
from dsforge.runtime.step import step_pipelined, step_unpipelined
from dsforge.translate.deepspeed_config import deepspeed_config
from dsforge.translate.megatron import (build_transformer_config, gpt_model_kwargs,
                                        parallel_state_kwargs, transformer_config_kwargs)


class Trainer:
    def __init__(self, resolved: Resolved, *, device: torch.device, backend: str, run_dir: Path,
                 collective_timeout_s: float, resume: bool = False, measure: bool = False):
        self.resolved, self.device, self.run_dir = resolved, device, run_dir
        self.measure = measure
        recipe, layout = resolved.recipe, resolved.layout
        if device.type == "cpu":
            from dsforge.runtime import cpu_backend

            cpu_backend.activate()
        init_distributed(backend, collective_timeout_s)
        init_parallel_state(parallel_state_kwargs(layout), recipe.train.seed, collective_timeout_s)
        self.chunks = self._build_model()
        self.timers = self._schedule_timers() if measure and layout.pp > 1 else None
        self.engine = wrap_with_deepspeed(self.chunks, self._deepspeed_config())
        self.source = data_mod.open_source(source=recipe.data.source, seq_len=recipe.train.seq_len,
                                           vocab_size=recipe.model.vocab_size, seed=recipe.train.seed,
                                           token_dtype=recipe.data.token_dtype)
        self.flops = flops_per_token(recipe.model, recipe.train.seq_len,
                                     recipe.train.activation_checkpointing)
        gpu = gpu_for_device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.peak_flops = gpu.peak_bf16_flops if gpu else None  # None: MFU not available
        self.start_step = self._resume() if resume else 0
        self.reporter = self._is_reporter()
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl") if self.reporter else None
        if self.reporter and resume:
            self.metrics.keep_steps_before(self.start_step)
        self.progress = self._progress_bar() if self.reporter else None
        if self.reporter:
            self._write_manifest()

    def _deepspeed_config(self) -> dict:
        recipe, layout = self.resolved.recipe, self.resolved.layout
        config = deepspeed_config(train=recipe.train, zero=recipe.zero, layout=layout)
        if self.device.type == "cpu" and recipe.zero.offload_optimizer == "none":
            # torch's AdamW: DeepSpeed would otherwise compile its fused CPU Adam op on first
            # use (minutes on a small machine) to compute the same update.
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    def _build_model(self) -> list[torch.nn.Module]:
        recipe, layout = self.resolved.recipe, self.resolved.layout
        kwargs = transformer_config_kwargs(model=recipe.model, train=recipe.train, layout=layout)
        # Megatron's own init must run: it is what marks tensor-parallel parameters
        # (tensor_model_parallel, partition_dim), which DeepSpeed's gradient norm and init.py
        # rely on. init.py then overwrites the values layout-invariantly.
        on_cpu = self.device.type == "cpu"
        # Batched p2p with gloo pairs same-tag messages by posting order, and with pp=2 the
        # next and previous rank are the same peer: interleaved 1F1B then swaps tensors of
        # equal shape silently. Megatron's unbatched path orders sends/recvs by rank parity.
        kwargs.update(use_cpu_initialization=on_cpu, batch_p2p_comm=not on_cpu)
        config = build_transformer_config(kwargs)
        chunks = build_model_chunks(config, gpt_model_kwargs(model=recipe.model, layout=layout), self.device)
        init_layout_invariant(chunks, seed=recipe.train.seed, std=recipe.model.init_std,
                              num_layers=recipe.model.num_layers)
        return chunks

    def _resume(self) -> int:
        root = checkpoint.checkpoint_root(self.run_dir)
        record = checkpoint.latest_complete(root)
        if record is None:
            raise checkpoint.CheckpointError(f"no complete checkpoint under {root}")
        return checkpoint.load(self.engine, root, record["tag"], torch.distributed.get_rank())

    def save_checkpoint(self, steps_done: int, fault=None) -> None:
        checkpoint.save(self.engine, checkpoint.checkpoint_root(self.run_dir), step=steps_done,
                        recipe=asdict(self.resolved.recipe), world_size=self.resolved.layout.world_size,
                        rank=torch.distributed.get_rank(), fault=fault)

    def _schedule_timers(self):
        from dsforge.runtime.timers import ScheduleTimers

        timers = ScheduleTimers(self.device)
        for chunk in self.chunks:
            chunk.config.timers = timers  # Megatron's schedules report into config.timers
        return timers

    def _is_reporter(self) -> bool:
        from megatron.core import parallel_state as ps

        return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)

    def train_step(self, step: int) -> None:
        from megatron.core import parallel_state as ps

        layout, train = self.resolved.layout, self.resolved.recipe.train
        batches = data_mod.microbatches(self.source, step=step, global_batch=layout.global_batch,
                                        micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
                                        dp=layout.dp, dp_rank=ps.get_data_parallel_rank())
        lr = self.engine.get_lr()[0]  # the rate this step's update uses
        start = time.perf_counter()
        if layout.pp == 1:
            loss = step_unpipelined(self.engine, batches, self.device)
        else:
            loss = step_pipelined(self.engine, self.chunks, batches, seq_len=train.seq_len,
                                  micro_batch=layout.micro_batch, device=self.device)
        if loss is not None:  # mean over the data-parallel replicas (one host sync per step)
            torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
            loss = loss.item() / layout.dp
        elapsed = time.perf_counter() - start
        ended_at = time.time()
        if self.timers is not None:
            self.timers.end_step()
        if self.reporter:
            self._report(step, loss, lr, elapsed, ended_at)

    def _report(self, step: int, loss: float, lr: float, elapsed: float, ended_at: float) -> None:
        recipe, layout = self.resolved.recipe, self.resolved.layout
        record = make_record(
            step=step, warmup=step < recipe.train.timing_warmup, loss=loss,
            grad_norm=self.engine.get_global_grad_norm(), lr=lr,
            step_time_s=elapsed, tokens_per_step=layout.global_batch * recipe.train.seq_len,
            world_size=layout.world_size, flops_per_token=self.flops.model,
            hardware_flops_per_token=self.flops.hardware, peak_flops=self.peak_flops,
            device=self.device, ended_at=ended_at)
        self.metrics.write(record)
        self.progress.update(1)
        self.progress.set_postfix_str(_postfix(record))

    def _progress_bar(self):
        from tqdm import tqdm

        return tqdm(total=self.resolved.recipe.train.steps, desc=self.resolved.recipe.name,
                    unit="step", dynamic_ncols=True)

    def _write_manifest(self) -> None:
        from dsforge.runtime.manifest import environment_manifest

        manifest = environment_manifest(self.device, asdict(self.resolved.layout))
        (self.run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    def finish(self) -> None:
        self._write_rank_summary()
        if not self.reporter:
            return
        self.progress.close()
        summary = self.metrics.summary()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(format_summary(summary), flush=True)

    def _write_rank_summary(self) -> None:
        """RUN_DIR/ranks/rankNNNNN.json: what only this rank knows (its memory, its bubble)."""
        from megatron.core import parallel_state as ps

        from dsforge.runtime.metrics import peak_memory

        memory, source = peak_memory(self.device)
        skip = self.resolved.recipe.train.timing_warmup
        summary = {"rank": torch.distributed.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                   "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank(),
                   "peak_memory_bytes": memory, "memory_source": source,
                   "bubble_share": self.timers.median_bubble(skip) if self.timers else None,
                   "tensor_bytes": self._tensor_census()}
        directory = self.run_dir / "ranks"
        directory.mkdir(exist_ok=True)
        (directory / f"rank{summary['rank']:05d}.json").write_text(json.dumps(summary) + "\n")

    def _tensor_census(self) -> dict[str, int] | None:
        """Live model-state tensors after training, for `dsforge bench` (tensor_census.py)."""
        if not self.measure:
            return None
        from dsforge.runtime.tensor_census import live_tensor_bytes

        return live_tensor_bytes(self.engine, self.device)


def _postfix(r) -> str:
    mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
    norm = f"{r.grad_norm:.3f}" if r.grad_norm is not None else "n/a"
    return (f"loss {r.loss:.4f} | gnorm {norm} | lr {r.lr:.2e} | {r.step_time_s * 1e3:.0f} ms | "
            f"{r.tokens_per_s:,.0f} tok/s | MFU {mfu} | mem {r.peak_memory_bytes / 2**20:,.0f} MiB")
