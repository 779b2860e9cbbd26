"""Runtime pieces that need no process group: data, tokenizer, faults, metrics, CPU backend."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from dsforge import tokenizer
from dsforge.runtime.loop import data as data_mod
from dsforge.runtime.loop.metrics import MetricsWriter, make_record
from dsforge.runtime.rank import parse_fault
from tests.conftest import REPO


def test_synthetic_samples_are_deterministic_per_sample_id():
    source = data_mod.SyntheticTokens(seq_len=16, vocab_size=256, seed=1)
    assert torch.equal(source.sample(5), source.sample(5))
    assert not torch.equal(source.sample(5), source.sample(6))
    assert source.sample(0).shape == (17,) and int(source.sample(0).max()) < 256


def test_microbatches_split_the_global_batch_over_data_parallel_ranks():
    source = data_mod.SyntheticTokens(seq_len=8, vocab_size=256, seed=0)
    single = data_mod.microbatches(source, step=3, global_batch=8, micro_batch=2, grad_accum=4,
                                   dp=1, dp_rank=0, vocab_size=256)
    split = [data_mod.microbatches(source, step=3, global_batch=8, micro_batch=2, grad_accum=2,
                                   dp=2, dp_rank=r, vocab_size=256) for r in (0, 1)]
    rows = lambda batches: {tuple(row.tolist()) for mb in batches for row in mb.tokens}
    assert rows(single) == rows(split[0]) | rows(split[1])
    assert not rows(split[0]) & rows(split[1])
    mb = single[0]
    assert torch.equal(mb.tokens[:, 1:], mb.labels[:, :-1])  # labels are the next tokens


def test_synthetic_validation_is_another_stream():
    train = data_mod.SyntheticTokens(seq_len=16, vocab_size=256, seed=1)
    held_out = data_mod.SyntheticTokens(seq_len=16, vocab_size=256, seed=1, stream=data_mod.VALIDATION)
    assert not torch.equal(train.sample(3), held_out.sample(3))


def test_token_file_windows_shuffle_and_resume(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(path)
    windows = range(0, 111)
    source = data_mod.TokenFile(path, seq_len=9, seed=3, dtype="uint16", windows=windows, stream=0)
    first_epoch = [int(source.sample(i)[0]) for i in range(len(windows))]
    assert sorted(first_epoch) == sorted(int(s * 9 % 256) for s in range(111))  # each window once
    again = data_mod.TokenFile(path, seq_len=9, seed=3, dtype="uint16", windows=windows, stream=0)
    assert torch.equal(again.sample(150), source.sample(150))  # resumable: no state beyond the id
    assert [int(source.sample(111 + i)[0]) for i in range(5)] != first_epoch[:5]  # reshuffled


def test_token_file_split_cuts_windows_like_megatron_cuts_sequences():
    assert data_mod.split_ranges(111, "98,1,1") == [range(0, 109), range(109, 110), range(110, 111)]
    assert data_mod.split_ranges(10, "100") == [range(0, 10), range(0), range(0)]


def test_microbatches_refuse_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, 300, 4, 5], dtype=np.uint16).tofile(path)
    source = data_mod.TokenFile(path, seq_len=2, seed=0, dtype="uint16", windows=range(2), stream=0)
    with pytest.raises(ValueError, match="token id 300, outside the model's vocabulary"):
        data_mod.microbatches(source, step=0, global_batch=2, micro_batch=2, grad_accum=1, dp=1,
                              dp_rank=0, vocab_size=256)


def test_byte_tokenizer_round_trips():
    text = "Full fathom five thy father lies — é"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_shipped_token_file_is_the_tokenized_text(tmp_path):
    out = tmp_path / "t.bin"
    subprocess.run([sys.executable, str(REPO / "tools" / "tokenize_text.py"),
                    str(REPO / "data" / "tempest.txt"), str(out)], check=True, capture_output=True)
    assert out.read_bytes() == (REPO / "data" / "tempest.u16.bin").read_bytes()
    assert not (tmp_path / "t.bin.partial").exists()


def test_fault_spec():
    assert parse_fault(None) is None and parse_fault("hang:1:3") == ("hang", 1, 3)
    with pytest.raises(ValueError):
        parse_fault("boom:1:3")


def test_metrics_summary_leaves_out_warmup(tmp_path):
    writer = MetricsWriter(tmp_path / "m.jsonl")
    for step, seconds in enumerate([10.0, 1.0, 2.0, 3.0]):
        writer.write(make_record(step=step, warmup=step == 0, loss=1.0, grad_norm=None, lr=0.1,
                                 step_time_s=seconds, tokens_per_step=100, world_size=2,
                                 flops_per_token=1e9, hardware_flops_per_token=1e9,
                                 peak_flops=None, device=torch.device("cpu")))
    summary = writer.summary()
    assert summary["measured_steps"] == 3 and summary["median_step_time_s"] == 2.0
    assert summary["median_mfu"] is None
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 4


def test_mfu_with_a_known_peak():
    record = make_record(step=0, warmup=False, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=1.0,
                         tokens_per_step=1000, world_size=1, flops_per_token=1e9,
                         hardware_flops_per_token=2e9, peak_flops=1e13, device=torch.device("cpu"))
    assert record.mfu == pytest.approx(0.1) and record.hfu == pytest.approx(0.2)


def _python(script: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter: the CPU backend patches the whole process."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cpu_backend_fails_loudly_when_a_patch_target_disappears():
    """A Megatron-Core upgrade that renames a redirected function must not pass silently."""
    script = (
        "import megatron.core.transformer.moe.moe_utils as m\n"
        "del m.maybe_move_tensor_to_cpu\n"
        "from dsforge.runtime.build import cpu_backend\n"
        "try:\n"
        "    cpu_backend.activate()\n"
        "except cpu_backend.CpuBackendError as e:\n"
        "    print('refused:', e)\n")
    out = _python(script)
    assert "refused: megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu" in out.stdout


def test_cpu_backend_redirects_cuda_devices():
    script = (
        "import torch\n"
        "from dsforge.runtime.build import cpu_backend\n"
        "cpu_backend.activate()\n"
        "a = torch.empty(2, device=torch.cuda.current_device())\n"
        "b = torch.zeros(2, device='cuda').cuda()\n"
        "with torch.cuda.stream(torch.cuda.Stream()):\n"
        "    e = torch.cuda.current_stream().record_event()\n"
        "e.synchronize()\n"
        "torch.cuda.manual_seed(3); s = torch.cuda.get_rng_state()\n"
        "print(a.device, b.device, torch.equal(s, torch.get_rng_state()))\n")
    out = _python(script)
    assert out.stdout.strip().splitlines()[-1] == "cpu cpu True", out.stderr[-2000:]  # DeepSpeed logs to stdout


def test_overhead_periods_skip_warmup_steps():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_overhead", REPO / "tools" / "bench_overhead.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.periods([0.0, 5.0, 6.0, 6.5, 7.5], skip=1) == [1.0, 0.5, 1.0]


def test_heartbeat_file_follows_the_beats_off_the_hot_path(tmp_path):
    import time

    from dsforge.job.heartbeat import Heartbeat, read_all

    heartbeat = Heartbeat(tmp_path, rank=3, write_every_s=0.05)
    heartbeat.beat(7)
    assert read_all(tmp_path) == {}  # nothing written on the caller's thread
    deadline = time.monotonic() + 5
    while 3 not in read_all(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert read_all(tmp_path)[3][0] == 7
    heartbeat.beat(8)
    heartbeat.flush()
    assert read_all(tmp_path)[3][0] == 8


def test_ranks_share_the_cpus_unless_the_user_chose():
    import os

    from dsforge.runtime.rank import threads_per_rank

    cpus = len(os.sched_getaffinity(0))
    assert threads_per_rank({"LOCAL_SIZE": "1"}) == cpus
    assert threads_per_rank({"LOCAL_SIZE": str(cpus * 4)}) == 1
    assert threads_per_rank({"LOCAL_SIZE": "2"}) == max(1, cpus // 2)
    assert threads_per_rank({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}) is None


def test_tensor_census_sorts_live_storage_by_owner():
    from types import SimpleNamespace

    from dsforge.runtime.loop.tensor_census import live_tensor_bytes

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


def test_the_census_inside_a_pipelined_step_runs_when_its_last_backward_ends():
    """The hook counts backward passes; on the last one the census runs after every gradient
    of that pass and before what the prologue queued (DeepSpeed's epilogue)."""
    from dsforge.runtime.loop.step import _census_at_last_backward

    calls = []
    weight = torch.ones(3, requires_grad=True)

    def prologue():
        torch.autograd.Variable._execution_engine.queue_callback(lambda: calls.append("epilogue"))

    hook = _census_at_last_backward(lambda point: calls.append((point, weight.grad.sum().item())),
                                    prologue, backwards=2)
    for _ in range(2):
        out = weight * 2
        out.register_hook(lambda grad: hook())  # where DeepSpeed's output hook would run
        out.sum().backward()
    assert calls == ["epilogue", ("backward", 12.0), "epilogue"]


def test_tensor_census_counts_zero_gradient_partitions_and_the_reduce_bucket():
    """ZeRO 2/3 keep gradients outside .grad (a flat partition, views of it per group) and
    gather each backward's gradients in a reduce bucket (stage 1/2: a list of buffers)."""
    from types import SimpleNamespace

    from dsforge.runtime.loop.tensor_census import live_tensor_bytes

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
    from types import SimpleNamespace

    from dsforge.runtime.loop.tensor_census import live_tensor_bytes

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


def test_the_optimizer_census_runs_inside_each_torch_step_and_is_removed_after():
    """ZeRO-3 steps the torch optimizer once per sub-group: the census runs each time."""
    from types import SimpleNamespace

    from dsforge.runtime.loop.step import _stepping

    weight = torch.nn.Parameter(torch.ones(4))
    adam = torch.optim.AdamW([weight])

    def step():
        for _ in range(2):
            weight.grad = torch.ones(4)
            adam.step()

    calls = []
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=adam), step=step)
    _stepping(engine, calls.append)
    assert calls == ["optimizer", "optimizer"]
    _stepping(engine, None)
    assert calls == ["optimizer", "optimizer"]  # the hook is gone


