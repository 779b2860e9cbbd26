"""Rules that span recipe sections or need the world size.

`validate(recipe, topology)` runs every rule and returns every violation (errors and
warnings) instead of stopping at the first. Rule ids match docs/validation.md, which says
where each rule comes from (DeepSpeed, Megatron-Core, KempnerForge, torchtitan). Rules local
to one section are checked when the section is built (schema.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dsforge.problems import Problem
from dsforge.recipe.layout import Topology, batch_sizes, data_parallel_size
from dsforge.recipe.schema import Recipe, divisors


@dataclass(frozen=True)
class _Context:
    topology: Topology | None
    dp: int | None  # None when the world size is unknown or does not divide
    grad_accum: int | None  # None when dp is unknown or the batch does not divide


Rule = Callable[[Recipe, _Context], Iterator[Problem]]


def validate(recipe: Recipe, topology: Topology | None) -> list[Problem]:
    """Every violated rule for this recipe in this world (topology None: world-free rules)."""
    dp = data_parallel_size(recipe, topology.world_size) if topology else None
    sizes = batch_sizes(recipe, dp) if dp else None
    ctx = _Context(topology=topology, dp=dp, grad_accum=sizes.grad_accum if sizes else None)
    return [problem for rule in RULES for problem in rule(recipe, ctx)]


def _choices(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return "{" + shown + (", ..." if len(values) > limit else "") + "}"


def parallel_arithmetic(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """P1/P2: world = dp x tp x pp x cp (EP is carved out of dp and does not multiply)."""
    if ctx.topology is None or ctx.dp is not None:
        return
    p, world = recipe.parallel, ctx.topology.world_size
    model_parallel = p.tp * p.pp * p.cp
    fields = {"world_size": world, "parallel.tp": p.tp, "parallel.pp": p.pp}
    if p.dp == -1:
        yield Problem(rule="P2", fields=fields,
                      message=f"the world size is not divisible by tp x pp x cp = {model_parallel}",
                      fix=f"use a world size that is a multiple of {model_parallel}, or tp/pp with "
                          f"tp x pp in {_choices(divisors(world))}")
    else:
        yield Problem(rule="P1", fields={**fields, "parallel.dp": p.dp},
                      message=f"dp x tp x pp x cp = {p.dp * model_parallel} is not the world size",
                      fix="set parallel.dp: -1 to use the rest of the world")


def tensor_parallel_in_node(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """P4: a TP group spanning nodes puts per-layer all-reduces on the inter-node network."""
    top, tp = ctx.topology, recipe.parallel.tp
    if top is None or top.node_slots is None or tp == 1 or ctx.dp is None:
        return
    spanning = [g for g in range(top.world_size // tp)
                if top.node_of(g * tp) != top.node_of(g * tp + tp - 1)]
    if spanning:
        yield Problem(rule="P4", severity="warning",
                      fields={"parallel.tp": tp, "GPUs per node": min(top.node_slots)},
                      message=f"{len(spanning)} tensor-parallel group(s) span nodes; every layer "
                              "then all-reduces over the inter-node network",
                      fix="keep tp <= GPUs per node (use pp or dp across nodes)")


def batch_arithmetic(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """B1/B2: global_batch = micro_batch x grad_accum x dp, exactly."""
    if ctx.dp is None or ctx.grad_accum is not None:
        return
    t, dp = recipe.train, ctx.dp
    fields = {"train.global_batch": t.global_batch, "train.micro_batch": t.micro_batch,
              "train.grad_accum": t.grad_accum, "dp": dp}
    fields = {k: v for k, v in fields.items() if v is not None}
    if t.micro_batch is None:  # global and grad_accum given: micro_batch must come out whole
        step = t.grad_accum * dp
        yield Problem(rule="B2", fields=fields,
                      message=f"global_batch is not a positive multiple of grad_accum x dp = {step}",
                      fix=f"use global_batch {_near(t.global_batch, step)}, or leave out grad_accum")
        return
    step = t.micro_batch * dp
    if t.global_batch % step == 0 and t.global_batch >= step:
        yield Problem(rule="B1", fields=fields,
                      message=f"micro_batch x grad_accum x dp = {step * t.grad_accum}, not "
                              "global_batch",
                      fix="leave out one of global_batch, micro_batch and grad_accum so it is derived")
        return
    micro_choices = [m for m in divisors(t.global_batch) if t.global_batch % (m * dp) == 0]
    yield Problem(rule="B2", fields=fields,
                  message=f"global_batch is not a positive multiple of micro_batch x dp = {step}",
                  fix=f"use global_batch {_near(t.global_batch, step)}"
                      + (f", or a micro_batch in {_choices(micro_choices)}" if micro_choices else ""))


def _near(value: int, step: int) -> str:
    lower = max(step, value // step * step)
    return f"{lower}" if lower > value else f"{lower} or {lower + step}"


def pipeline_layers(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """L1/L2: every (virtual) pipeline stage gets the same whole number of layers."""
    p, layers = recipe.parallel, recipe.model.num_layers
    if layers % (p.pp * p.vpp) == 0:
        return
    if p.vpp == 1:
        yield Problem(rule="L1", fields={"model.num_layers": layers, "parallel.pp": p.pp},
                      message=f"num_layers is not divisible by pp={p.pp}",
                      fix=f"use pp in {_choices(divisors(layers))}")
        return
    if layers % p.pp == 0:
        fix = f"use vpp in {_choices(divisors(layers // p.pp))}"
    else:
        fix = f"use pp in {_choices(divisors(layers))}"
    yield Problem(rule="L2", fields={"model.num_layers": layers, "parallel.pp": p.pp,
                                     "parallel.vpp": p.vpp},
                  message=f"num_layers is not divisible by pp*vpp={p.pp * p.vpp}", fix=fix)


def pipeline_microbatches(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """L6: fewer microbatches than stages hangs (torchtitan #775); L4: interleaved grouping."""
    p, m = recipe.parallel, ctx.grad_accum
    if p.pp == 1 or m is None:
        return
    fields = {"microbatches (grad_accum)": m, "parallel.pp": p.pp}
    if m < p.pp:
        yield Problem(rule="L6", fields=fields,
                      message="fewer microbatches per step than pipeline stages",
                      fix=f"raise train.global_batch (or lower micro_batch) so that grad_accum >= {p.pp}")
    elif p.vpp > 1 and m % p.pp:
        # Megatron-Core groups microbatches per virtual stage in groups of pp; a remainder
        # group smaller than pp raises at the first step.
        yield Problem(rule="L4", fields={**fields, "parallel.vpp": p.vpp},
                      message="the interleaved schedule needs the number of microbatches to be "
                              "a multiple of pp",
                      fix=f"make grad_accum a multiple of {p.pp}, e.g. {m - m % p.pp} or "
                          f"{m - m % p.pp + p.pp}")


def pipeline_embeddings(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """L5: tied embeddings across pipeline stages need an embedding-group gradient sync."""
    if recipe.model.tie_embeddings and recipe.parallel.pp > 1:
        yield Problem(rule="L5", fields={"model.tie_embeddings": True, "parallel.pp": recipe.parallel.pp},
                      message="tied input/output embeddings live on the first and last pipeline "
                              "stages; dsforge does not synchronise their gradients across stages",
                      fix="set model.tie_embeddings: false, or pp: 1")


def tensor_parallel_shapes(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """T1: heads, query groups and MLP widths split evenly across the tensor-parallel group."""
    m, tp = recipe.model, recipe.parallel.tp
    if m.num_attention_heads % tp:
        yield Problem(rule="T1", fields={"model.num_attention_heads": m.num_attention_heads,
                                         "parallel.tp": tp},
                      message="attention heads must divide evenly across tp",
                      fix=f"use tp in {_choices(divisors(m.num_attention_heads))}")
    groups = m.query_groups
    if groups % tp and tp % groups:
        yield Problem(rule="T1", fields={"model.num_kv_heads": groups, "parallel.tp": tp},
                      message="the number of KV heads (query groups) must be a multiple or a "
                              "divisor of tp",
                      fix=f"use tp in {_choices(divisors(groups))} or a multiple of {groups}")
    if m.ffn_hidden_size % tp:
        yield Problem(rule="T1", fields={"model.ffn_hidden_size": m.ffn_hidden_size, "parallel.tp": tp},
                      message="the MLP width must divide evenly across tp",
                      fix=f"use an ffn_hidden_size that is a multiple of {tp}")
    etp = recipe.parallel.expert_tp
    if m.moe is not None and m.moe.ffn_hidden_size % etp:
        yield Problem(rule="T1", fields={"model.moe.ffn_hidden_size": m.moe.ffn_hidden_size,
                                         "expert tensor parallel": etp},
                      message="the expert MLP width must divide evenly across expert tp",
                      fix=f"use a multiple of {etp}")


def sequence_length(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """T6: training sequences must fit the model's position range."""
    t, m = recipe.train, recipe.model
    if t.seq_len > m.max_seq_len:
        yield Problem(rule="T6", fields={"train.seq_len": t.seq_len, "model.max_seq_len": m.max_seq_len},
                      message="seq_len exceeds the model's max_seq_len",
                      fix=f"use seq_len <= {m.max_seq_len}, or raise model.max_seq_len")


def expert_parallel(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """E1/E3/E4 and the expert grid: etp x ep x edp x pp must tile the world."""
    m, p = recipe.model, recipe.parallel
    if m.moe is None:
        if p.ep > 1:
            yield Problem(rule="E1", fields={"parallel.ep": p.ep, "model.moe": None},
                          message="expert parallelism needs an MoE model",
                          fix="set parallel.ep: 1, or add a model.moe section")
        return
    if m.moe.num_experts % p.ep:
        yield Problem(rule="E1", fields={"model.moe.num_experts": m.moe.num_experts, "parallel.ep": p.ep},
                      message="experts must divide evenly across expert-parallel ranks",
                      fix=f"use ep in {_choices(divisors(m.moe.num_experts))}")
    if p.tp > 1 and not p.sequence_parallel:
        yield Problem(rule="E3", fields={"parallel.tp": p.tp, "parallel.sequence_parallel": False},
                      message="MoE with tensor parallelism requires sequence parallelism "
                              "(Megatron-Core 0.16 raises otherwise)",
                      fix="set parallel.sequence_parallel: true")
    if m.bias and p.expert_tp > 1:
        yield Problem(rule="E4", fields={"model.bias": True, "expert tensor parallel": p.expert_tp},
                      message="bias in MoE expert layers needs expert tensor parallel size 1",
                      fix="set model.bias: false, or parallel.etp: 1")
    if p.ep > 1 and recipe.zero.stage == 3:
        yield Problem(rule="E6", fields={"parallel.ep": p.ep, "zero.stage": 3},
                      message="DeepSpeed's ZeRO-3 partitions every parameter over the data-parallel "
                              "group; expert weights differ across expert-parallel ranks and "
                              "DeepSpeed refuses its MoE handling with ZeRO stage 3",
                      fix="use zero.stage 1 or 2 with ep > 1, or ep: 1 with ZeRO-3")
    if p.ep > 1 and recipe.zero.stage == 0 and recipe.train.checkpoint_every:
        yield Problem(rule="E7", fields={"parallel.ep": p.ep, "zero.stage": 0,
                                         "train.checkpoint_every": recipe.train.checkpoint_every},
                      message="without ZeRO, DeepSpeed saves optimizer state from data-parallel rank "
                              "0 only, but with expert parallelism the data-parallel ranks hold "
                              "different experts, so their optimizer state would be lost",
                      fix="use zero.stage 1 or 2 (each rank saves its own optimizer partition), "
                          "or train.checkpoint_every: 0")
    if ctx.topology is not None and ctx.dp is not None:
        grid = p.expert_tp * p.ep * p.pp
        if ctx.topology.world_size % grid:
            yield Problem(rule="E1", fields={"world_size": ctx.topology.world_size,
                                             "expert tp": p.expert_tp, "parallel.ep": p.ep,
                                             "parallel.pp": p.pp},
                          message=f"the expert grid etp x ep x pp = {grid} does not divide the world",
                          fix="choose ep (and etp) so that etp x ep divides dp x tp")


def zero_with_pipeline(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """Z2: ZeRO 2/3 reduce (and partition) gradients in backward hooks, once per backward."""
    stage, pp = recipe.zero.stage, recipe.parallel.pp
    if stage >= 2 and pp > 1:
        yield Problem(rule="Z2", fields={"zero.stage": stage, "parallel.pp": pp},
                      message="ZeRO stages 2 and 3 set up their gradient buckets and reduce inside "
                              "DeepSpeed's own engine.backward(), once per microbatch; with pp > 1 "
                              "Megatron-Core's schedule runs the per-stage backward passes itself "
                              "(DeepSpeed's PipelineEngine refuses ZeRO 2/3 too)",
                      fix="use zero.stage: 1 with pipeline parallelism, or pp: 1 with stage 2/3")


def token_file(recipe: Recipe, ctx: _Context) -> Iterator[Problem]:
    """D2: a token file exists, holds whole tokens and at least one sample."""
    d, seq_len = recipe.data, recipe.train.seq_len
    if d.source == "synthetic":
        return
    path = Path(d.source)
    if not path.is_file():
        yield Problem(rule="D2", fields={"data.source": d.source}, message="token file not found",
                      fix="check the path (relative paths start at the recipe's directory), or "
                          "make one with tools/tokenize_text.py")
        return
    width = 2 if d.token_dtype == "uint16" else 4
    size = path.stat().st_size
    if size % width or size // width < seq_len + 1:
        yield Problem(rule="D2", fields={"data.source": d.source, "data.token_dtype": d.token_dtype,
                                         "train.seq_len": seq_len},
                      message=f"{size} bytes is not a whole number of {d.token_dtype} tokens, or "
                              "fewer than one sample of seq_len + 1",
                      fix="check data.token_dtype, or use a longer file or a shorter seq_len")


RULES: tuple[Rule, ...] = (
    parallel_arithmetic, tensor_parallel_in_node, batch_arithmetic, pipeline_layers,
    pipeline_microbatches, pipeline_embeddings, tensor_parallel_shapes, sequence_length,
    expert_parallel, zero_with_pipeline, token_file,
)
