"""Predicted step time of a layout: compute, communication, the pipeline bubble and the
optimizer step, per optimizer step on one GPU, in seconds.

docs/search.md ("The step-time model") has the table of terms and the derivation of each
from the schedules and engines dsforge runs (Megatron-Core's 1F1B / interleaved 1F1B with
blocking batched p2p, DeepSpeed's ZeRO stages with dsforge's config); this module follows it
term by term and each function says which rule it implements.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from dsforge.cost.profile import ClusterProfile
from dsforge.estimate.bubble import bubble_fraction
from dsforge.estimate.context_parallel import step_exchange_bytes
from dsforge.estimate.flops import flops_per_token, pipeline_rank_expert_flops, pipeline_rank_flops
from dsforge.estimate.memory import largest_stage_params
from dsforge.recipe.resolve import Layout, Resolved
from dsforge.schema import ModelConfig, padded_vocab_size

GB = 1e9
_GEMM_KNEE = 256.0


@dataclass(frozen=True, kw_only=True)
class StepTime:
    compute: float
    # The work outside the GEMMs and attention (norms, SwiGLU, rotary, residuals, the loss's
    # share): 0 until measured, where the profile's efficiency absorbs it.
    other: float = 0.0
    tp_comm: float
    ep_comm: float
    bubble: float
    # Context parallelism's all-to-alls (Ulysses: the shard's q, k, v and the attention's
    # output, forward and backward), not overlapped.
    cp_comm: float = 0.0
    pp_comm: float
    dp_comm: float
    optimizer: float = 0.0
    fixed: float = 0.0  # the profile's cost per microbatch and layer (0 until measured)
    gathers: float = 0.0  # ZeRO-3's per-layer fetches beyond their bytes (0 until measured)
    host: float = 0.0  # the wait for the host where a layer's forward is shorter than its floor

    @property
    def total(self) -> float:
        # Written out, not summed over fields(): it is read in the search's hot path (a loop
        # over fields cost the slowest search a few percent). tests/unit/test_search.py holds
        # it to them.
        return (self.compute + self.other + self.tp_comm + self.ep_comm + self.cp_comm + self.bubble
                + self.pp_comm + self.dp_comm + self.optimizer + self.fixed + self.gathers
                + self.host)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def gemm_saturation(x: float, knee: float = _GEMM_KNEE) -> float:
    """The share of a GEMM's full rate it reaches at size x: x / (x + knee)."""
    return x / (x + knee)


def _bandwidth(span: int, profile: ClusterProfile) -> float:
    """Bytes/s of a group whose ranks span `span` consecutive ranks."""
    gbps = profile.intra_node_gbps if span <= profile.gpus_per_node else profile.inter_node_gbps
    return gbps * GB


