"""Peak memory per GPU: model states per ZeRO stage, activations, buffers (docs/memory-and-bubble.md).

Everything is per pipeline rank (ranks hold different layers, the embedding and the output
layer), and the reported figure is the worst rank. Bytes, not GiB.

Model states (Rajbhandari et al., ZeRO; Psi = parameters on this GPU after TP/PP/EP, N = the
data-parallel ranks that share them: dp for dense weights, expert-dp for expert weights),
mixed precision with Adam:
  params     2 Psi            (stage 3: 2 Psi / N)
  grads      2 Psi            (stages 2, 3: 2 Psi / N)
  optimizer  12 Psi           (stages 1-3: 12 Psi / N): fp32 master weights + Adam m and v
  -> 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N: the published ZeRO formulas.
Two moments compete for the peak (DeepSpeed 0.19.8's code, measured by the census of
`dsforge bench` at "backward" and "optimizer"):
  the last backward: the states above, activations, the reduce bucket, and the buffers:
    ZeRO-3 working set: the largest layer gathered, 16-bit weights and grads (4 x its params).
  the optimizer step, after the activations (and at stages 1-2 the bucket) are freed: DeepSpeed makes the
    fp32 gradient it steps with from a flattened 16-bit copy of the gradient partition
    (stage_1_and_2.py `step`, stage3.py `_prepare_fp32_grad_for_sub_group`): 4 + 2 bytes per
    element, one parameter group at a time; ZeRO-3 one sub-group (`sub_group_size`, 1e9) at a
    time. ZeRO-1 first frees the 16-bit gradients outside its partition, so every stage holds
    2 Psi / N of them then. ZeRO-0 in 16 bits is DeepSpeed's 16-bit wrapper (also for bf16:
    its BF16_Optimizer is only for ZeRO-1 with fp32 accumulation or its own pipeline engine):
    around a torch AdamW (every train.adam_impl but `deepspeed`) FP16_UnfusedOptimizer, which
    gives each fp32 master an fp32 copy of its gradient, 4 bytes; around DeepSpeed's FusedAdam
    FP16_Optimizer, which converts every gradient to fp32, then flattens them, 4 + 4 bytes;
    either next to the 2 Psi of 16-bit gradients. fp32 training: the flattened copy is the
    gradient (4 bytes), and ZeRO-0 makes none (torch's AdamW steps the weights and their .grad).
  Counted at the backward (as before) the fp32 partition made 30B ZeRO-3 on 8 x 80 GB (which
  LLM-Foundry trained) look 10 GiB too large. The states plus 4 Psi / N equal DeepSpeed's
  estimate_zero2_model_states_mem_needs (2 Psi + 18 Psi/N); ZeRO-3's plus the working set
  exceed estimate_zero3_model_states_mem_needs by the 2 Psi/N partition of 16-bit parameters,
  which that estimator leaves out (both tested).
Reduce bucket (its own component, `bucket`): stages 1-3 allocate the whole reduce_bucket_size
  in the gradient dtype, whatever the model's size: 2 (fp32: 4) bytes x reduce_bucket_size.
  Stages 1 and 2 (stage_1_and_2.py `setup_buckets`, contiguous_gradients, which translate
  sets) allocate it at the first gradient of a backward and free it in the backward's
  epilogue, so it is live at the backward's peak; stage 3 keeps it (stage3.py).
  With pp > 1, ZeRO-2 reduce-scatters after every chunk backward (runtime/loop/step.py): its
  gradients stay partitioned (2 Psi / N) and the bucket is the price: on a small pipeline stage
  it can exceed the saving 2 Psi (1 - 1/N) over ZeRO-1.
fp32 training keeps 4-byte params and grads and 8 bytes of Adam state; ZeRO 1 and 2 add their
own fp32 copy of the partition (12 Psi / N in all), as measured; ZeRO-3 does not.
Optimizer offload moves optimizer state and the fp32 gradient partition to the CPU.

Activations (Korthikanti et al. 2022, re-derived for SwiGLU, GQA and no dropout) per layer,
per microbatch, 16-bit, with fused (flash) attention, in units of s*b (tokens):
  attention: norm input 2h, QKV input 2h, Q 2*heads*d, K and V 4*groups*d, core output 2*heads*d
  MLP:       norm input 2h, fc1 input 2h, fc1 output 4*ffn (gate and up), fc2 input 2*ffn
  MoE MLP:   router input 2h, then per routed copy (top_k): fc1 input 2h, fc1 out 4*ffn_e,
             fc2 input 2*ffn_e
Tensor parallelism divides everything except the norm and linear inputs (8h), which sequence
parallelism divides too. Unfused attention adds the s x s scores and probabilities
(4 * heads * s bytes per token). Selective checkpointing drops that s x s term; full
checkpointing keeps only each layer's input (2h, /tp with SP) plus one layer recomputed.
Pipeline ranks hold several microbatches at once: 1F1B rank r holds min(pp - r, m); the
interleaved schedule holds (pp - r - 1) * 2 + (v - 1) * pp + 1 model-chunk microbatches
(Megatron-Core's warmup count + 1), i.e. (1 + (p-1)/(p v)) x the 1F1B memory on rank 0.
The last rank adds the loss's memory for one microbatch: 2-byte logits and 4-byte fp32 loss
inputs over the vocabulary; with Liger's fused linear cross-entropy (model.kernels liger at
tp 1) no logits are kept, only the output layer's weight gradient and the input's gradient,
which it makes in the forward, and one chunk of tokens' logits (logits_bytes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Callable

from dsforge.estimate.params import attention_params, mlp_params, router_params, stage_layers
from dsforge.recipe.resolve import Layout
from dsforge.schema import ModelConfig, TrainConfig, ZeroConfig, padded_vocab_size

# DeepSpeed's default zero_optimization.reduce_bucket_size (elements): the most dsforge asks for.
REDUCE_BUCKET_SIZE = 500_000_000
# zero_optimization.sub_group_size (elements; DeepSpeed's default, which translation sets for
# stage 3): ZeRO-3 makes the fp32 gradient of one sub-group at a time in the optimizer step.
SUB_GROUP_SIZE = 1_000_000_000
# Megatron-Core DDP's default bucket, max(4e7, 1e6 x dp) parameters (distributed_data_parallel.py),
# for ZeRO 2/3 under a pipeline (`reduce_bucket_elements`).
PIPELINE_BUCKET = 40_000_000
PIPELINE_BUCKET_PER_DP_RANK = 1_000_000


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes on one GPU at the two moments that compete for the peak (module docstring):
    the last backward (params + grads + optimizer + activations + buffers + bucket) and the
    optimizer step (params + optimizer + step_grads + step_buffers + step_bucket)."""
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    bucket: float = 0.0  # the ZeRO reduce bucket, live during each backward
    step_grads: float = 0.0  # the 16-bit gradients still held when the fp32 gradient is made
    step_buffers: float = 0.0  # the fp32 gradient of the optimizer step and what it is made from
    step_bucket: float = 0.0  # the reduce bucket, still allocated in the step (ZeRO-3 keeps it)
    pipeline_rank: int = 0  # which pipeline rank this is (the worst one when reported)

    @property
    def backward_total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.bucket

    @property
    def step_total(self) -> float:
        return self.params + self.optimizer + self.step_grads + self.step_buffers + self.step_bucket

    @property
    def total(self) -> float:
        return max(self.backward_total, self.step_total)

    @property
    def peak_moment(self) -> str:
        return "optimizer step" if self.step_total > self.backward_total else "backward"

    def to_dict(self) -> dict[str, float | str]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "pipeline_rank"}
        return {**{k: int(v) for k, v in values.items()}, "backward_total": int(self.backward_total),
                "step_total": int(self.step_total), "total": int(self.total), "peak": self.peak_moment}


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    params: float
    grads: float
    optimizer: float
    fp32_grads: float  # DeepSpeed's fp32 gradient partition for the optimizer step
    step_grads: float  # the 16-bit gradients still held in the step (ZeRO-1 frees the rest)
    step_buffers: float  # the fp32 gradient made in the step and what it is made from, at most


