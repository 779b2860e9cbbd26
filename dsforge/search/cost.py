"""Predicted step time of a layout: compute, communication and the pipeline bubble.

Every term is per optimizer step on one GPU, in seconds (docs/search.md has the derivation):

  compute   = tokens per GPU x hardware FLOPs per token / (peak x efficiency)
              tokens per GPU = grad_accum x micro_batch x seq_len / (tp x pp); hardware FLOPs
              include recomputation (activation checkpointing). efficiency = the profile's
              compute_efficiency x g(h/tp) x g(micro_batch x seq_len), g(x) = x / (x + 256):
              thin GEMMs (large tp, short microbatches) run further from the peak.
  tp_comm   = per layer and microbatch 4 all-reduces of the activations (2 forward, 2
              backward; 6 with full recomputation), 2 (t-1)/t x b s h x 2 bytes / bandwidth.
              Sequence parallelism swaps each all-reduce for an all-gather + reduce-scatter of
              the same volume. Not overlapped with compute (Megatron-Core without TE).
  ep_comm   = per MoE layer and microbatch 4 all-to-alls (dispatch and combine, forward and
              backward) of top_k x b s h x 2 bytes x (ep-1)/ep.
  bubble    = (p-1)/(v m) x (compute + tp_comm + ep_comm [+ ZeRO-2's per-microbatch
              reduce-scatters with pp > 1])                      (Narayanan et al. 2021)
  pp_comm   = 2 x m x v sends of b s h x 2 bytes (/tp with sequence parallelism) + latency.
  dp_comm   = gradient/parameter traffic of the ZeRO stage over the data-parallel group,
              ring volume per GPU with Psi this GPU's parameters and d = dp (`dp_traffic`):
                stage 0, 1: one all-reduce per step          2 (d-1)/d x 2 Psi bytes
                stage 2:    reduce-scatter every microbatch   m (d-1)/d x 2 Psi
                            + all-gather of the updated parameters (d-1)/d x 2 Psi
                stage 3:    per microbatch: all-gather params for forward and backward,
                            reduce-scatter grads                 3 m (d-1)/d x 2 Psi
              so ZeRO-2 moves (m+1)/2 times ZeRO-1's bytes. pp = 1: the profile's dp_overlap
              share is hidden behind backward. pp > 1: nothing is hidden. ZeRO 0/1 reduce at
              engine.step() after the schedule; ZeRO-2 reduce-scatters in each chunk backward's
              epilogue (runtime/step.py) with no other stream (overlap_comm is off at stage 2),
              so the rank's next send waits: v chunks x m microbatches = m v collectives of
              Psi/v each (the same m Psi in all, whatever v), each with (d-1) ring steps of
              p2p_latency_s; this per-microbatch part also lengthens every slot of the
              pipeline, so it enters the bubble like compute does.
Bandwidth: intra-node when the group's ranks share a node, else inter-node (rank order
tp-cp-ep-dp-pp: a group spans the product of the sizes before it and itself).
Not modelled: the optimizer step's memory traffic, kernel launch gaps, stragglers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsforge.estimate.bubble import bubble_fraction
from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.memory import stage_params
from dsforge.recipe.resolve import Resolved
from dsforge.search.profile import ClusterProfile

GB = 1e9
_GEMM_KNEE = 256.0


@dataclass(frozen=True, kw_only=True)
class StepTime:
    compute: float
    tp_comm: float
    ep_comm: float
    bubble: float
    pp_comm: float
    dp_comm: float

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.ep_comm + self.bubble + self.pp_comm + self.dp_comm

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def _saturation(x: float) -> float:
    return x / (x + _GEMM_KNEE)


def _bandwidth(span: int, profile: ClusterProfile) -> float:
    """Bytes/s of a group whose ranks span `span` consecutive ranks."""
    gbps = profile.intra_node_gbps if span <= profile.gpus_per_node else profile.inter_node_gbps
    return gbps * GB


def _ring(size: int) -> float:
    return (size - 1) / size if size > 1 else 0.0


def step_time(resolved: Resolved, profile: ClusterProfile) -> StepTime:
    recipe, lay = resolved.recipe, resolved.layout
    m, t = recipe.model, recipe.train
    half = 2 if t.precision != "fp32" else 4
    microbatch_tokens = lay.micro_batch * t.seq_len
    tokens_per_gpu = lay.grad_accum * microbatch_tokens / (lay.tp * lay.pp)
    flops = flops_per_token(m, t.seq_len, t.activation_checkpointing).hardware
    efficiency = (profile.compute_efficiency * _saturation(m.hidden_size / lay.tp)
                  * _saturation(microbatch_tokens))
    compute = tokens_per_gpu * flops / (profile.gpu.peak_bf16_flops * efficiency)

    layers = m.num_layers / lay.pp
    activation = microbatch_tokens * m.hidden_size * half
    collectives = 6 if t.activation_checkpointing == "full" else 4
    tp_bw = _bandwidth(lay.tp, profile)
    tp_comm = layers * lay.grad_accum * collectives * 2 * _ring(lay.tp) * activation / tp_bw

    ep_comm = 0.0
    if m.moe and lay.ep > 1:
        moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers)) / lay.pp
        ep_bw = _bandwidth(lay.tp * lay.ep, profile)
        ep_comm = moe_layers * lay.grad_accum * 4 * m.moe.top_k * activation * _ring(lay.ep) / ep_bw

    dp_comm, dp_in_slots = _dp_comm(resolved, profile, half)
    bubble = (bubble_fraction(lay.pp, lay.vpp, lay.num_microbatches)
              * (compute + tp_comm + ep_comm + dp_in_slots))
    pp_comm = 0.0
    if lay.pp > 1:
        pp_bw = _bandwidth(lay.tp * lay.dp * 2, profile)  # neighbours are tp x dp ranks apart
        message = activation / (lay.tp if lay.sequence_parallel else 1)
        pp_comm = 2 * lay.grad_accum * lay.vpp * (message / pp_bw + profile.p2p_latency_s)

    return StepTime(compute=compute, tp_comm=tp_comm, ep_comm=ep_comm, bubble=bubble,
                    pp_comm=pp_comm, dp_comm=dp_comm)


def dp_traffic(stage: int, microbatches: int) -> tuple[float, float]:
    """Data-parallel bytes per step of one GPU, in units of (d-1)/d x gradient bytes x Psi:
    (sent during every microbatch's backward, sent once per step). Summed over a rank's v model
    chunks the per-microbatch part is the same: each chunk's Psi/v is reduced m times."""
    if stage <= 1:
        return 0.0, 2.0  # one all-reduce = reduce-scatter + all-gather
    if stage == 2:
        return float(microbatches), 1.0  # m reduce-scatters, then the parameters' all-gather
    return 3.0 * microbatches, 0.0  # gather for forward and backward, reduce-scatter


def _dp_comm(resolved: Resolved, profile: ClusterProfile, grad_bytes: int) -> tuple[float, float]:
    """(seconds per step, of which inside the pipeline's microbatch slots)."""
    lay, stage = resolved.layout, resolved.recipe.zero.stage
    worst = max((stage_params(resolved.recipe.model, lay, r) for r in range(lay.pp)),
                key=lambda p: p.dense + p.expert)
    per_microbatch, per_step = dp_traffic(stage, lay.grad_accum)
    total = in_slots = 0.0
    for psi, size, span in ((worst.dense, lay.dp, lay.tp * lay.dp),
                            (worst.expert, lay.edp, lay.world_size // lay.pp)):
        if psi == 0 or size == 1:
            continue
        unit = grad_bytes * psi * _ring(size) / _bandwidth(span, profile)
        if lay.pp == 1:
            total += (per_microbatch + per_step) * unit * (1.0 - profile.dp_overlap)
            continue
        slots = per_microbatch * unit
        if per_microbatch:
            slots += lay.grad_accum * lay.vpp * (size - 1) * profile.p2p_latency_s
        in_slots += slots
        total += slots + per_step * unit
    return total, in_slots