def ring_bandwidth(size: int, span: int, profile: ClusterProfile) -> float:
    """Bus bytes/s per GPU of a ring collective (all-reduce, all-gather, reduce-scatter) over a
    group of `size` ranks spanning `span` consecutive ranks. Across nodes NCCL runs one ring per
    NIC, and each GPU of a node has its own (rail-optimised nodes): a group with k ranks in each
    node drives k NICs, so its bus bandwidth is k x the inter-node figure, at most the
    intra-node one (docs/search.md)."""
    if span <= profile.gpus_per_node:
        return profile.intra_node_gbps * GB
    nodes = -(-span // profile.gpus_per_node)
    per_node = max(1, size // nodes)
    return min(profile.intra_node_gbps, per_node * profile.inter_node_gbps) * GB


def _ring(size: int) -> float:
    return (size - 1) / size if size > 1 else 0.0


def step_time(resolved: Resolved, profile: ClusterProfile) -> StepTime:
    recipe, lay = resolved.recipe, resolved.layout
    m, t = recipe.model, recipe.train
    half = 2 if t.precision != "fp32" else 4
    microbatch_tokens = lay.micro_batch * t.seq_len // lay.cp  # a context-parallel rank's shard
    flop_rate = _flop_rate(resolved, profile)
    gemm, attention = compute_split(resolved, profile, flop_rate)
    compute = float8_gemm_seconds(resolved, profile, gemm) + attention
    other = other_units(resolved) * profile.other_s_per_token_hidden * other_factor(resolved, profile)

    activation = microbatch_tokens * m.hidden_size * half
    tp_comm = lay.grad_accum * m.num_layers / lay.pp * _tp_layer_seconds(
        m, lay, t.activation_checkpointing, activation, microbatch_tokens / flop_rate, profile)

    ep_comm = 0.0
    if m.moe and lay.ep > 1:
        moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers)) / lay.pp
        ep_bw = _bandwidth(lay.tp * lay.ep, profile)
        ep_comm = moe_layers * lay.grad_accum * 4 * m.moe.top_k * activation * _ring(lay.ep) / ep_bw

    # Ulysses' all-to-alls over the cp group's bandwidth (estimate/context_parallel.py)
    cp_comm = (step_exchange_bytes(m, lay, t.seq_len, half, t.activation_checkpointing)
               / _bandwidth(lay.tp * lay.cp, profile))

    worst = largest_stage_params(resolved.recipe.model, resolved.layout)
    dp_comm, dp_in_slots = _dp_comm(resolved, worst, profile, half, compute)
    pp_comm = 0.0
    if lay.pp > 1:
        message = activation / (lay.tp if lay.sequence_parallel else 1)
        pp_comm = lay.grad_accum * pipeline_send_seconds(lay, profile, message)
    # Each microbatch pays the busiest rank's layers' fixed cost (kernel launches from Python),
    # and under ZeRO-3 each of their fetches (docs/search.md).
    fixed = microbatch_layers(resolved) * profile.microbatch_layer_s
    gathers = gather_count(resolved) * profile.zero3_gather_layer_s
    host = host_wait(resolved, host_floor_s(resolved, profile), compute + other)
    # Every slot of the pipeline carries its sends and fixed costs too (blocking p2p), so they
    # fill and drain with the compute.
    bubble = (bubble_fraction(lay.pp, lay.vpp, lay.num_microbatches)
              * (compute + other + tp_comm + ep_comm + cp_comm + dp_in_slots + pp_comm + fixed
                 + gathers + host))
    return StepTime(compute=compute, other=other, tp_comm=tp_comm, ep_comm=ep_comm, cp_comm=cp_comm,
                    bubble=bubble,
                    pp_comm=pp_comm, dp_comm=dp_comm,
                    optimizer=_optimizer_seconds(resolved, worst, profile), fixed=fixed,
                    gathers=gathers, host=host)


def _flop_rate(resolved: Resolved, profile: ClusterProfile) -> float:
    return modelled_gemm_rate(resolved, profile, profile.compute_efficiency)


def modelled_gemm_rate(resolved: Resolved, profile: ClusterProfile, efficiency: float) -> float:
    """FLOP/s of the layout's GEMMs at `efficiency`: less where a tensor-parallel shard's width
    or a microbatch's tokens leave them short of saturating the GPU (calibration divides a
    measured rate by it at efficiency 1)."""
    lay, m, t = resolved.layout, resolved.recipe.model, resolved.recipe.train
    microbatch_tokens = lay.micro_batch * t.seq_len // lay.cp
    return (profile.gpu.peak_bf16_flops * efficiency * gemm_saturation(m.hidden_size / lay.tp)
            * gemm_saturation(microbatch_tokens, profile.gemm_knee_tokens))


