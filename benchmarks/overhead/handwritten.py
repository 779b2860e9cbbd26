"""The baseline for dsforge's overhead benchmark: a minimal hand-written training script.

It trains the same model as recipes/tiny.yaml (or tiny_pp.yaml with --pp 2) by calling
DeepSpeed and Megatron-Core directly, the way a user without dsforge would: no recipe, no
validation, no metrics file, no heartbeat, no progress bar. Launch it with DeepSpeed's
launcher, like dsforge launches its ranks:

    python -m deepspeed.launcher.runner --num_gpus 2 benchmarks/overhead/handwritten.py \
        --steps 40 --out /tmp/handwritten.json

Two things come from dsforge on purpose, because they define *what* is trained rather than
the glue around it: the two layer modules plugged into Megatron's local spec (RMSNorm,
SDPA attention; dsforge/runtime/assemble/layers.py) and, on CPU, the CPU backend that lets
Megatron-Core run without CUDA at all (dsforge/runtime/assemble/cpu_backend.py).
Rank 0 (the last pipeline stage's first rank with --pp 2) writes each step's end time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher adds it
    return parser.parse_args()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        from dsforge.runtime.assemble import cpu_backend

        cpu_backend.activate()

    import deepspeed
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from dsforge.runtime.assemble.layers import RMSNorm, SDPAttention

    backend = "nccl" if cuda else "gloo"
    torch.distributed.init_process_group(backend, rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(dist_backend=backend)
    ps.initialize_model_parallel(pipeline_model_parallel_size=args.pp, create_gloo_process_groups=False)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    seq_len, micro_batch, grad_accum = 128, 2, (2 if args.pp == 1 else 4)
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TransformerConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, pipeline_model_parallel_size=args.pp,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, bf16=cuda, params_dtype=dtype,
        pipeline_dtype=dtype, use_cpu_initialization=not cuda, batch_p2p_comm=cuda)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256,
                     max_sequence_length=256, position_embedding_type="rope", rotary_base=10000,
                     share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()).to(device)

    dp = ps.get_data_parallel_world_size()
    ds_config = {
        "train_batch_size": micro_batch * grad_accum * dp, "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum, "gradient_clipping": 1.0, "steps_per_print": 10**6,
        "zero_optimization": {"stage": args.zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": not cuda}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps,
                                                           "warmup_num_steps": 2}},
    }
    if cuda:
        ds_config["bf16"] = {"enabled": True}
    if args.pp > 1:
        ds_config["managed_gradient_accumulation"] = False  # the schedule accumulates; step() reduces
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config, mpu=_Mpu(ps))

    generator = torch.Generator().manual_seed(1234 + ps.get_data_parallel_rank())
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(micro_batch, -1)

    def microbatch():
        tokens = torch.randint(0, 256, (micro_batch, seq_len + 1), generator=generator).to(device)
        return tokens[:, :-1], tokens[:, 1:]

    def forward_step(iterator, model):
        tokens, labels = next(iterator)
        output = model(tokens, positions, None, labels=labels)
        return output, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

    reporter = ps.is_pipeline_last_stage() and ps.get_data_parallel_rank() == 0
    ends = []
    for _ in range(args.steps):
        batches = [microbatch() for _ in range(grad_accum)]
        if args.pp == 1:
            losses = []
            for tokens, labels in batches:
                loss = engine(tokens, positions, None, labels=labels).float().mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            loss = torch.stack(losses).mean()
        else:
            results = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                num_microbatches=grad_accum, seq_length=seq_len, micro_batch_size=micro_batch,
                forward_only=False)
            engine.step()
            loss = torch.stack([r["loss"] for r in results]).mean() if reporter else None
        if loss is not None:
            torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
            loss.item()
        ends.append(time.time())
    if reporter:
        with open(args.out, "w") as f:
            json.dump({"step_end_times": ends}, f)
    torch.distributed.barrier()


class _Mpu:
    """DeepSpeed asks the mpu for a model-parallel rank/size that parallel_state spells differently."""

    def __init__(self, ps):
        self.ps = ps

    def __getattr__(self, name):
        return getattr(self.ps, name)

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank(group=self.ps.get_model_parallel_group())

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size(group=self.ps.get_model_parallel_group())


if __name__ == "__main__":
    main()
