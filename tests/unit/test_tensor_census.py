"""The live-tensor census (dsforge.runtime.loop.tensor_census): storage sorted by owner, with
ZeRO's gradient partitions, its reduce bucket and the optimizer's own gradient."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsforge.runtime.loop.tensor_census import live_tensor_bytes


def test_tensor_census_sorts_live_storage_by_owner():
    model = torch.nn.Linear(64, 32, bias=False)  # 2048 fp32 weights: 8 KiB
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # m and v: 16 KiB
    wrapper = SimpleNamespace(optimizer=optimizer)  # DeepSpeed's wrapper holds the torch one
    stray = torch.zeros(1000)  # a buffer nobody owns: 4000 bytes  # noqa: F841
    census = live_tensor_bytes(SimpleNamespace(module=model, optimizer=wrapper), torch.device("cpu"))
    assert census["params"] == 8192 and census["grads"] == 8192
    assert census["optimizer"] >= 16384  # + Adam's step counters
    assert census["other"] >= 4000
    assert census["bucket"] == 0
    assert census["total"] == sum(census[k] for k in ("params", "grads", "bucket", "optimizer", "other"))


def test_tensor_census_counts_zero_gradient_partitions_and_the_reduce_bucket():
    """ZeRO 2/3 keep gradients outside .grad (a flat partition, views of it per group) and
    gather each backward's gradients in a reduce bucket (stage 1/2: a list of buffers)."""
    model = torch.nn.Linear(64, 32, bias=False)
    flat = torch.zeros(1024)  # this rank's gradient partition: 4 KiB
    zero = SimpleNamespace(grads_in_partition=flat, averaged_gradients={0: [flat[:512], flat[512:]]},
                           ipg_buckets={torch.float32: SimpleNamespace(buffer=[torch.empty(3000)])})
    census = live_tensor_bytes(SimpleNamespace(module=model, optimizer=zero), torch.device("cpu"))
    assert census["grads"] == 4096 and census["bucket"] == 12000
    zero3 = SimpleNamespace(grad_partitions_flat_buffer=flat,
                            ipg_buckets={torch.float32: SimpleNamespace(buffer=torch.empty(500))})
    census = live_tensor_bytes(SimpleNamespace(module=model, optimizer=zero3), torch.device("cpu"))
    assert census["grads"] == 4096 and census["bucket"] == 2000


def test_the_census_counts_the_optimizers_own_gradient_as_step_grads():
    """DeepSpeed steps an fp32 copy whose .grad it makes in the step: that is step_grads; a
    model parameter the optimizer steps directly keeps its gradient under grads."""
    model = torch.nn.Linear(64, 32, bias=False)
    model.weight.grad = torch.zeros(32, 64)  # 8 KiB
    master = torch.zeros(2048, requires_grad=True)
    master.grad = torch.zeros(2048)  # the fp32 gradient of the step: 8 KiB
    adam = torch.optim.AdamW([master])
    census = live_tensor_bytes(SimpleNamespace(module=model, optimizer=SimpleNamespace(optimizer=adam)),
                               torch.device("cpu"))
    assert census["grads"] == 8192 and census["step_grads"] == 8192 and census["optimizer"] >= 8192
    plain = torch.optim.AdamW(model.parameters())  # fp32 ZeRO-0: steps the weights themselves
    census = live_tensor_bytes(SimpleNamespace(module=model, optimizer=plain), torch.device("cpu"))
    assert census["grads"] == 8192 and census["step_grads"] == 0
