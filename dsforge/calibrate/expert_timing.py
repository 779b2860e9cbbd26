"""`dsforge calibrate`'s MoE figure: `expert_efficiency`, the share of the peak an MoE layer's
routed experts reach on the FLOPs dsforge counts for them (cost/step_time.py prices them at it).

An expert's products are far shorter than a dense layer's: a microbatch's tokens x top_k rows
are spread over the rank's experts, each a GEMM of its share. Timed are the experts as the
recipe's layout runs them (translate/experts.py choose_experts, for this device): `grouped`,
torch's grouped GEMM through runtime/assemble/grouped_moe.py's `_GroupedLinear` over the rows
in its aligned buffer (`aligned_rows`), or `sequential`, one F.linear per expert as
Megatron's SequentialMLP runs them. One MoE layer at one microbatch: rows = its tokens (a
context-parallel rank's shard; etp / tp of it under tensor parallelism) x top_k, spread
evenly over num_experts / ep experts (a balanced router), hidden -> 2 x ffn (gate and up) and ffn -> hidden (ffn / etp on an
expert-tensor-parallel rank), forward and backward (input and weight gradients). The FLOPs
counted are 6 x rows x 3 x hidden x ffn, as estimate/flops.py counts the experts: the
alignment's padding rows cost time and no FLOPs. SwiGLU and the token dispatch are the
`other` row's work, not timed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.calibrate.kernel_timing import WARMUP, device_capability, median_seconds, rank_tokens
from dsforge.recipe.resolve import Resolved


@dataclass(frozen=True)
class ExpertShape:
    rows: int  # a microbatch's routed rows on the rank: its tokens x top_k
    experts: int  # the rank's experts: num_experts / ep
    hidden: int
    ffn: int  # one expert's width on the rank (/ etp)

    @property
    def flops(self) -> float:
        """Forward and backward of fc1 (hidden -> 2 ffn) and fc2 (ffn -> hidden) over the rows."""
        return 6.0 * self.rows * (self.hidden * 2 * self.ffn + self.ffn * self.hidden)

    def counts(self) -> list[int]:
        """Each expert's rows, the rows spread evenly (the first take the remainder)."""
        share, extra = divmod(self.rows, self.experts)
        return [share + (e < extra) for e in range(self.experts)]


