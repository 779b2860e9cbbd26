"""Grouped-GEMM experts and, at expert parallelism 1, a token dispatch with no host sync
(model.moe.experts: grouped; translate/experts.py decides where).

`GroupedExperts` is Megatron-Core's SequentialMLP with another forward: the same per-expert
MLPs hold the weights (the same names, initialisation, checkpoints, Hugging Face export and
expert-parallel sharding), and a layer's experts run as two grouped GEMMs over the tokens
sorted by expert: gate and up projections together, SwiGLU (Liger's where the dense MLP uses
it), the routing probabilities applied before the down projection as Megatron's MLP applies
them, the down projection. Each expert's group starts at a multiple of ALIGN_ROWS rows (torch's
CUTLASS kernel wants aligned groups), placed on the device from the token counts.

The experts' weights are stacked for each GEMM (a copy, freed after it); the backward stacks
them again rather than keeping the copy (`_GroupedLinear`): autograd would otherwise hold a
second copy of every MoE layer's expert weights from the forward to the backward. Under ZeRO-3
the module is a DeepSpeed leaf (its experts' partitions are gathered together, once).

`DeviceDispatchMoELayer` replaces Megatron's token dispatcher where no token leaves the rank
(ep 1, etp 1): the router's top-k experts of each token are sorted on the device
(a stable argsort), the experts run on them, and each token's outputs are added back
(index_add). Megatron's all-to-all dispatcher copies the token counts to the host in every layer
of every microbatch even at ep 1, splits and re-joins the tokens, and calls masked_select; at
ep > 1 it stays (tokens must cross ranks), with GroupedExperts after it. The router and its
load-balancing loss are Megatron's in both.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

ALIGN_ROWS = 16


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM: F.grouped_mm where torch has the public name (2.13 here), else
    the private op it wraps."""
    function = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return function(a, b, offs=offs)


class _GroupedLinear(torch.autograd.Function):
    """y[rows of group g] = x[rows of group g] @ weights[g].T for every expert g (weights as
    nn.Linear holds them: [out, in]). The stacked weights are made again in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # the kernel wants a dense incoming gradient
        grad_x = grouped_mm(grad, torch.stack(weights), offs)
        # The weights' gradients, one [out, in] block per group of rows (zero for an empty one).
        grad_w = grouped_mm(grad.t(), x, offs)
        return (grad_x, None, *grad_w.unbind(0))


def aligned_rows(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For `rows` rows sorted by group, `counts[g]` of group g: where each row goes in a buffer
    whose groups start at multiples of ALIGN_ROWS, the buffer's group offsets (int32, as the
    kernel takes them; the last group also takes the spare rows at the end, all zero) and the
    buffer's size (rows + groups x (ALIGN_ROWS - 1), rounded up to ALIGN_ROWS: known on the
    host without the counts, and every offset aligned)."""
    groups = counts.numel()
    size = -(-(rows + groups * (ALIGN_ROWS - 1)) // ALIGN_ROWS) * ALIGN_ROWS
    padded = (counts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    padded_ends, ends = torch.cumsum(padded, 0), torch.cumsum(counts, 0)
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=counts.device), counts,
                                           output_size=rows)
    shift = (padded_ends - padded - (ends - counts))[group_of_row]
    destination = torch.arange(rows, device=counts.device) + shift
    offsets = padded_ends.to(torch.int32)
    offsets[-1] = size
    return destination, offsets, size


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts and weights, run as grouped GEMMs."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if not config.gated_linear_unit or config.add_bias_linear or \
                config.moe_apply_probs_on_input:
            raise ValueError("grouped experts compute SwiGLU experts without biases, with the "
                             "routing probabilities applied before the down projection")
        self._z3_leaf = True  # DeepSpeed ZeRO-3 gathers every expert's weights together

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor):
        """`hidden` [rows, h]: the tokens sorted by local expert, `tokens_per_expert[g]` of
        expert g (on the device or the host); `probs` [rows] their routing probabilities."""
        counts = tokens_per_expert.to(hidden.device, torch.int64, non_blocking=True)
        destination, offsets, size = aligned_rows(counts, hidden.shape[0])
        x = hidden.new_zeros(size, hidden.shape[1]).index_copy(0, destination, hidden)
        scale = probs.new_zeros(size).index_copy(0, destination, probs)
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        intermediate = self._swiglu(_GroupedLinear.apply(x, offsets, *fc1), scale)
        out = _GroupedLinear.apply(intermediate, offsets, *fc2)
        return out.index_select(0, destination), None

    def _swiglu(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """As Megatron's MLP: the activation (its module where the experts have one, Liger's
        SwiGLU with model.kernels: liger), then the routing probability, back in x's dtype."""
        if self.config.use_te_activation_func:
            out = self.local_experts[0].activation_func(x)
        else:
            gate, up = torch.chunk(x, 2, dim=-1)
            out = self.config.activation_func(gate) * up
        return (out * scale.unsqueeze(-1)).to(out.dtype)


class DeviceDispatchMoELayer(MoELayer):
    """Megatron's MoE layer with its token dispatch done on the device (ep 1, etp 1)."""

    def preprocess(self, hidden_states, probs, routing_map):
        return hidden_states, (probs, routing_map)

    def dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def routed_experts_compute(self, hidden_states, routes):
        """Each token's top-k experts, sorted by expert (stable: a token's rows keep their
        order), through the experts, and each token's outputs added up."""
        probs, routing_map = routes
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        top_k = self.config.moe_router_topk
        chosen = routing_map.to(torch.float32).topk(top_k, dim=-1).indices.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        tokens, experts = order // top_k, chosen[order]
        counts = routing_map.sum(dim=0)
        out, _ = self.experts(x[tokens], counts, probs[tokens, experts])
        combined = torch.zeros_like(x).index_add(0, tokens, out)
        return combined.reshape(hidden_states.shape), None

    def combine(self, output):
        return output

    def postprocess(self, output, shared_expert_output):
        return output if shared_expert_output is None else output + shared_expert_output