def model_states(psi: float, *, stage: int, shards: int, precision: str = "bf16",
                 offload_optimizer_ratio: float = 0.0, offload_params: bool = False,
                 flat_fp32_grads: bool = False) -> ModelStates:
    """Bytes of model states for `psi` parameters shared by `shards` data-parallel ranks.
    `flat_fp32_grads`: ZeRO-0's 16-bit wrapper is FP16_Optimizer (`zero0_flattens`)."""
    half = precision != "fp32"
    # fp32: Adam's m and v (8 bytes); ZeRO 1 and 2 also keep their own fp32 copy of the
    # partition (single_partition_of_fp32_groups), while ZeRO-3 steps the fp32 partition itself.
    # Measured by the live-tensor census of `dsforge bench` (benchmarks/zero_study_cpu).
    param_bytes, grad_bytes, optim_bytes = (2, 2, 12) if half else (4, 4, 12 if stage in (1, 2) else 8)
    on_gpu = 1.0 - offload_optimizer_ratio
    partition = psi / (shards if stage >= 1 else 1)
    params = 0.0 if offload_params else param_bytes * psi / (shards if stage == 3 else 1)
    grads = grad_bytes * psi / (shards if stage >= 2 else 1)
    if stage == 0:  # fp32 copies (FP16_Optimizer: then their flat); fp32: nothing made
        step_buffers = (4 + 4 if flat_fp32_grads else 4) * psi if half else 0.0
    else:  # the partition, or one ZeRO-3 sub-group of it, and its flattened 16-bit source
        made_at_once = min(partition, SUB_GROUP_SIZE) if stage == 3 else partition
        step_buffers = on_gpu * (4 + grad_bytes if half else grad_bytes) * made_at_once
    return ModelStates(
        params=params, grads=grads,
        optimizer=on_gpu * optim_bytes * psi / (shards if stage >= 1 else 1),
        fp32_grads=on_gpu * 4 * partition if half else 0.0,
        step_grads=grads if stage == 0 else grad_bytes * partition,
        step_buffers=step_buffers,
    )