def expert_shape(resolved: Resolved) -> ExpertShape | None:
    """One MoE layer's expert products on a rank at the recipe's microbatch; None for a dense
    model."""
    m, lay = resolved.recipe.model, resolved.layout
    if m.moe is None:
        return None
    # Sequence parallelism leaves each tp rank 1/tp of the tokens; the dispatcher gathers them
    # over the expert-tensor-parallel group only, so a rank's experts see etp/tp of them.
    tokens = rank_tokens(resolved) * lay.etp // lay.tp
    return ExpertShape(rows=tokens * m.moe.top_k, experts=m.moe.num_experts // lay.ep,
                       hidden=m.hidden_size, ffn=m.moe.ffn_hidden_size // lay.etp)


def time_experts(resolved: Resolved, on, dtype, reps: int) -> dict | None:
    """{"impl", "why" (choose_experts'), "shape", "seconds" or "error"}; None for a dense model."""
    from dsforge.translate.experts import choose_experts

    shape = expert_shape(resolved)
    if shape is None:
        return None
    choice = choose_experts(resolved.recipe.model, device=on.type,
                            precision=resolved.recipe.train.precision, capability=device_capability(on))
    timed = {"impl": choice.impl, "why": choice.why, "shape": shape}
    build = grouped_step if choice.impl == "grouped" else sequential_step
    try:
        return {**timed, "seconds": median_seconds(build(shape, on, dtype), on, reps, WARMUP)}
    except RuntimeError as exc:  # no kernel for these inputs (e.g. the grouped GEMM in fp32)
        return {**timed, "error": str(exc).splitlines()[0][:200]}


def _weights(shape: ExpertShape, on, dtype) -> tuple[list, list]:
    """Each expert's fc1 [2 ffn, hidden] and fc2 [hidden, ffn], as nn.Linear holds them."""
    import torch

    def weight(out_features: int, in_features: int):
        return torch.randn(out_features, in_features, device=on, dtype=dtype, requires_grad=True)

    return ([weight(2 * shape.ffn, shape.hidden) for _ in range(shape.experts)],
            [weight(shape.hidden, shape.ffn) for _ in range(shape.experts)])


def grouped_step(shape: ExpertShape, on, dtype):
    """grouped_moe.py's two grouped GEMMs over its aligned buffer, forward and backward."""
    import torch

    from dsforge.runtime.assemble.grouped_moe import _GroupedLinear, aligned_rows

    counts = torch.tensor(shape.counts(), device=on)
    _, offsets, size = aligned_rows(counts, shape.rows)
    x = torch.randn(size, shape.hidden, device=on, dtype=dtype, requires_grad=True)
    z = torch.randn(size, shape.ffn, device=on, dtype=dtype, requires_grad=True)
    fc1, fc2 = _weights(shape, on, dtype)
    grads = (torch.randn(size, 2 * shape.ffn, device=on, dtype=dtype),
             torch.randn(size, shape.hidden, device=on, dtype=dtype))

    def step():
        out = (_GroupedLinear.apply(x, offsets, *fc1), _GroupedLinear.apply(z, offsets, *fc2))
        torch.autograd.grad(out, (x, z, *fc1, *fc2), grads)

    return step


def sequential_step(shape: ExpertShape, on, dtype):
    """SequentialMLP's loop: each expert's rows split off, one F.linear each, forward and
    backward."""
    import torch
    import torch.nn.functional as F

    counts = shape.counts()
    x = torch.randn(shape.rows, shape.hidden, device=on, dtype=dtype, requires_grad=True)
    z = torch.randn(shape.rows, shape.ffn, device=on, dtype=dtype, requires_grad=True)
    fc1, fc2 = _weights(shape, on, dtype)
    grads = (*torch.randn(shape.rows, 2 * shape.ffn, device=on, dtype=dtype).split(counts),
             *torch.randn(shape.rows, shape.hidden, device=on, dtype=dtype).split(counts))

    def step():
        out = ([F.linear(rows, w) for rows, w in zip(x.split(counts), fc1)]
               + [F.linear(rows, w) for rows, w in zip(z.split(counts), fc2)])
        torch.autograd.grad(out, (x, z, *fc1, *fc2), grads)

    return step


def cpu_estimate_flops(resolved: Resolved, reps: int) -> float:
    """FLOPs the experts' timings run (the CPU's estimate counts them at its dense rate): at
    the recipe's layout, and with every expert on one device for its layers (calibrate/layers.py)
    where that is another shape."""
    from dsforge.calibrate.layer_timing import recipe_shaped

    shape = expert_shape(resolved)
    if shape is None:
        return 0.0
    shapes = {shape, expert_shape(recipe_shaped(resolved, 1, 0))}
    return sum(s.flops for s in shapes) * (reps + WARMUP)


def expert_efficiency(timed: dict | None, peak_flops: float) -> float | None:
    """The experts' rate as a share of the peak (at most 1); None where none was timed."""
    if timed is None or "seconds" not in timed:
        return None
    return min(1.0, timed["shape"].flops / timed["seconds"] / peak_flops)


def expert_line(timed: dict | None, profile, recipe_name: str) -> str:
    """The report's line: the experts' rate and the efficiency written, or why none was."""
    if timed is None:
        return f"MoE experts: none in {recipe_name}'s model: nothing timed, expert_efficiency unset"
    s = timed["shape"]
    what = (f"MoE experts ({timed['impl']}: {timed['why']}), one layer's {s.rows:,} rows over "
            f"{s.experts} experts ({s.hidden}x{2 * s.ffn}, {s.ffn}x{s.hidden}), forward and backward")
    if "error" in timed:
        return f"{what}: no kernel ({timed['error']}): the experts at the GEMMs' rate"
    return (f"{what}: {s.flops / timed['seconds'] / 1e12:.3g} TFLOP/s: expert_efficiency "
            f"{profile.expert_efficiency:.4g}")
