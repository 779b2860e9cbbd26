"""Whole experts on every tensor-parallel rank (tp 2, etp 1, ep 1) are the single process's
experts: each tp rank's copy starts with the single process's weights, and after one backward
over a batch (each tp rank routing its half of the sequence through its copy) every copy holds
the single process's gradient (runtime/assemble/megatron_fixes.py).

Each world builds the model the way a rank does (`engine.build_model`: the weights drawn
layout-invariantly, the gradient hooks attached), runs one forward and backward on the same
tokens, and writes every expert parameter's weight and gradient under its global name. Run as
`python -m tests.distributed.test_expert_copies OUT` in each rank of a world.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dsforge.launch.local import free_port
from tests.conftest import REPO

MOE = REPO / "recipes" / "tiny_moe.yaml"
# Load balancing off: the aux loss's gradient scale is the training step's (runtime/loop), and
# the experts' gradients come from the language-model loss alone.
COMMON = ["model.moe.aux_loss_coeff=0", "parallel.ep=1"]
WORLDS = {1: ["parallel.dp=1"],
          2: ["parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
              "parallel.etp=1"]}
BATCH, SEQ_LEN = 2, 128


def _experts_after_one_backward(out: Path) -> None:
    """This rank's part: build, one forward and backward, its expert weights and gradients."""
    from dsforge.ckpt.names import param_specs
    from dsforge.recipe import resolve_file
    from dsforge.runtime.assemble.engine import build_model
    from dsforge.runtime.startup import StartupClock

    warnings.filterwarnings("ignore")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    resolved = resolve_file(MOE, COMMON + WORLDS[world] + [f"train.seq_len={SEQ_LEN}"],
                            world_size=world)
    container, _, _, _ = build_model(resolved, device=torch.device("cpu"), backend="gloo",
                                     timeout_s=120, startup=StartupClock())
    (chunk,) = container.chunks
    tokens = torch.randint(0, resolved.recipe.model.vocab_size, (BATCH, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
    experts = {spec.global_name: {"weight": p.detach().clone(), "grad": p.grad.clone(),
                                  "full_shape": spec.full_shape}
               for p, spec in param_specs(container.chunks) if ".mlp.experts." in spec.global_name}
    torch.save(experts, out / f"world{world}_rank{rank}.pt")


def _run_world(size: int, out: Path) -> list[dict]:
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tests.distributed.test_expert_copies", str(out)]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, log in zip(ranks, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(out / f"world{size}_rank{r}.pt") for r in range(size)]


@pytest.fixture(scope="module")
def experts(tmp_path_factory) -> tuple[dict, list[dict]]:
    out = tmp_path_factory.mktemp("expert_copies")
    (single,) = _run_world(1, out)
    return single, _run_world(2, out)


@pytest.mark.timeout(600)
def test_every_copy_starts_as_the_single_process_expert(experts):
    single, copies = experts
    assert len(single) == 4 * 4 * 2  # 4 layers x 4 experts x (fc1, fc2)
    for rank, copy in enumerate(copies):
        assert copy.keys() == single.keys()
        for name, one in single.items():
            assert copy[name]["full_shape"] == one["full_shape"], f"tp rank {rank}: {name}"
            assert torch.equal(copy[name]["weight"], one["weight"]), f"tp rank {rank}: {name}"


@pytest.mark.timeout(600)
def test_every_copy_gets_the_whole_sequences_gradient(experts):
    single, copies = experts
    for rank, copy in enumerate(copies):
        for name, one in single.items():
            assert one["grad"].abs().max() > 0, f"{name}: no token reached the expert"
            torch.testing.assert_close(copy[name]["grad"], one["grad"], rtol=1e-4, atol=1e-7,
                                       msg=lambda m: f"tp rank {rank}: {name}: {m}")


if __name__ == "__main__":
    _experts_after_one_backward(Path(sys.argv[1]))
    os._exit(0)  # no teardown of the process groups and DeepSpeed's state
