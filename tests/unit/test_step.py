"""Where a step takes its census (dsforge.runtime.loop.step): at the end of the last backward,
and inside each torch optimizer step.

Both tests drive step.py's helpers (census_at_last_backward, step_with_census) directly: the
public step_pipelined / step_unpipelined need a DeepSpeed engine (and, pipelined, Megatron's
schedule) to reach them; tests/distributed runs those."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsforge.runtime.loop import step
from dsforge.runtime.loop.step import census_at_last_backward, step_with_census


def test_the_census_inside_a_pipelined_step_runs_when_its_last_backward_ends():
    """The hook counts backward passes; on the last one the census runs after every gradient
    of that pass and before what the prologue queued (DeepSpeed's epilogue)."""
    calls = []
    weight = torch.ones(3, requires_grad=True)

    def prologue():
        torch.autograd.Variable._execution_engine.queue_callback(lambda: calls.append("epilogue"))

    hook = census_at_last_backward(lambda point: calls.append((point, weight.grad.sum().item())),
                                    prologue, backwards=2)
    for _ in range(2):
        out = weight * 2
        out.register_hook(lambda grad: hook())  # where DeepSpeed's output hook would run
        out.sum().backward()
    assert calls == ["epilogue", ("backward", 12.0), "epilogue"]


def test_the_optimizer_census_runs_inside_each_torch_step_and_is_removed_after():
    """ZeRO-3 steps the torch optimizer once per sub-group: the census runs each time."""
    weight = torch.nn.Parameter(torch.ones(4))
    adam = torch.optim.AdamW([weight])

    def step():
        for _ in range(2):
            weight.grad = torch.ones(4)
            adam.step()

    calls = []
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=adam), step=step)
    step_with_census(engine, calls.append)
    assert calls == ["optimizer", "optimizer"]
    step_with_census(engine, None)
    assert calls == ["optimizer", "optimizer"]  # the hook is gone


def test_the_moe_aux_loss_gradient_carries_fp16s_loss_scale(monkeypatch):
    """DeepSpeed's fp16 backward multiplies the loss by its scale and its update divides every
    gradient by it: the aux loss's gradient, set apart by Megatron's MoEAuxLossAutoScaler,
    must carry it too (it was 2^16 x too weak at the start of an fp16 run)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale",
                        MoEAuxLossAutoScaler.main_loss_backward_scale)  # restored after
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    class Sharded(ZeROOptimizer):  # DeepSpeed's ZeRO-1/2/3 optimizers, whose loss it scales
        loss_scale = 65536.0

    fp16 = SimpleNamespace(fp16_enabled=lambda: True, optimizer=Sharded())
    bf16 = SimpleNamespace(fp16_enabled=lambda: False, optimizer=SimpleNamespace())
    unscaled = SimpleNamespace(fp16_enabled=lambda: True,  # ZeRO 0 (rule Z7): DeepSpeed does not scale
                               optimizer=SimpleNamespace(loss_scale=65536.0))
    assert [step._fp16_loss_scale(e) for e in (fp16, bf16, unscaled)] == [65536.0, 1.0, 1.0]
    step._scale_moe_aux_loss(0.5 * step._fp16_loss_scale(fp16), torch.device("cpu"))
    aux = torch.tensor(2.0, requires_grad=True)
    MoEAuxLossAutoScaler.apply(torch.zeros(1, requires_grad=True), aux).sum().backward()
    assert aux.grad.item() == 0.5 * 65536