@dataclass(frozen=True)
class _StageParams:
    dense: float  # sharded over dp by ZeRO
    expert: float  # sharded over expert-dp by ZeRO
    largest_layer: float


def stage_params(m: ModelConfig, layout: Layout, rank: int) -> _StageParams:
    """Parameters on one GPU of pipeline rank `rank` after TP, PP and EP."""
    return _stage_params(m, layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp, rank)


# A search asks for the same few shapes thousands of times (every ZeRO stage, micro-batch and
# checkpointing variant of a layout, and the reduce bucket of every rank): each is counted once.
@functools.lru_cache(maxsize=4096)
def _stage_params(m: ModelConfig, tp: int, pp: int, vpp: int, ep: int, etp: int, rank: int) -> _StageParams:
    h = m.hidden_size
    dense = expert = largest = 0.0
    for layer in stage_layers(m.num_layers, pp, vpp, rank):
        layer_dense = attention_params(m) / tp + 2 * h
        layer_expert = 0.0
        if m.is_moe_layer(layer):
            layer_dense += router_params(m)
            layer_expert = (m.moe.num_experts / ep) * mlp_params(m, m.moe.ffn_hidden_size) / etp
        else:
            layer_dense += mlp_params(m, m.ffn_hidden_size) / tp
        dense, expert = dense + layer_dense, expert + layer_expert
        largest = max(largest, layer_dense + layer_expert)
    vocab_shard = padded_vocab_size(m.vocab_size, tp) * h / tp
    if rank == 0:
        dense += vocab_shard
    if rank == pp - 1:
        dense += h  # final norm
        if not m.tie_embeddings or pp > 1:
            dense += vocab_shard
    largest = max(largest, vocab_shard)
    return _StageParams(dense=dense, expert=expert, largest_layer=largest)


def largest_stage_params(m: ModelConfig, layout: Layout) -> _StageParams:
    """The parameters of the pipeline rank holding the most (dense + expert, one GPU)."""
    return _largest_stage_params(m, layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp)


@functools.lru_cache(maxsize=1024)
def _largest_stage_params(m: ModelConfig, tp: int, pp: int, vpp: int, ep: int, etp: int) -> _StageParams:
    return max((_stage_params(m, tp, pp, vpp, ep, etp, r) for r in range(pp)),
               key=lambda p: p.dense + p.expert)


