"""model.init_from on two ranks: a Llama folder written by transformers starts a tp2 run and a
pp2 run, whose first step's loss is transformers' loss on the same batch, and `dsforge export`
of the checkpoint each run saved gives the folder back (export(import(x)) == x).

fp32; the vocabulary (257) is padded to 384 rows on the pp2 run (tp 1) and to 512 on the tp2
run, and the padded logits are masked out of the loss (runtime/assemble/vocab.py), so the
softmax sees exactly the folder's logits on both. The first step's learning rate is 0 (linear
warmup from 0), so the checkpoint saved after it holds the imported weights unchanged and the
round trip can be compared bitwise. Measured: both layouts' first loss equals transformers' to
the last fp32 bit (5.7763691); the exported tensors and their logits are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from dsforge.hf.export import export
from dsforge.recipe import load_recipe
from dsforge.runtime.loop.data import SyntheticTokens
from tests.conftest import REPO
from tests.distributed.harness import run_world

pytestmark = pytest.mark.timeout(300)

RECIPE = REPO / "recipes" / "tiny.yaml"
BATCH = 4
VOCAB = 257  # the byte tokenizer's
COMMON = [f"model.vocab_size={VOCAB}", "model.num_layers=2", "train.steps=3",
          "train.checkpoint_every=1", "train.seq_len=32",
          f"train.global_batch={BATCH}", "train.micro_batch=2", "train.grad_accum=null",
          "train.timing_warmup=0", "train.warmup_steps=2", "parallel.dp=1"]
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}


def _folder(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-5, max_position_embeddings=256,
                         initializer_range=0.1)  # logits far from uniform: a drawn start shows
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from ones, so a misplaced norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape))
    model.save_pretrained(path)
    return path


def _batch(seed: int, seq_len: int) -> torch.Tensor:
    """The first step's global batch: synthetic samples 0 .. BATCH - 1 (runtime/loop/data.py)."""
    source = SyntheticTokens(seq_len=seq_len, vocab_size=VOCAB, seed=seed)
    return torch.stack([source.sample(i) for i in range(BATCH)])


def _transformers_loss_and_logits(folder, tokens):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return loss.item(), logits


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_import")
    folder = _folder(root / "llama")
    cases = {name: COMMON + layout + [f"model.init_from={folder}"] for name, layout in LAYOUTS.items()}
    return folder, root / "runs", run_world(2, cases, recipe=RECIPE, out=root / "runs")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_step_loss_is_transformers_and_export_gives_the_folder_back(world, layout, tmp_path):
    folder, runs, metrics = world
    first = [r for r in metrics[layout] if "val_loss" not in r][0]
    assert first["lr"] == 0.0  # its checkpoint holds the imported weights unchanged
    train = load_recipe(RECIPE, COMMON).train
    tokens = _batch(train.seed, train.seq_len)
    loss, logits = _transformers_loss_and_logits(folder, tokens)
    assert abs(first["loss"] - loss) < 1e-5, (first["loss"], loss)

    after_first = sorted((runs / layout / "checkpoints").glob("step*"))[0]
    exported = export(after_first, tmp_path / "exported", dtype="fp32")
    original, back = _tensors(folder), _tensors(exported.out)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    _, logits_back = _transformers_loss_and_logits(exported.out, tokens)
    assert torch.equal(logits_back, logits)
