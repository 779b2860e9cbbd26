"""One optimizer step: forward/backward over the step's microbatches, then DeepSpeed's update.

Two paths, one per kind of layout:
- pp = 1: DeepSpeed drives gradient accumulation itself (engine forward/backward/step per
  microbatch; its ZeRO 2/3 hooks reduce and partition gradients per backward). Every ZeRO
  stage works here.
- pp > 1: Megatron-Core's schedule (1F1B, or interleaved 1F1B over the virtual stages) runs
  every forward and backward; DeepSpeed runs with managed_gradient_accumulation=false, so
  `engine.step()` is the accumulation boundary: it reduces the accumulated gradients over the
  data-parallel group (ZeRO 0/1), clips and steps. The schedule divides each microbatch loss
  by the number of microbatches, as DeepSpeed's own backward would. ZeRO-2 keeps only its
  partition of the gradients, so it must reduce-scatter after every backward: each chunk's
  output carries DeepSpeed's backward prologue (`per_backward_reduction`), and DeepSpeed's
  torch-style-backward hook runs the matching epilogue (the reduce-scatter) when that
  backward's autograd pass ends.
Both return the step's mean loss on this rank (None on pipeline ranks without the loss).
`eval_unpipelined` / `eval_pipelined` run the same forward passes without gradients and
without an update, for the validation loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from dsforge.runtime.loop.breakdown import OFF
from dsforge.runtime.loop.data import Microbatch
from dsforge.runtime.loop.metrics import loss_scale


def _loss_of(chunk_output: torch.Tensor, mb: Microbatch) -> torch.Tensor:
    """GPTModel returns per-token cross entropy [batch, seq] when given labels: their mean;
    with data.eod_mask_loss the tokens that count summed, times the global batch's factor
    (runtime/loop/data.weigh_loss)."""
    if mb.loss_mask is None:
        return chunk_output.float().mean()
    mask = mb.loss_mask.to(chunk_output.device)
    return (chunk_output.float() * mask).sum() * mb.loss_norm


def _forward(model, mb: Microbatch, device) -> torch.Tensor:
    """The model (an engine or a chunk) on microbatch `mb`: Megatron's attention_mask argument
    carries the document ids when documents are masked (runtime/assemble/documents.py)."""
    documents = None if mb.documents is None else mb.documents.to(device)
    return model(mb.tokens.to(device), mb.position_ids.to(device), documents,
                 labels=mb.labels.to(device))


def _spoiled_if_not_finite(loss: torch.Tensor) -> torch.Tensor:
    """The loss to back-propagate: `loss`, times NaN when it is not finite (on the device, no
    host sync). A non-finite loss can have finite gradients (cross entropy is infinite where
    the target's logit is -inf, while its gradient, softmax minus one-hot, is finite); spoiled,
    they meet DeepSpeed's overflow check, which drops the step's update at every ZeRO stage
    (runtime/guard/health.py). A finite loss is multiplied by exactly 1."""
    return loss * torch.where(torch.isfinite(loss), 1.0, math.nan)


# A census (runtime/loop/tensor_census.py) asked for at three points of a step: "backward", when the
# autograd pass of the step's last backward ends, before DeepSpeed's epilogue reduces it (this
# microbatch's gradients in .grad or ZeRO's bucket, the others' as the ZeRO stage keeps them);
# "step", after the last backward, before `engine.step()`; and "optimizer", inside it, when
# the torch optimizer is about to step (DeepSpeed has made its fp32 gradient by then, and
# freed what it frees first; ZeRO-3 steps once per sub-group, so the point repeats).
Census = Callable[[str], None]


def step_with_census(engine, census: Census | None) -> None:
    """`engine.step()`, with the "optimizer" census taken each time the innermost torch
    optimizer steps (DeepSpeed wraps it, sometimes twice)."""
    if census is None:
        engine.step()
        return
    from dsforge.runtime.loop.tensor_census import innermost_optimizer

    optimizer = innermost_optimizer(engine.optimizer)
    hook = optimizer.register_step_pre_hook(lambda *_: census("optimizer"))
    try:
        engine.step()
    finally:
        hook.remove()


def _census_at_end_of_backward(census: Census) -> None:
    """Queue the census on the running autograd pass: final callbacks run in the order queued,
    after every gradient of the pass, so this one runs before the callback DeepSpeed's
    prologue queues next (ZeRO-2/3's epilogue, which empties the bucket)."""
    torch.autograd.Variable._execution_engine.queue_callback(lambda: census("backward"))


def step_unpipelined(engine, batches: list[Microbatch], device, census: Census | None = None,
                     clock=OFF) -> torch.Tensor:
    """`clock` (runtime/loop/breakdown.py) marks each microbatch's forward, backward and
    `engine.step()` (the optimizer phase: an update only after the last microbatch)."""
    _scale_moe_aux_loss(_context_parallel_size() / len(batches) * _fp16_loss_scale(engine), device)
    losses = []
    for i, mb in enumerate(batches):
        last = i == len(batches) - 1
        with clock.phase("forward"):
            loss = _loss_of(_forward(engine, mb, device), mb)
        if census and last:
            # a hook on the loss runs inside the pass engine.backward starts
            loss.register_hook(lambda grad: _census_at_end_of_backward(census))
        with clock.phase("backward"):
            engine.backward(_spoiled_if_not_finite(loss))
        if census and last:
            census("step")
        with clock.phase("optimizer"):
            step_with_census(engine, census if last else None)
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def step_pipelined(engine, chunks, batches: list[Microbatch], *, seq_len: int,
                   micro_batch: int, device, census: Census | None = None,
                   clock=OFF) -> torch.Tensor | None:
    """Megatron's schedule marks its own phases through `config.timers` (runtime/loop/timers.py);
    `clock` marks `engine.step()` as the optimizer phase."""
    prologue = per_backward_reduction(engine)
    _accumulate_from_zero(engine)
    on_backward = prologue
    if census:
        on_backward = census_at_last_backward(census, prologue, len(batches) * len(chunks))
    loss = _run_schedule(chunks, batches, seq_len=seq_len, micro_batch=micro_batch,
                         device=device, forward_only=False, on_backward=on_backward)
    if prologue is not None:
        _check_every_backward_reduced(engine)
    if census:
        census("step")
    with clock.phase("optimizer"):
        step_with_census(engine, census)
    return loss


def census_at_last_backward(census: Census, prologue: Callable[[], None] | None,
                             backwards: int) -> Callable[[], None]:
    """The per-backward hook, counting: the census runs at the end of the rank's last backward
    of the step (microbatches x virtual stages of them)."""
    started = 0

    def on_backward() -> None:
        nonlocal started
        started += 1
        if started == backwards:
            _census_at_end_of_backward(census)
        if prologue is not None:
            prologue()

    return on_backward


def per_backward_reduction(engine) -> Callable[[], None] | None:
    """What must run when each model chunk's backward starts (one call per microbatch per
    virtual stage), or None when the ZeRO stage reduces at `engine.step()` (0, 1).

    ZeRO-2 and ZeRO-3 reduce-scatter each backward's gradients into their partition. DeepSpeed
    does it for a backward it did not start ("torch-style backward", `_support_torch_style_backward`)
    when the backward began with `_backward_prologue` (it enters the optimizer's backward
    state and queues `_backward_post_hook` on the running autograd pass; the hook runs
    `_backward_epilogue`: the remaining bucket's reduce-scatter, then the partition's
    accumulation). `DeepSpeedEngine.forward` registers the prologue on its outputs; dsforge
    calls the chunks directly, so it registers it the same way, without the engine's
    per-output division by the accumulation steps (the schedule has divided the loss by the
    number of microbatches already). The optimizer's per-backward hook state is cleared first,
    as the engine's forward does: in 1F1B's cool-down several backwards follow each other with
    no forward between them."""
    if not engine.zero_optimization_partition_gradients():
        return None
    if not engine._support_torch_style_backward:
        raise RuntimeError("DeepSpeed cannot reduce ZeRO-2/3 gradients of a backward it did not "
                           "start (torch-style backward is off); it needs torch's "
                           "count_used_parameters internals")

    def prologue() -> None:
        engine.optimizer.clear_backward_seen_flag()
        engine._backward_prologue()

    return prologue


def _accumulate_from_zero(engine) -> None:
    """ZeRO-3: every backward of the step adds its gradient partition onto a buffer zeroed
    here, instead of DeepSpeed's own rule (copy on the step's first backward, add afterwards,
    one `micro_step_id` for all the rank's chunks). Under the interleaved schedule a chunk's
    first backward is not the step's first, so it added onto the previous step's gradients
    (measured: the second step's gradient norm 57% too large)."""
    if engine.zero_optimization_stage() != 3:
        return
    optimizer = engine.optimizer
    optimizer.grad_partitions_flat_buffer.zero_()
    optimizer.micro_step_id = 1  # never 0 during the schedule: partition_grads adds


def _check_every_backward_reduced(engine) -> None:
    """Each prologue entered the optimizer's backward state once; each epilogue left it. A
    backward whose epilogue did not run would leave its gradients unreduced in the bucket, and
    the step would silently miss them."""
    depth = engine.optimizer._backward_active_depth
    if depth != 0:
        raise RuntimeError(f"{depth} backward pass(es) of this step ended without DeepSpeed's "
                           "ZeRO-2/3 reduction (its epilogue did not run)")


def eval_unpipelined(engine, batches: list[Microbatch], device) -> torch.Tensor:
    losses = []
    with torch.no_grad():
        for mb in batches:
            losses.append(_loss_of(_forward(engine, mb, device), mb))
    return torch.stack(losses).mean()


def validation_mean(losses: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """The mean of (batch loss, batch_weight) pairs: weighted by the tokens that count where
    the loss is masked, plain otherwise."""
    values = torch.stack([loss for loss, _ in losses])
    if losses[0][1] is None:
        return values.mean()
    weights = torch.stack([weight.reshape(()) for _, weight in losses]).to(values)
    return (values * weights).sum() / weights.sum()


def eval_pipelined(chunks, batches: list[Microbatch], *, seq_len: int, micro_batch: int,
                   device) -> torch.Tensor | None:
    """Megatron's schedule with forward_only=True: the same p2p pattern as training, minus the
    backward passes, on every rank of the pipeline (so no rank waits for a peer that skipped)."""
    with torch.no_grad():
        return _run_schedule(chunks, batches, seq_len=seq_len, micro_batch=micro_batch,
                             device=device, forward_only=True)


def _run_schedule(chunks, batches: list[Microbatch], *, seq_len: int, micro_batch: int, device,
                  forward_only: bool,
                  on_backward: Callable[[], None] | None = None) -> torch.Tensor | None:
    """Megatron-Core's schedule (1F1B, or interleaved over the virtual stages) over `batches`;
    the mean microbatch loss on the last pipeline stage, None elsewhere. `on_backward` runs
    once at the start of each chunk's backward of each microbatch."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Every model chunk walks the same microbatches in order; each uses what it needs
    # (tokens on the first stage, labels on the last).
    iterators = [iter(batches) for _ in chunks]
    results = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, device=device, on_backward=on_backward),
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches), seq_length=seq_len, micro_batch_size=micro_batch,
        forward_only=forward_only)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.stack([r["loss"] for r in results]).mean()


def _forward_step(data_iterator, model, device, on_backward=None):
    mb = next(data_iterator)
    output = _forward(model, mb, device)
    if on_backward is not None:
        from deepspeed.runtime.utils import register_output_backward_hooks

        # Its hook fires when the gradient reaches this output: before any of the chunk's
        # parameter gradients, whether the backward starts at the loss (last stage) or at the
        # gradient received from the next stage.
        register_output_backward_hooks(output, preprocess_once_fn=on_backward)

    def loss_func(output_tensor):
        loss = _loss_of(output_tensor, mb)
        # The schedule multiplies the loss it back-propagates by the context-parallel size
        # (Megatron's loss functions reduce over cp first) and divides it by num_microbatches,
        # in place. A rank's loss here is its shard's mean, and DeepSpeed averages the
        # gradients over dp x cp: divided by cp, the gradient is the whole sequence's. The
        # reported loss is a copy, unscaled.
        return (_spoiled_if_not_finite(loss) / _context_parallel_size(),
                {"loss": loss.detach().clone()})

    return output, loss_func


def _context_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def _fp16_loss_scale(engine) -> float:
    """What engine.backward() multiplies the loss by before its backward, and DeepSpeed's
    update divides every gradient by: fp16's dynamic loss scale, else 1. The MoE aux loss's
    gradient, set apart from the loss, must carry it too (as Megatron's schedules give it
    their grad_scale_func's scale), or fp16 would leave the load balancing cur_scale x too weak.
    DeepSpeed 0.19.8 scales only for its ZeRO optimizers (fp16 without ZeRO is rule Z7's)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if not engine.fp16_enabled() or not isinstance(engine.optimizer, ZeROOptimizer):
        return 1.0
    return loss_scale(engine.optimizer, "fp16") or 1.0


def _scale_moe_aux_loss(scale: float, device) -> None:
    """engine.backward() divides the loss by the accumulation steps; Megatron's MoE auxiliary
    (load-balancing) loss gets its gradient scale from a class-level setting that only
    Megatron's own schedules set. Match them, or the aux loss would weigh grad_accum x more.
    With context parallelism each rank's aux loss is its share of the whole sequence's (the
    router counts tokens over tp x cp), so the shares' gradients must add over cp where
    DeepSpeed averages them: the scale is cp / grad_accum, as Megatron's schedules set it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), scale, device=device))