def training_element_bytes(precision: str) -> int:
    """Bytes of one element in the training dtype (`train.precision`): 4 in fp32, else 2."""
    return 4 if precision == "fp32" else 2


def layer_activation_bytes(m: ModelConfig, layer: int, *, seq_len: int, micro_batch: int,
                           layout: Layout, checkpointing: str, fused_attention: bool = True) -> float:
    """Activation bytes one layer keeps for one microbatch until its backward pass. A
    context-parallel rank holds seq_len / cp of each sequence's tokens; its attention (heads
    / cp of them over the whole sequence, Ulysses) keeps as much per token as without."""
    tokens, h, d = seq_len * micro_batch // layout.cp, m.hidden_size, m.head_dim
    tp = layout.tp
    split_inputs = tp if layout.sequence_parallel else 1
    if checkpointing == "full":
        return 2 * h * tokens / split_inputs
    inputs = 8 * h / split_inputs  # two norm inputs, QKV input, MLP fc1 (or router) input
    attention = (2 * m.num_attention_heads * d + 4 * m.query_groups * d + 2 * m.num_attention_heads * d) / tp
    if not fused_attention and checkpointing == "none":
        attention += 4 * m.num_attention_heads * seq_len / tp
    if m.is_moe_layer(layer):
        # A rank's experts see etp / tp of its tokens: sequence parallelism leaves each
        # tensor-parallel rank 1/tp of them, and the dispatcher gathers them back over the
        # expert-tensor-parallel group only (calibrate/expert_timing.py times the same rows).
        routed = m.moe.top_k * (2 * h + 6 * m.moe.ffn_hidden_size / layout.etp) * layout.etp / tp
        mlp = routed
    else:
        mlp = 6 * m.ffn_hidden_size / tp
    return (inputs + attention + mlp) * tokens


def activation_bytes(m: ModelConfig, train: TrainConfig, layout: Layout, rank: int,
                     fused_attention: bool = True, fused_loss: bool = False) -> float:
    """Peak activation bytes on pipeline rank `rank`, with the schedule's in-flight
    microbatches; `fused_loss`: the output layer and its loss run fused (logits_bytes)."""
    kw = dict(seq_len=train.seq_len, micro_batch=layout.micro_batch, layout=layout,
              fused_attention=fused_attention)
    layers = stage_layers(m.num_layers, layout.pp, layout.vpp, rank)
    # layer_activation_bytes counts 16-bit activations: fp32 training keeps its in 4 bytes
    # (the saved-tensor counter measured 2,848 bytes a token in bf16, 5,664 in fp32)
    width = training_element_bytes(train.precision) / 2
    kept = per_kind_of_layer(m, lambda i: layer_activation_bytes(
        m, i, checkpointing=train.activation_checkpointing, **kw))
    per_microbatch = width * sum(kept(i) for i in layers)
    in_flight = _microbatches_in_flight(layout, rank)
    total = per_microbatch * in_flight
    if train.activation_checkpointing == "full":  # one layer's full activations while recomputing
        recomputed = per_kind_of_layer(m, lambda i: layer_activation_bytes(m, i, checkpointing="none", **kw))
        total += width * max(recomputed(i) for i in layers)
    if rank == layout.pp - 1:
        total += logits_bytes(m, train.seq_len * layout.micro_batch // layout.cp, layout.tp,
                              fused_loss)
    return total


def logits_bytes(m: ModelConfig, tokens: int, tp: int, fused_loss: bool) -> float:
    """The loss's memory on the last pipeline rank for one microbatch of `tokens`.

    Unfused: the [tokens, V/tp] logits in 16 bits and Megatron's fp32 copy for its
    vocab-parallel cross-entropy, 6 bytes a logit. Fused (Liger's fused linear cross-entropy,
    tp 1 only): the output layer's weight gradient (2 V h) and the input's gradient (2 tokens h),
    made in the forward and kept for the backward, and one chunk of tokens' logits and their
    gradient in 16 bits (Liger's chunk: tokens / ceil(V / h), up to a power of two).
    Measured on one H200 (benchmarks/gpu/results/2026-11-26-h200), the 1B (V 128,256): with
    it every run within 3.1% (28.3 GiB predicted at 8,192 tokens, 29.2 measured; 6 bytes a
    logit predicted 33.5). Without it the same run measured 38.3 GiB, as if a logit took
    11 bytes. The same unfused path on the CPU backend (Megatron's output layer and
    vocab-parallel cross-entropy, 1,024-2,048 tokens at V 32,768-131,072; the resident set's
    peak, tools/loss_peak_memory.py) peaks at 6.1-6.2 bytes a logit, so the 6 stand and that
    run's extra lies elsewhere: torch's RMSNorm and SwiGLU keep more than Liger's
    (docs/memory-and-bubble.md)."""
    vocab = padded_vocab_size(m.vocab_size, tp)
    if not fused_loss:
        return 6 * tokens * vocab / tp
    h = m.hidden_size
    chunk = min(tokens, 2 ** math.ceil(math.log2(math.ceil(tokens / math.ceil(vocab / h)))))
    return 2 * vocab * h + 2 * tokens * h + 4 * chunk * vocab