def compute_split(resolved: Resolved, profile: ClusterProfile,
                  flop_rate: float | None = None) -> tuple[float, float]:
    """The compute row's seconds as (matrix products, attention): the busiest pipeline rank's
    (the last: it adds the output layer) FLOPs at the GEMMs' rate, its attention and its MoE
    experts' products each at their own measured rate where the profile has one (else at the
    GEMMs')."""
    lay, m, t = resolved.layout, resolved.recipe.model, resolved.recipe.train
    flop_rate = _flop_rate(resolved, profile) if flop_rate is None else flop_rate
    dense, attention, experts = _busiest_rank_flops(m, t.seq_len, t.activation_checkpointing,
                                                    lay.pp, lay.vpp)
    attention_rate = (flop_rate if profile.attention_efficiency is None
                      else profile.gpu.peak_bf16_flops * profile.attention_efficiency)
    tokens = lay.grad_accum * (lay.micro_batch * t.seq_len // lay.cp) / lay.tp
    return (_matrix_seconds(tokens, dense, experts, flop_rate, profile),
            tokens * attention / attention_rate)


def _matrix_seconds(tokens: float, dense: float, experts: float, flop_rate: float,
                    profile: ClusterProfile) -> float:
    """Seconds of `tokens` x `dense` FLOPs of matrix products, of which `experts` a token are
    the routed experts': all at the GEMMs' rate, or the experts' at the profile's
    expert_efficiency of the peak where it has one (the grouped GEMM or the per-expert loop
    runs short products, slower than the dense layers' GEMMs)."""
    if profile.expert_efficiency is None:
        return tokens * dense / flop_rate  # every default profile: the same figure, to the bit
    expert_rate = profile.gpu.peak_bf16_flops * profile.expert_efficiency
    return tokens * (dense - experts) / flop_rate + tokens * experts / expert_rate


def float8_gemm_seconds(resolved: Resolved, profile: ClusterProfile, gemm: float) -> float:
    """The matrix products' seconds with train.fp8: the transformer layers' linear layers at
    fp8_gemm_speedup, the output layer (bf16, on the last pipeline rank, the busiest) as is."""
    m, t, lay = resolved.recipe.model, resolved.recipe.train, resolved.layout
    if t.fp8 == "none":
        return gemm
    dense, _, _ = _busiest_rank_flops(m, t.seq_len, t.activation_checkpointing, lay.pp, lay.vpp)
    last = pipeline_rank_flops(m, 0, t.activation_checkpointing, pp=lay.pp, vpp=lay.vpp, rank=lay.pp - 1)
    has_output = dense > 0 and last == dense  # the busiest rank holds the output layer
    output = 6.0 * m.hidden_size * padded_vocab_size(m.vocab_size, lay.tp) if has_output else 0.0
    layers = gemm * max(0.0, 1.0 - output / dense) if dense else 0.0
    return gemm - layers + layers / profile.fp8_gemm_speedup


def other_factor(resolved: Resolved, profile: ClusterProfile) -> float:
    """`other` under model.compile (fused) and train.fp8 (its casts, fused when compiled)."""
    m, t = resolved.recipe.model, resolved.recipe.train
    if m.compile == "layers":
        return profile.compiled_other_share
    return 1.0 + (profile.fp8_eager_cast_share if t.fp8 != "none" else 0.0)


def microbatch_layers(resolved: Resolved) -> float:
    """Microbatches a step times the layers of the busiest pipeline rank."""
    lay = resolved.layout
    return lay.grad_accum * resolved.recipe.model.num_layers / lay.pp


def other_units(resolved: Resolved) -> float:
    """Tokens x hidden units x layers a step of the busiest rank works through outside the
    GEMMs and attention (docs/search.md, "other"): each microbatch's tokens (a context-parallel
    rank's shard) over the rank's layers, the hidden width split by tp, and the forward again
    where recomputation repeats it (the FLOPs' hardware / model ratio)."""
    lay, m, t = resolved.layout, resolved.recipe.model, resolved.recipe.train
    tokens = lay.micro_batch * t.seq_len / lay.cp
    return (microbatch_layers(resolved) * tokens * m.hidden_size / lay.tp
            * _recompute_factor(m, t.seq_len, t.activation_checkpointing))


@functools.lru_cache(maxsize=1024)
def _recompute_factor(m: ModelConfig, seq_len: int, checkpointing: str) -> float:
    flops = flops_per_token(m, seq_len, checkpointing)
    return flops.hardware / flops.model


def host_floor_s(resolved: Resolved, profile: ClusterProfile) -> float:
    """The profile's floor under a layer's grad-enabled forward at the recipe's ZeRO stage."""
    return profile.host_layer_zero3_s if resolved.recipe.zero.stage == 3 else profile.host_layer_s


def host_wait(resolved: Resolved, floor_s: float, compute: float) -> float:
    """Seconds a step waits for the host (docs/search.md, "host"): for every microbatch and
    layer of the busiest rank, what its grad-enabled forward (the forward; under full
    checkpointing the recompute, while the first forward runs without autograd) falls short
    of the floor. The device's time of that pass is its share of `compute` (the device's
    seconds of a step's layers: the compute and other rows)."""
    if floor_s <= 0:
        return 0.0
    layers, pass_s = forward_pass(resolved, compute)
    return layers * max(0.0, floor_s - pass_s)


def forward_pass(resolved: Resolved, compute: float) -> tuple[float, float]:
    """(the busiest rank's microbatch-layers, the device's seconds of one layer's grad-enabled
    forward): that pass's share of the FLOPs of `compute` (a step's), per microbatch-layer."""
    layers = microbatch_layers(resolved)
    t = resolved.recipe.train
    share = forward_share(resolved.recipe.model, t.seq_len, t.activation_checkpointing)
    return layers, compute * share / layers


@functools.lru_cache(maxsize=1024)
def forward_share(m: ModelConfig, seq_len: int, checkpointing: str) -> float:
    """The grad-enabled forward's share of a step's FLOPs (docs/flops.md: forward = model / 3,
    recompute = hardware - model)."""
    flops = flops_per_token(m, seq_len, checkpointing)
    forward = flops.hardware - flops.model if checkpointing == "full" else flops.model / 3
    return forward / flops.hardware


def gather_count(resolved: Resolved) -> float:
    """ZeRO-3's layer fetches a step on the busiest rank: each layer's parameters for its
    forward, its backward and, with full checkpointing, its recompute (0 below ZeRO-3)."""
    if resolved.recipe.zero.stage < 3:
        return 0.0
    passes = 3 if resolved.recipe.train.activation_checkpointing == "full" else 2
    return passes * microbatch_layers(resolved)


@functools.lru_cache(maxsize=1024)
def _busiest_rank_flops(m: ModelConfig, seq_len: int, checkpointing: str, pp: int,
                        vpp: int) -> tuple[float, float, float]:
    """Hardware FLOPs per token of the busiest pipeline rank (candidates share them), as
    (matrix products, attention, the routed experts' share of the matrix products): the
    attention's are what a sequence of 0 tokens drops."""
    busiest = max(range(pp), key=lambda r: pipeline_rank_flops(m, seq_len, checkpointing, pp=pp,
                                                                vpp=vpp, rank=r))
    total = pipeline_rank_flops(m, seq_len, checkpointing, pp=pp, vpp=vpp, rank=busiest)
    dense = pipeline_rank_flops(m, 0, checkpointing, pp=pp, vpp=vpp, rank=busiest)
    experts = pipeline_rank_expert_flops(m, checkpointing, pp=pp, vpp=vpp, rank=busiest)
    return dense, total - dense, experts


def _tp_layer_seconds(m: ModelConfig, lay: Layout, checkpointing: str, activation: float,
                      seconds_per_flop_token: float, profile: ClusterProfile) -> float:
    """Exposed tensor-parallel traffic of one layer and microbatch (docs/search.md).

    One unit u = an all-reduce of the b s h activation, 2 (t-1)/t x its bytes. Megatron-Core's
    linear layers (tensor_parallel/layers.py): forward 2 u on the critical path (row-parallel
    all-reduces; with sequence parallelism all-gathers and reduce-scatters of the same volume),
    2 u more when full recomputation re-runs the forward. Backward: the column-parallel layers
    (QKV, fc1) all-reduce their input gradient asynchronously beside the weight-gradient GEMM
    (with sequence parallelism: reduce-scatter beside it, after re-gathering the input beside
    the data-gradient GEMM), so each is hidden up to that GEMM's length; with sequence
    parallelism the row-parallel layers' output-gradient all-gathers (u in all) come first."""
    if lay.tp == 1:
        return 0.0
    unit = 2 * _ring(lay.tp) * activation / ring_bandwidth(lay.tp, lay.tp, profile)
    exposed = (4 if checkpointing == "full" else 2) * unit + (unit if lay.sequence_parallel else 0.0)
    q_width, kv_width = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim
    ffn = m.ffn_hidden_size if m.moe is None else m.moe.top_k * m.moe.ffn_hidden_size
    for out_features in (q_width + 2 * kv_width, 2 * ffn):  # QKV, fc1 (gate and up)
        gemm = 2 * m.hidden_size * out_features / lay.tp * seconds_per_flop_token
        if lay.sequence_parallel:  # half a unit beside dgrad, half beside wgrad
            exposed += 2 * max(0.0, unit / 2 - gemm)
        else:
            exposed += max(0.0, unit - gemm)
    return exposed


@functools.lru_cache(maxsize=4096)
def boundary_counts(stride: int, pp: int, vpp: int, gpus_per_node: int) -> frozenset[tuple[int, int]]:
    """For each pipeline rank of each pipeline group: (intra-node, inter-node) stage
    boundaries it sends across per microbatch, summed over its v model chunks.

    Rank order tp-cp-ep-dp-pp puts pipeline stage k of a group at global rank r0 + k x stride
    (stride = tp x cp x dp, r0 < stride); a node holds gpus_per_node consecutive ranks, so only
    r0 modulo the node size matters. Model chunk c of rank k is virtual stage c pp + k: its
    previous stage is rank k-1 (rank pp-1's chunk c-1 for k = 0, none for the first virtual
    stage) and its next is rank k+1 (rank 0's chunk c+1 for k = pp-1: the wrap-around)."""
    def same_node(a: int, b: int) -> bool:
        return a // gpus_per_node == b // gpus_per_node

    counts = set()
    for r0 in range(min(stride, gpus_per_node)):
        rank_of = [r0 + k * stride for k in range(pp)]
        for k in range(pp):
            intra = inter = 0
            for chunk in range(vpp):
                stage = chunk * pp + k
                for neighbour_stage in (stage - 1, stage + 1):
                    if not 0 <= neighbour_stage < pp * vpp:
                        continue
                    if same_node(rank_of[k], rank_of[neighbour_stage % pp]):
                        intra += 1
                    else:
                        inter += 1
            counts.add((intra, inter))
    return frozenset(counts)


def pipeline_send_seconds(lay: Layout, profile: ClusterProfile, message: float) -> float:
    """Seconds per microbatch the busiest pipeline rank spends in p2p (docs/search.md).

    Per microbatch and model chunk a rank exchanges one message with each neighbouring stage
    in each direction (activation forward, its gradient back). The two directions of one link
    run at once (full duplex), the two links one after the other: Megatron-Core's 1F1B calls
    send_forward_recv_backward and send_backward_recv_forward separately, and dsforge's batched
    p2p ends each call with torch.cuda.synchronize(), so nothing overlaps compute. The step
    waits for the slowest rank."""
    intra_s = message / (profile.intra_node_gbps * GB) + profile.p2p_latency_s
    inter_s = message / (profile.inter_node_gbps * GB) + profile.p2p_latency_s
    stride = lay.world_size // lay.pp
    counts = boundary_counts(stride, lay.pp, lay.vpp, profile.gpus_per_node)
    return max(intra * intra_s + inter * inter_s for intra, inter in counts)


def _optimizer_seconds(resolved: Resolved, worst, profile: ClusterProfile) -> float:
    """The optimizer step over this GPU's partition (the worst pipeline rank's), bound by the
    memory bandwidth: a fixed cost plus bytes per parameter over the GPU's bandwidth, both
    measured (profile.py: DeepSpeed's 16-bit wrapper around torch's fused AdamW). ZeRO 1-3
    partition it over the data-parallel group, ZeRO-0 updates every parameter the GPU holds."""
    lay, recipe = resolved.layout, resolved.recipe
    sharded = recipe.zero.stage >= 1
    params = (worst.dense / (lay.dp_cp if sharded else 1)
              + worst.expert / (lay.expert_shards if sharded else 1))
    per_param = (profile.optimizer_bytes_per_param_fp32 if recipe.train.precision == "fp32"
                 else profile.optimizer_bytes_per_param)
    return profile.optimizer_fixed_s + params * per_param / profile.gpu.memory_bandwidth


def dp_traffic(stage: int, microbatches: int) -> tuple[float, float]:
    """Data-parallel bytes per step of one GPU, in units of (d-1)/d x gradient bytes x Psi:
    (sent during every microbatch's backward, sent once per step). Summed over a rank's v model
    chunks the per-microbatch part is the same: each chunk's Psi/v is reduced m times."""
    if stage <= 1:
        return 0.0, 2.0  # one all-reduce = reduce-scatter + all-gather
    if stage == 2:
        return float(microbatches), 1.0  # m reduce-scatters, then the parameters' all-gather
    return 3.0 * microbatches, 0.0  # gather for forward and backward, reduce-scatter


def _dp_comm(resolved: Resolved, worst, profile: ClusterProfile, grad_bytes: int,
             compute: float) -> tuple[float, float]:
    """(seconds per step, of which inside the pipeline's microbatch slots).

    Only ZeRO-3 without a pipeline overlaps (DeepSpeed turns overlap_comm on at stage 3 only,
    and dsforge's config leaves it; stages 0-2 reduce on the compute stream): the profile's
    dp_overlap share of its per-microbatch gathers and reduce-scatters is hidden, no more than
    the compute they run beside. With pp > 1 the per-microbatch part runs inside the pipeline's slots, one
    collective per model chunk and microbatch, each with (d-1) ring latencies."""
    lay, stage = resolved.layout, resolved.recipe.zero.stage
    per_microbatch, per_step = dp_traffic(stage, lay.grad_accum)
    slots = once = 0.0
    for psi, size, span in ((worst.dense, lay.dp_cp, lay.tp * lay.dp_cp),
                            (worst.expert, lay.edp, lay.world_size // lay.pp)):
        if psi == 0 or size == 1:
            continue
        unit = grad_bytes * psi * _ring(size) / ring_bandwidth(size, span, profile)
        slots += per_microbatch * unit
        once += per_step * unit
        if lay.pp > 1 and per_microbatch:
            # per_microbatch collectives (ZeRO-2: m, ZeRO-3: 3m) for each of the v chunks, each a
            # ring of (d-1) steps
            slots += per_microbatch * lay.vpp * (size - 1) * profile.p2p_latency_s
    if stage == 3 and lay.pp == 1:
        # Under a pipeline the schedule calls the chunks directly and ZeRO-3's prefetch never
        # completes its trace (docs/runtime.md): every gather waits, nothing is hidden.
        slots -= min(slots * profile.dp_overlap, compute)
    return slots + once, (slots if lay.pp > 1 else 0.0)


def predicted_step_time(resolved: Resolved, gpu_key: str, gpus_per_node: int) -> dict[str, float]:
    """The step-time model's terms and total, seconds per optimizer step (`StepTime.to_dict()`),
    of the resolved layout on the default profile of GPU `gpu_key` (profile.py): what `dsforge
    bench` stores with each cell that runs on that GPU, and the GPU kit beside each run."""
    from dsforge.cost.profile import default_profile

    return step_time(resolved, default_profile(gpu_key, gpus_per_node)).to_dict()
