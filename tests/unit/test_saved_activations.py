"""The memory model's attention against what the attention saves for its backward, counted with
autograd's saved-tensor hooks on the CPU backend (helpers/saved_activations.py): dsforge's
SDPAttention and Megatron's QKV split and rotary embedding are the same Python on a GPU. The
kernels outside the attention (RMSNorm, SwiGLU) differ on a GPU (Liger's), so only the
attention is counted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsforge.estimate.memory import layer_activation_bytes
from dsforge.recipe import resolve_file
from tests.conftest import REPO

SHAPE = ["model.hidden_size=256", "model.num_attention_heads=8", "model.ffn_hidden_size=688",
         "train.precision=bf16"]


@pytest.mark.parametrize("overrides", [["model.num_kv_heads=2", "train.micro_batch=4"],
                                       ["model.num_kv_heads=8", "train.micro_batch=1"]],
                         ids=["gqa-mb4", "mha-mb1"])
def test_the_attention_keeps_what_the_memory_model_counts(overrides):
    """Per token: the QKV projection's input, Q, K, V and the output, as the model counts them,
    and two small tensors it leaves out: the kernel's fp32 log-sum-exp (4 heads bytes) and
    rotary's cos and sin, made in 16 bits for Q and for K in every layer (four [s, head_dim]
    tensors shared by the microbatch: 8 head_dim / b). Both are under 1% of a layer at the
    kit's shapes (the 1B at mb 8: 192 of ~30,000 bytes a token). Before SDPAttention copied V,
    the attention also kept the fused QKV output's Q and K parts, 2 (heads + groups)
    head_dim: 640 more bytes a token here, 5,120 for the kit's 1B, 2.5 GiB at mb 8."""
    done = subprocess.run([sys.executable, "-m", "tests.unit.helpers.saved_activations",
                           *SHAPE, *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    resolved = resolve_file(REPO / "recipes" / "tiny.yaml", ["parallel.dp=1", *SHAPE, *overrides],
                            world_size=1)
    m, lay, seq = resolved.recipe.model, resolved.layout, resolved.recipe.train.seq_len
    layer = layer_activation_bytes(m, 0, seq_len=seq, micro_batch=lay.micro_batch, layout=lay,
                                   checkpointing="none") / measured["tokens"]
    # The layer's count less what lies outside the attention module: the two norm inputs and
    # the MLP's input (6h; the QKV input, 2h, is the attention's) and the MLP's 6 ffn.
    attention = layer - 6 * m.hidden_size - 6 * m.ffn_hidden_size
    left_out = 4 * m.num_attention_heads + 8 * m.head_dim / lay.micro_batch
    assert measured["bytes_per_token"] == pytest.approx(attention + left_out, abs=1.0)