def per_kind_of_layer(m: ModelConfig, bytes_of: Callable[[int], float]) -> Callable[[int], float]:
    """`bytes_of`, computed once per kind of layer (dense, MoE), the only thing about a layer
    it reads: the sums over a rank's layers add the same values in the same order, a few
    times faster (a search estimates thousands of layouts)."""
    known: dict[bool, float] = {}

    def of(layer: int) -> float:
        moe = m.is_moe_layer(layer)
        if moe not in known:
            known[moe] = bytes_of(layer)
        return known[moe]
    return of


def _microbatches_in_flight(layout: Layout, rank: int) -> float:
    """Microbatches (in whole-rank units) whose activations rank `rank` holds at its peak."""
    pp, vpp, m = layout.pp, layout.vpp, layout.num_microbatches
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - rank, m))
    chunks = min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)
    return chunks / vpp


def estimate_memory(*, model: ModelConfig, train: TrainConfig, zero: ZeroConfig, layout: Layout,
                    fused_attention: bool = True, fused_loss: bool = False,
                    document_mask: bool = False) -> MemoryEstimate:
    """Peak bytes per GPU on the most loaded pipeline rank. `fused_loss`: the ranks run
    Liger's fused linear cross-entropy (translate/kernels.py fused_loss says when);
    `document_mask`: they mask packed documents with SDPA's dense mask (document_mask_bytes)."""
    per_rank = [_rank_memory(model, train, zero, layout, rank, fused_attention, fused_loss,
                             document_mask) for rank in range(layout.pp)]
    return max(per_rank, key=lambda est: est.total)


def document_mask_bytes(train: TrainConfig, layout: Layout, rank: int) -> float:
    """data.document_masking through SDPA's dense mask (translate/kernels.py
    document_attention): one [micro_batch, 1, seq, seq] mask in the attention's dtype for each
    microbatch in flight, shared by its layers (runtime/assemble/documents.py). Ulysses gives
    each rank whole sequences, so cp does not divide it."""
    element = training_element_bytes(train.precision)
    in_flight = math.ceil(_microbatches_in_flight(layout, rank))
    return float(layout.micro_batch * train.seq_len ** 2 * element * in_flight)


def float8_buffer_bytes(model: ModelConfig, train: TrainConfig, layout: Layout) -> float:
    """train.fp8's transient float8 copies at the widest linear layer (one byte a value): its
    weight and the transposed copy the backward multiplies by, the input and its transpose,
    the output gradient. What torchao saves for the backward is what a bf16 linear layer saves
    (its input and a view of its weight), so the activations do not change."""
    if train.fp8 == "none":
        return 0.0
    tokens = layout.micro_batch * train.seq_len // layout.cp
    heads, groups, hd, h = model.num_attention_heads, model.query_groups, model.head_dim, model.hidden_size
    widths = ((h, (heads + 2 * groups) * hd), (heads * hd, h), (h, 2 * model.ffn_hidden_size),
              (model.ffn_hidden_size, h))
    return float(max(2 * n_in * n_out + tokens * (2 * n_in + n_out) for n_in, n_out in widths))