class _RecordingTrainer:
    """What train_loop uses of a Trainer, recording the calls."""

    def __init__(self, *, steps: int, every: int, start_step: int, eval_every: int = 0):
        from types import SimpleNamespace

        train = SimpleNamespace(steps=steps, checkpoint_every=every, eval_every=eval_every,
                                keep_last=0)
        self.resolved = SimpleNamespace(recipe=SimpleNamespace(train=train))
        self.start_step, self.calls = start_step, []

    def train_step(self, step):
        self.calls.append(("step", step))

    def save_checkpoint(self, steps_done, fault=None):
        self.calls.append(("save", steps_done, fault))

    def evaluate(self, step, before_batch=None):
        self.calls.append(("eval", step, before_batch))

    def finish(self):
        self.calls.append(("finish",))


def test_train_loop_resumes_saves_every_n_and_runs_the_rank_hooks():
    from dsforge.runtime.loop.trainer import train_loop

    trainer = _RecordingTrainer(steps=7, every=3, start_step=2)
    drill = object()
    train_loop(trainer, before_step=lambda step: trainer.calls.append(("before", step)),
               after_steps=lambda: trainer.calls.append(("after",)), save_fault=drill)
    assert trainer.calls == [
        ("before", 2), ("step", 2), ("save", 3, drill), ("before", 3), ("step", 3),
        ("before", 4), ("step", 4), ("before", 5), ("step", 5), ("save", 6, drill),
        ("before", 6), ("step", 6), ("after",), ("finish",)]
    plain = _RecordingTrainer(steps=2, every=0, start_step=0)
    train_loop(plain)  # what tests/distributed/worker.py runs
    assert plain.calls == [("step", 0), ("step", 1), ("finish",)]


def test_train_loop_evaluates_every_n_steps_and_after_the_last_before_saving():
    from dsforge.runtime.loop.trainer import train_loop

    trainer = _RecordingTrainer(steps=5, every=2, start_step=0, eval_every=2)
    hook = lambda step: None
    train_loop(trainer, before_step=hook)
    assert trainer.calls == [
        ("step", 0), ("step", 1), ("eval", 1, hook), ("save", 2, None), ("step", 2), ("step", 3),
        ("eval", 3, hook), ("save", 4, None), ("step", 4), ("eval", 4, hook), ("finish",)]