def _rank_memory(model: ModelConfig, train: TrainConfig, zero: ZeroConfig, layout: Layout,
                 rank: int, fused_attention: bool, fused_loss: bool,
                 document_mask: bool) -> MemoryEstimate:
    psi = stage_params(model, layout, rank)
    ratio = zero.offload_ratio if zero.offload_optimizer == "cpu" else 0.0
    kw = dict(stage=zero.stage, precision=train.precision, offload_optimizer_ratio=ratio,
              offload_params=zero.offload_params == "cpu", flat_fp32_grads=zero0_flattens(train))
    dense = model_states(psi.dense, shards=layout.dp_cp, **kw)
    expert = model_states(psi.expert, shards=layout.expert_shards, **kw)
    buffers = (4 * psi.largest_layer if zero.stage == 3 else 0.0) + float8_buffer_bytes(model, train, layout)
    bucket = reduce_bucket_bytes(model, layout, zero.stage, train.precision)
    return MemoryEstimate(
        params=dense.params + expert.params, grads=dense.grads + expert.grads,
        optimizer=dense.optimizer + expert.optimizer,
        activations=activation_bytes(model, train, layout, rank, fused_attention, fused_loss)
        + (document_mask_bytes(train, layout, rank) if document_mask else 0.0),
        buffers=buffers, bucket=bucket,
        step_grads=dense.step_grads + expert.step_grads,
        step_buffers=_step_buffers(dense, expert, zero.stage),
        # stages 1 and 2 free their bucket in each backward's epilogue; stage 3 keeps it
        step_bucket=bucket if zero.stage == 3 else 0.0,
        pipeline_rank=rank)


def zero0_flattens(train: TrainConfig) -> bool:
    """DeepSpeed wraps a 16-bit ZeRO-0 optimizer in FP16_Optimizer only when it is DeepSpeed's
    own FusedAdam (engine._configure_fp16_optimizer), which train.adam_impl `deepspeed` asks
    for (translate/optimizer.py); torch's AdamW gets FP16_UnfusedOptimizer."""
    return train.adam_impl == "deepspeed"


def _step_buffers(dense: ModelStates, expert: ModelStates, stage: int) -> float:
    """ZeRO 1-3 make the fp32 gradient one parameter group at a time and free it (dense and
    expert weights are separate groups), so the larger counts; ZeRO-0's 16-bit wrapper keeps
    every group's fp32 gradients until the step ends, so they add up."""
    if stage == 0:
        return dense.step_buffers + expert.step_buffers
    return max(dense.step_buffers, expert.step_buffers)


def reduce_bucket_elements(model: ModelConfig, layout: Layout, stage: int) -> int:
    """The reduce_bucket_size dsforge gives DeepSpeed (translate/deepspeed_config.py).

    DeepSpeed allocates the whole bucket whatever it will hold, and a bucket never holds more
    than one backward's gradients of the rank, so it is capped at the largest pipeline rank's
    parameters: the same reductions, less memory (a tiny model's ZeRO-3 bucket was 1.9 GiB).
    Under a pipeline ZeRO 2/3 keep the bucket through every microbatch's backward, and it is
    the price of their partitioned gradients (docs/runtime.md): there it is Megatron-Core
    DDP's bucket, max(4e7, 1e6 x dp) elements (80 MB in bf16), enough that a reduce-scatter's
    latency stays small next to its bytes. Elsewhere DeepSpeed's default 5e8, which pp = 1
    overlaps with backward and which no measurement here has contradicted."""
    largest = largest_stage_params(model, layout)
    size = min(REDUCE_BUCKET_SIZE, math.ceil(largest.dense + largest.expert))
    if layout.pp > 1 and stage >= 2:
        size = min(size, max(PIPELINE_BUCKET, PIPELINE_BUCKET_PER_DP_RANK * layout.dp))
    return int(size)


def reduce_bucket_bytes(model: ModelConfig, layout: Layout, stage: int, precision: str) -> float:
    """The ZeRO reduce bucket: all of reduce_bucket_size in the gradient dtype. Stages 1 and 2:
    `torch.empty(reduce_bucket_size)` in `setup_buckets` at a backward's first gradient
    (contiguous_gradients), freed by its epilogue; stage 3: its contiguous-gradient bucket,
    kept (measured by the census: 1.9 GiB in fp32 when the bucket was DeepSpeed's 5e8)."""
    if stage == 0:
        return 0.0
    return training_element_bytes(precision) * reduce_bucket_elements(model, layout, stage)
