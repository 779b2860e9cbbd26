"""dsforge's step-time model scored against published training measurements (issue 14).

Each row is one published run with its full layout, copied by hand from the file named in
`ref` (repository, path and the commit read). For each row dsforge builds the recipe of
exactly that layout, runs it through the same validator as `dsforge run`, and predicts its
MFU with `dsforge.search.search.evaluate` and the GPU's default cluster profile. The measured
MFU is recomputed from the published tokens/s with dsforge's own FLOPs formula
(dsforge/estimate/flops.py) so both numbers share a numerator; where the source's own figure
differs by more than half a point the row says so.

What the comparison can and cannot say: the sources run other software (PyTorch FSDP with
torch.compile, Transformer Engine, FP8, async TP, Composer, NeMo-style communication overlap)
and other model shapes (MPT is GPT-style with a GELU MLP, not Llama). It calibrates orders
and magnitudes of the prediction, not identity with any one engine.

Rows are never dropped: a row dsforge cannot score (FP8, ring-attention context
parallelism) carries the reason in `unscorable`; a layout the validator refuses is scored at the nearest layout it
accepts where there is one and the row says which (`scored_as`): ZeRO-3 with pp > 1 at ZeRO-2,
which only happens in the "before" run (commit 5b31f63, before rule Z2 accepted it).

    python tools/published_compare.py --out benchmarks/search/published.md
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from functools import cache

from dsforge.cost.profile import default_profile
from dsforge.estimate.flops import flops_per_token
from dsforge.hardware import gpu_by_key
from dsforge.problems import RecipeError
from dsforge.recipe.layout import Topology
from dsforge.recipe.loader import build_recipe
from dsforge.recipe.presets import PRESETS
from dsforge.recipe.resolve import Resolved, resolve
from dsforge.schema import ModelConfig, divisors
from dsforge.search.search import Ranked, evaluate
from dsforge.search.space import MAX_VPP, Candidate
from dsforge.units import GiB

SOURCES = ("kempnerforge", "llm-foundry", "megatron-lm", "torchtitan", "playbook")


@dataclass(frozen=True)
class Model:
    """A model as dsforge's model fields. GPT-style sources (MPT, Megatron's GPT) have a
    GELU MLP of 4h (8 h^2 weights); dsforge's is SwiGLU (3 h ffn), so they are written with
    ffn = 8h/3 rounded to a multiple of 8: the same matmul FLOPs within 0.1%."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int | None
    vocab_size: int
    tie_embeddings: bool = False
    preset: str | None = None  # the dsforge preset with exactly these dims, if any

    def fields(self, seq_len: int) -> dict:
        if self.preset:
            return {"preset": self.preset, "max_seq_len": max(seq_len, PRESETS[self.preset]["max_seq_len"])}
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "ffn_hidden_size": self.ffn_hidden_size, "num_attention_heads": self.num_attention_heads,
                "num_kv_heads": self.num_kv_heads, "vocab_size": self.vocab_size,
                "max_seq_len": seq_len, "tie_embeddings": self.tie_embeddings}

    def describe(self) -> str:
        """Name and dims as dsforge's model fields (layers, hidden, heads/kv heads, ffn, vocab)."""
        kv = f"/kv{self.num_kv_heads}" if self.num_kv_heads else ""
        tied = " tied" if self.tie_embeddings else ""
        return (f"{self.name} [L{self.num_layers} h{self.hidden_size} a{self.num_attention_heads}{kv} "
                f"ffn{self.ffn_hidden_size} V{self.vocab_size}{tied}]")

    def config(self, seq_len: int) -> ModelConfig:
        return build_recipe(_raw_recipe_model(self, seq_len)).model


def _raw_recipe_model(model: Model, seq_len: int) -> dict:
    return {"name": "published", "model": model.fields(seq_len),
            "train": {"seq_len": seq_len, "steps": 10, "lr": 3e-4, "precision": "bf16"}}


def gelu_ffn(hidden: int) -> int:
    """SwiGLU width with the weights of a 4h GELU MLP (8 h^2 = 3 h ffn), a multiple of 8 so
    every tensor-parallel size up to 8 divides it."""
    return 8 * round(hidden / 3)


def _preset(name: str, preset: str) -> Model:
    p = PRESETS[preset]
    return Model(name, p["num_layers"], p["hidden_size"], p["ffn_hidden_size"], p["num_attention_heads"],
                 p.get("num_kv_heads"), p["vocab_size"], preset=preset)


def _mpt_model(size: str, hidden: int, layers: int, heads: int) -> Model:
    # llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml: expansion_ratio 4, vocab 50368,
    # no biases, tied embeddings (MPT's default), LayerNorm, flash attention.
    return Model(f"MPT-{size}", layers, hidden, gelu_ffn(hidden), heads, None, 50368,
                 tie_embeddings=True)


def _gpt(size: str, hidden: int, layers: int, heads: int) -> Model:
    # Megatron-LM README table: GPT with vocab 131,072, no GQA, 4h GELU MLP.
    return Model(f"GPT {size}", layers, hidden, gelu_ffn(hidden), heads, None, 131072)


LLAMA3_8B = _preset("llama3-8b", "llama3-8b")
LLAMA3_70B = _preset("llama3-70b", "llama3-70b")
# KempnerForge's 13B and 29B: Llama-3 shapes with ffn = 1.3 x 8h/3 rounded up to 256
# (kempnerforge/config/model.py), vocab 128256; 14.84B and 28.7B parameters as published.
KF_13B = Model("KF 13B (14.8B)", 40, 5120, 17920, 40, 8, 128256)
KF_29B = Model("KF 29B (28.7B)", 56, 6144, 21504, 48, 8, 128256)
LLAMA3_405B = Model("llama3-405b", 126, 16384, 53248, 128, 8, 128256)

MPT = {"125m": _mpt_model("125m", 768, 12, 12), "350m": _mpt_model("350m", 1024, 24, 16), "760m": _mpt_model("760m", 1536, 24, 12),
       "1b": _mpt_model("1b", 2048, 24, 16), "3b": _mpt_model("3b", 2560, 32, 20), "7b": _mpt_model("7b", 4096, 32, 32),
       "13b": _mpt_model("13b", 5120, 40, 40), "30b": _mpt_model("30b", 7168, 48, 56), "70b": _mpt_model("70b", 8192, 80, 64)}


@dataclass(frozen=True)
class Row:
    source: str  # one of SOURCES
    ref: str  # repository:path@commit (and the table) it was copied from
    label: str  # the run as the source names it
    model: Model
    seq_len: int
    gpu: str  # dsforge GPU key
    gpus: int
    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    zero: int  # FSDP FULL_SHARD = 3, SHARD_GRAD_OP = 2; plain DDP / single GPU = 0
    micro_batch: int  # sequences per data-parallel rank per microbatch
    global_batch: int  # sequences per optimizer step
    checkpointing: str  # none | selective | full (dsforge's meaning; notes say where the source's differs)
    tokens_per_s: float  # measured, all GPUs together
    published_mfu: float | None  # the source's own figure (its formula, its peak), if it states one
    note: str = ""  # implementation differences and assumptions
    vpp: int | None = 1  # None: not published; scored at the vpp dsforge predicts fastest
    sequence_parallel: bool = False
    unscorable: str = ""  # why dsforge cannot predict this run (kept in the table, out of the statistics)
    # Why the source's run needs less memory than dsforge's engine would for the same layout
    # (the fit is dsforge's memory, DeepSpeed and Megatron-Core's, not the source's).
    memory_note: str = ""
    # torchtitan's per-op selective checkpointing: scored with its extra matmul recompute
    # (`per_op_sac_flops`), which dsforge's selective does not run.
    per_op_sac: bool = False

    @property
    def measured_mfu(self) -> float:
        """Tokens/s x dsforge's model FLOPs per token / (GPUs x the GPU's BF16 peak)."""
        per_token = flops_per_token(self.model.config(self.seq_len), self.seq_len).model
        return self.tokens_per_s * per_token / (self.gpus * gpu_by_key(self.gpu).peak_bf16_flops)

    def layout(self) -> str:
        vpp = " vpp?" if self.vpp is None else (f" vpp{self.vpp}" if self.vpp > 1 else "")
        sp = " sp" if self.sequence_parallel else ""
        return (f"tp{self.tp} pp{self.pp}{vpp} dp{self.dp} ZeRO-{self.zero} mb{self.micro_batch} "
                f"gb{self.global_batch} ckpt {self.checkpointing}{sp}")


# --- KempnerForge (H200, 4 GPUs per node, FSDP2 + DTensor TP, full AC, torch.compile) -------
KF_MFU = "KempnerInstitute/KempnerForge:benchmarks/mfu_scaling/mfu_scaling.md@5666d0d"
KF_VAL = "KempnerInstitute/KempnerForge:benchmarks/config_validation/config_validation.md@5666d0d"
KF_NOTE = "PyTorch FSDP2, torch.compile, fused AdamW"


def _kf(ref: str, label: str, model: Model, gpus: int, tp: int, micro: int, accum: int,
        tokens_per_s: float, mfu: float, note: str = KF_NOTE, pp: int = 1) -> Row:
    dp = gpus // (tp * pp)
    # FSDP full shard = ZeRO-3; with one data-parallel rank nothing is sharded (ZeRO-0).
    return Row("kempnerforge", ref, label, model, 4096, "h200", gpus, 4, tp, pp, dp, 3 if dp > 1 else 0,
               micro, dp * micro * accum, "full", tokens_per_s, mfu, note,
               memory_note=_FSDP_ONE_GPU if gpus == 1 else "")


_FSDP_ONE_GPU = ("FSDP2 keeps fp32 weights, fp32 gradients and AdamW's state: 16 bytes a parameter; "
                 "DeepSpeed's ZeRO-0, the layout scored, keeps 16 through the backward, then in the "
                 "optimizer step gives every fp32 master weight an fp32 copy of its gradient (4 more: "
                 "torch's AdamW in DeepSpeed's FP16_UnfusedOptimizer); "
                 "ZeRO-3 on the one GPU would add only one 1e9 sub-group's (docs/search.md, "
                 "\"First choices\")")


_PP_NOTE = ("no torch.compile; FSDP2 with pp keeps parameters unsharded (reshard_after_forward="
            "False), 1F1B, grad_accum_steps = microbatches")
KEMPNERFORGE = (
    # mfu_scaling.md, batch configuration: 7B 4 x 2, 13B 4 x 4, 70B 2 x 4 (micro x accum per dp rank).
    _kf(KF_MFU, "#1 7B single GPU", LLAMA3_8B, 1, 1, 4, 2, 10471, 0.578),
    _kf(KF_MFU, "#2 7B FSDP=2", LLAMA3_8B, 2, 1, 4, 2, 18728, 0.517),
    _kf(KF_MFU, "#3 7B TP=2", LLAMA3_8B, 2, 2, 4, 2, 13163, 0.364),
    _kf(KF_MFU, "#4 7B FSDP=4", LLAMA3_8B, 4, 1, 4, 2, 38983, 0.538),
    _kf(KF_MFU, "#5 7B TP=4", LLAMA3_8B, 4, 4, 4, 2, 25135, 0.347),
    _kf(KF_MFU, "#6 7B TP=2+FSDP=2", LLAMA3_8B, 4, 2, 4, 2, 25980, 0.359),
    _kf(KF_MFU, "#7 7B TP=4+FSDP=2", LLAMA3_8B, 8, 4, 4, 2, 44299, 0.306),
    _kf(KF_MFU, "#8 13B FSDP=8", KF_13B, 8, 1, 4, 4, 35405, 0.444, "PyTorch FSDP2, no torch.compile"),
    _kf(KF_MFU, "#9 13B TP=4+FSDP=2", KF_13B, 8, 4, 4, 4, 27345, 0.343),
    _kf(KF_MFU, "#10 7B TP=4+FSDP=4", LLAMA3_8B, 16, 4, 4, 2, 82988, 0.286),
    _kf(KF_MFU, "#11 13B TP=4+FSDP=4", KF_13B, 16, 4, 4, 4, 53814, 0.337),
    _kf(KF_MFU, "#12 7B TP=4+FSDP=8", LLAMA3_8B, 32, 4, 4, 2, 155917, 0.269),
    _kf(KF_MFU, "#13 13B TP=4+FSDP=8", KF_13B, 32, 4, 4, 4, 104309, 0.327),
    _kf(KF_MFU, "#14 70B TP=4+FSDP=8", LLAMA3_70B, 32, 4, 2, 4, 17657, 0.254),
    # config_validation.md; micro x accum from configs/train/<name>.toml (checked: step time x
    # tok/s = dp x micro x accum x 4096). debug.toml (20M) and hf_wikitext.toml (77M) are left
    # out: their dims are not in the report and their runs are data- and launch-bound.
    _kf(KF_VAL, "7b.toml FSDP=4", LLAMA3_8B, 4, 1, 8, 4, 38858, 0.537),
    _kf(KF_VAL, "7b_12gpu_tp4 TP=4 FSDP=3", LLAMA3_8B, 12, 4, 4, 8, 67045, 0.309),
    _kf(KF_VAL, "7b_32gpu_fsdp FSDP=32", LLAMA3_8B, 32, 1, 4, 4, 297384, 0.513),
    _kf(KF_VAL, "13b_32gpu_tp4_pp2", KF_13B, 32, 4, 4, 4, 52554, 0.165, _PP_NOTE, pp=2),
    _kf(KF_VAL, "29b_32gpu_tp4_pp2", KF_29B, 32, 4, 1, 8, 22688, 0.136, _PP_NOTE, pp=2),
    _kf(KF_VAL, "70b_32gpu_tp4 TP=4 FSDP=8", LLAMA3_70B, 32, 4, 2, 4, 17769, 0.256),
    _kf(KF_VAL, "70b_32gpu_tp4_pp4", LLAMA3_70B, 32, 4, 1, 4, 7641, 0.110, _PP_NOTE, pp=4),
)

# --- LLM-Foundry (MPT on the MosaicML platform, PyTorch FSDP via Composer) ----------------
FOUNDRY = "mosaicml/llm-foundry:scripts/train/benchmarking/README.md@8c8dd48"
_FOUNDRY_TABLES = {"h100": "H100 80GB BF16", "a100": "A100 80GB (1600 Gbps RoCE)",
                   "a100-40gb": "A100 40GB (1600 Gbps RoCE)"}


def _mpt(gpu: str, size: str, seq: int, gpus: int, mfu: float, micro: int, accum: int,
             global_batch: int, tokens_per_s: int, sharding: str, checkpointing: bool,
             precision: str) -> Row:
    note = "Composer FSDP, flash-attention, MPT (GELU MLP, LayerNorm, tied embeddings)"
    if precision == "bf16":  # Composer "PURE": parameters kept in bf16 (no fp32 master weights)
        note += ", pure bf16 parameters"
    unscorable = "FP8 (its MFU is against the FP8 peak; dsforge models BF16 only)" if "fp8" in precision else ""
    if unscorable:
        note += ", FP8 via Transformer Engine"
    assert global_batch == micro * accum * gpus  # checked for every row of the README
    return Row("llm-foundry", f"{FOUNDRY} ({_FOUNDRY_TABLES[gpu]}{', FP8' if unscorable else ''})",
               f"MPT-{size} seq {seq}", MPT[size], seq, gpu, gpus, 8, 1, 1, gpus,
               {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[sharding], micro, global_batch,
               "full" if checkpointing else "none", tokens_per_s, mfu / 100, note, unscorable=unscorable)


LLM_FOUNDRY = (  # the README's rows, one call each, in its order
    # "H100 80GB BF16 (Large Scale, >= 128 GPUs)"
    _mpt("h100", "70b", 2048, 512, 41.25, 8, 1, 4096, 515636, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "70b", 2048, 256, 42.42, 8, 1, 2048, 265149, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "70b", 2048, 128, 43.36, 8, 1, 1024, 135490, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 2048, 512, 40.27, 8, 1, 4096, 1083366, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 2048, 256, 40.89, 8, 1, 2048, 550022, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 2048, 128, 41.85, 8, 1, 1024, 281491, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "13b", 2048, 512, 41.12, 16, 1, 8192, 2535811, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "13b", 2048, 256, 41.42, 16, 1, 4096, 1277214, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "13b", 2048, 128, 42.18, 16, 1, 2048, 650264, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "7b", 2048, 512, 42.2, 6, 1, 3072, 4951479, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "7b", 2048, 256, 44.15, 6, 1, 1536, 2590548, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "7b", 2048, 128, 45.71, 6, 1, 768, 1340830, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 2048, 512, 39.24, 8, 1, 4096, 11092218, "SHARD_GRAD_OP", False, "amp_bf16"),
    _mpt("h100", "3b", 2048, 256, 41.25, 8, 1, 2048, 5829686, "SHARD_GRAD_OP", False, "amp_bf16"),
    _mpt("h100", "3b", 2048, 128, 42.43, 8, 1, 1024, 2998098, "SHARD_GRAD_OP", False, "amp_bf16"),
    _mpt("h100", "1b", 2048, 512, 36.65, 12, 1, 6144, 20396905, "SHARD_GRAD_OP", False, "amp_bf16"),
    _mpt("h100", "1b", 2048, 256, 39.15, 12, 1, 3072, 10894207, "SHARD_GRAD_OP", False, "amp_bf16"),
    _mpt("h100", "1b", 2048, 128, 40.6, 12, 1, 1536, 5647854, "SHARD_GRAD_OP", False, "amp_bf16"),
    # "H100 80GB BF16"
    _mpt("h100", "70b", 2048, 64, 42.57, 8, 4, 2048, 66523, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "70b", 2048, 32, 36.15, 2, 16, 1024, 28242, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 8192, 8, 29.92, 1, 21, 168, 11072, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 4096, 8, 35.86, 1, 21, 168, 14419, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 2048, 32, 43.92, 14, 3, 1344, 73860, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 2048, 16, 43.07, 10, 3, 480, 36209, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 2048, 8, 38.11, 3, 21, 504, 16022, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "30b", 1024, 8, 38.76, 6, 21, 1008, 16672, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "13b", 32768, 8, 31.68, 1, 3, 24, 15812, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "13b", 16384, 8, 35.55, 3, 3, 72, 23881, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "13b", 4096, 8, 41.6, 10, 3, 240, 37740, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "13b", 2048, 64, 39.86, 2, 1, 128, 307209, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "13b", 2048, 32, 39.95, 2, 1, 64, 153960, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "13b", 2048, 16, 39.58, 2, 1, 32, 76280, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "13b", 2048, 8, 39.79, 2, 1, 16, 38336, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "13b", 1024, 8, 44.27, 40, 3, 960, 44019, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "7b", 65536, 8, 28.59, 1, 2, 16, 15654, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "7b", 32768, 8, 30.94, 2, 2, 32, 26550, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "7b", 8192, 8, 37.14, 8, 2, 128, 55481, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "7b", 4096, 8, 40.42, 16, 2, 256, 68893, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "7b", 2048, 8, 46.44, 6, 1, 48, 85144, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "7b", 1024, 8, 42.83, 64, 2, 1024, 81628, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "3b", 65536, 8, 26.81, 1, 2, 16, 26099, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "3b", 32768, 8, 28.84, 3, 6, 144, 46984, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "3b", 16384, 8, 36.34, 1, 6, 48, 89223, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 8192, 8, 40.31, 3, 6, 144, 132626, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 4096, 8, 42.31, 5, 6, 240, 167712, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 2048, 64, 40.8, 6, 3, 1152, 1441663, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 2048, 32, 41.7, 6, 3, 576, 736701, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 2048, 16, 43.73, 10, 3, 480, 386285, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 1024, 8, 46.2, 20, 6, 960, 216369, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "3b", 512, 8, 46.32, 40, 6, 1920, 223721, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 65536, 8, 26.34, 1, 2, 16, 44050, "FULL_SHARD", True, "amp_bf16"),
    _mpt("h100", "1b", 32768, 8, 33.54, 1, 4, 32, 96203, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 16384, 8, 35.22, 2, 4, 64, 157194, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 8192, 8, 37.73, 3, 4, 96, 233256, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 4096, 8, 40.26, 7, 4, 224, 308282, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 2048, 64, 40.85, 20, 1, 1280, 2841754, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 2048, 32, 41.52, 20, 1, 640, 1444183, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 2048, 16, 42.36, 20, 1, 320, 736596, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 2048, 8, 41.82, 14, 1, 112, 363645, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 1024, 8, 41.95, 18, 4, 576, 391287, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "1b", 512, 8, 43.21, 56, 4, 1792, 418201, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 32768, 8, 31.84, 1, 2, 16, 130333, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 16384, 8, 33.57, 3, 2, 48, 222521, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 8192, 8, 34.84, 6, 2, 96, 334602, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 4096, 8, 35.83, 12, 2, 192, 443674, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 2048, 32, 37.57, 24, 1, 768, 2175091, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 2048, 16, 37.89, 24, 1, 384, 1096819, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 2048, 8, 34.9, 24, 2, 384, 505177, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 1024, 8, 39.76, 48, 2, 768, 628648, "FULL_SHARD", False, "amp_bf16"),
    _mpt("h100", "760m", 512, 8, 40.42, 96, 2, 1536, 669998, "FULL_SHARD", False, "amp_bf16"),
    # "H100 80GB FP8"
    _mpt("h100", "3b", 32768, 8, 14.38, 3, 6, 144, 46853, "FULL_SHARD", True, "amp_fp8"),
    _mpt("h100", "3b", 8192, 8, 23.28, 3, 6, 144, 153174, "FULL_SHARD", False, "amp_fp8"),
    _mpt("h100", "3b", 2048, 8, 27.7, 10, 6, 480, 244692, "FULL_SHARD", False, "amp_fp8"),
    _mpt("h100", "3b", 512, 8, 30.25, 40, 6, 1920, 292217, "FULL_SHARD", False, "amp_fp8"),
    _mpt("h100", "1b", 32768, 8, 17.55, 1, 4, 32, 100643, "FULL_SHARD", False, "amp_fp8"),
    _mpt("h100", "1b", 8192, 8, 20.71, 2, 4, 64, 256087, "FULL_SHARD", False, "amp_fp8"),
    _mpt("h100", "1b", 512, 8, 29.06, 56, 4, 1792, 562523, "FULL_SHARD", False, "amp_fp8"),
    # "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
    _mpt("a100", "70b", 2048, 64, 53.33, 8, 4, 2048, 26274, "FULL_SHARD", True, "bf16"),
    _mpt("a100", "70b", 2048, 32, 48.56, 2, 16, 1024, 11962, "FULL_SHARD", True, "bf16"),
    _mpt("a100", "30b", 8192, 8, 39.38, 1, 21, 168, 4594, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "30b", 4096, 8, 51.37, 1, 21, 168, 6513, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "30b", 2048, 8, 55.3, 3, 21, 504, 7330, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "30b", 1024, 8, 55.82, 6, 21, 1008, 7571, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "30b", 512, 8, 56.4, 12, 21, 2016, 7739, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "13b", 32768, 8, 51.69, 1, 3, 24, 8134, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "13b", 16384, 8, 54.07, 3, 3, 72, 11454, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "13b", 8192, 8, 56.07, 5, 3, 120, 14362, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "13b", 4096, 8, 57.62, 10, 3, 240, 16482, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "13b", 2048, 8, 59.57, 2, 3, 48, 18097, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "13b", 1024, 8, 59.48, 40, 3, 960, 18647, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "7b", 65536, 8, 46.97, 1, 2, 16, 8108, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "7b", 32768, 8, 49.46, 2, 2, 32, 13382, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "7b", 16384, 8, 51.96, 4, 2, 64, 19629, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "7b", 8192, 8, 54.47, 8, 2, 128, 25655, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "7b", 4096, 8, 54.84, 16, 2, 256, 29472, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "7b", 2048, 8, 64.23, 6, 2, 96, 37130, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "7b", 1024, 8, 58.01, 64, 2, 1024, 34857, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "3b", 65536, 8, 46.05, 1, 2, 16, 14137, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "3b", 32768, 8, 47.18, 3, 6, 144, 24235, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "3b", 16384, 8, 57.13, 1, 6, 48, 44233, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "3b", 8192, 8, 59.34, 3, 6, 144, 61567, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "3b", 4096, 8, 60.53, 5, 6, 240, 75658, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "3b", 2048, 8, 62.11, 10, 2, 160, 86491, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "3b", 1024, 8, 62.73, 20, 6, 960, 92643, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "3b", 512, 8, 63.71, 40, 6, 1920, 97019, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "1b", 65536, 8, 46.18, 1, 2, 16, 24353, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "1b", 32768, 8, 55.52, 1, 4, 32, 50207, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "1b", 16384, 8, 56.6, 2, 4, 64, 79650, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "1b", 8192, 8, 56.69, 3, 4, 96, 110516, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "1b", 4096, 8, 59.0, 7, 4, 224, 142457, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "1b", 2048, 8, 59.86, 14, 4, 448, 164109, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "1b", 1024, 8, 60.15, 18, 4, 576, 176898, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "1b", 512, 8, 60.68, 56, 4, 1792, 185186, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "760m", 65536, 8, 45.34, 1, 2, 16, 33150, "FULL_SHARD", True, "amp_bf16"),
    _mpt("a100", "760m", 32768, 8, 54.57, 1, 2, 16, 70417, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "760m", 16384, 8, 54.64, 3, 2, 48, 114198, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "760m", 8192, 8, 55.31, 6, 2, 96, 167471, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "760m", 4096, 8, 56.05, 12, 2, 192, 218808, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "760m", 2048, 8, 56.85, 24, 2, 384, 259472, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "760m", 1024, 8, 47.76, 48, 2, 768, 238122, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "760m", 512, 8, 45.07, 96, 2, 1536, 235571, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 65536, 8, 52.7, 1, 2, 16, 60195, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 32768, 8, 52.46, 2, 2, 32, 109222, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 16384, 8, 53.28, 4, 2, 64, 188478, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 8192, 8, 53.8, 8, 2, 128, 292559, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 4096, 8, 53.31, 16, 2, 256, 396442, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 2048, 8, 51.62, 32, 2, 512, 470263, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 1024, 8, 50.51, 64, 2, 1024, 518504, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "350m", 512, 8, 50.61, 128, 2, 2048, 554643, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 65536, 8, 54.13, 1, 2, 16, 162946, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 32768, 8, 52.71, 2, 2, 32, 291256, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 16384, 8, 50.61, 4, 2, 64, 480322, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 8192, 8, 48.85, 8, 2, 128, 723142, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 4096, 8, 46.08, 16, 2, 256, 947172, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 2048, 8, 44.79, 40, 2, 640, 1142641, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 2048, 8, 44.45, 32, 2, 512, 1133901, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 1024, 8, 43.15, 64, 2, 1024, 1251751, "FULL_SHARD", False, "amp_bf16"),
    _mpt("a100", "125m", 512, 8, 42.56, 128, 2, 2048, 1325455, "FULL_SHARD", False, "amp_bf16"),
    # "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"
    _mpt("a100-40gb", "70b", 2048, 128, 48.91, 4, 1, 512, 48194, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "70b", 2048, 64, 35.87, 2, 1, 128, 17672, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "30b", 2048, 128, 52.25, 6, 1, 768, 110803, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "30b", 2048, 32, 51.74, 4, 1, 128, 27431, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 8192, 8, 43.95, 1, 16, 128, 11258, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 4096, 8, 44.85, 2, 16, 256, 12830, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 2048, 128, 51.93, 16, 1, 2048, 252444, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 2048, 64, 52.04, 16, 1, 1024, 126479, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 2048, 32, 52.62, 14, 1, 448, 63946, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 2048, 16, 52.5, 10, 1, 160, 31900, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 2048, 8, 43.94, 4, 16, 512, 13347, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 1024, 8, 44.07, 8, 16, 1024, 13817, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "13b", 512, 8, 44.28, 16, 16, 2048, 14108, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 16384, 8, 47.65, 1, 4, 32, 17998, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 8192, 8, 49.04, 3, 4, 96, 23098, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 4096, 8, 50.11, 6, 4, 192, 26930, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 2048, 128, 50.14, 18, 1, 2304, 463749, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 2048, 64, 50.73, 18, 1, 1152, 234614, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 2048, 32, 51.55, 18, 1, 576, 119202, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 2048, 16, 50.44, 16, 1, 256, 58322, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 2048, 8, 50.92, 12, 4, 384, 29436, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 1024, 8, 51.31, 24, 4, 768, 30833, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "7b", 512, 8, 50.85, 48, 4, 1536, 31167, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "3b", 32768, 8, 46.03, 1, 4, 32, 23640, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "3b", 16384, 8, 46.14, 2, 8, 128, 35726, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "3b", 8192, 8, 55.13, 1, 8, 64, 57193, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 4096, 8, 56.18, 2, 8, 128, 70223, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 2048, 128, 54.8, 6, 1, 768, 1220885, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 2048, 64, 55.94, 6, 1, 384, 623167, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 2048, 32, 56.96, 6, 1, 192, 317261, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 2048, 16, 56.02, 5, 1, 80, 156013, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 2048, 8, 57.82, 5, 8, 320, 80520, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 1024, 8, 58.14, 10, 8, 640, 85854, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "3b", 512, 8, 59.49, 20, 8, 1280, 90596, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 32768, 8, 45.07, 1, 4, 32, 40762, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "1b", 16384, 8, 55.23, 1, 8, 64, 77723, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 8192, 8, 55.29, 2, 8, 128, 107799, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 4096, 8, 55.85, 4, 8, 256, 134851, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 2048, 128, 54.41, 10, 1, 1280, 2386897, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 2048, 64, 55.44, 10, 1, 640, 1216104, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 2048, 32, 45.39, 10, 1, 320, 497782, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 2048, 16, 55.69, 8, 1, 128, 305372, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 2048, 8, 56.23, 8, 8, 512, 154171, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 1024, 8, 57.02, 16, 8, 1024, 167677, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "1b", 512, 8, 57.1, 32, 8, 2048, 174256, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 32768, 8, 44.53, 1, 4, 32, 57464, "FULL_SHARD", True, "bf16"),
    _mpt("a100-40gb", "760m", 16384, 8, 53.26, 1, 4, 32, 111316, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 8192, 8, 53.12, 3, 4, 96, 160853, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 4096, 8, 53.0, 6, 4, 192, 206909, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 2048, 128, 50.73, 12, 1, 1536, 3704382, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 2048, 64, 51.44, 12, 1, 768, 1878030, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 2048, 32, 51.97, 12, 1, 384, 948745, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 2048, 16, 51.9, 12, 1, 192, 473723, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 2048, 8, 52.89, 12, 4, 384, 241389, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 1024, 8, 53.63, 24, 4, 768, 267376, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "760m", 512, 8, 53.47, 48, 4, 1536, 279504, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 32768, 8, 51.55, 1, 4, 32, 107329, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 16384, 8, 51.78, 2, 4, 64, 183175, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 8192, 8, 51.39, 4, 4, 128, 279466, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 4096, 8, 50.38, 8, 4, 256, 374670, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 2048, 128, 45.61, 18, 1, 2304, 6647647, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 2048, 64, 46.27, 18, 1, 1152, 3372118, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 2048, 32, 47.26, 18, 1, 576, 1721978, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 2048, 16, 48.66, 18, 1, 288, 886622, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 2048, 8, 49.17, 16, 4, 512, 447963, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 1024, 8, 48.73, 32, 4, 1024, 500184, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "350m", 512, 8, 48.39, 64, 4, 2048, 530277, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 32768, 8, 47.27, 1, 4, 32, 261208, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 16384, 8, 46.77, 2, 3, 48, 443876, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 8192, 8, 46.94, 5, 3, 120, 694868, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 4096, 8, 44.82, 13, 3, 312, 921297, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 2048, 128, 38.86, 26, 1, 3328, 15863837, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 2048, 64, 39.27, 26, 1, 1664, 8015010, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 2048, 32, 39.86, 26, 1, 832, 4067922, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 2048, 16, 40.93, 26, 1, 416, 2088560, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 2048, 8, 42.75, 26, 3, 624, 1090678, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 1024, 8, 40.89, 52, 3, 1248, 1186314, "FULL_SHARD", False, "bf16"),
    _mpt("a100-40gb", "125m", 512, 8, 40.26, 104, 3, 2496, 1253886, "FULL_SHARD", False, "bf16"),
)

# --- Megatron-LM README model table (Megatron-Core r0.8, H100, 2024-07) ---------------------
MEGATRON = "NVIDIA/Megatron-LM:README.md + images/model_table.png@f2e5db4"
MEGATRON_NOTE = ("Transformer Engine, TP/DP/PP communication overlap (tp-comm-overlap, overlap-grad-"
                 "reduce, overlap-param-gather); micro batch, schedule and recompute not published: "
                 "scored with mb 1, no recompute, sequence parallelism, the distributed optimizer "
                 "(ZeRO-1) and the vpp dsforge predicts fastest")


def megatron_gpt_flops_per_token(m: Model, seq_len: int) -> float:
    """Megatron-LM's num_floating_point_operations at the table's commit (training.py, 2024-07)
    for a GPT without GQA, 4h GELU MLP, per token: 12 L h^2 (6 + s/h) + 6 h V. Its attention
    term is not halved for the causal mask, so it equals dsforge's formula up to the MLP width
    rounding; used only to turn the published TFLOP/s per GPU back into tokens/s."""
    L, h = m.num_layers, m.hidden_size
    return 12 * L * h * h * (6 + seq_len / h) + 6 * h * m.vocab_size


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
              batch: int, tflops_per_gpu: float, mfu: float) -> Row:
    model = _gpt(size, hidden, layers, heads)
    tokens_per_s = tflops_per_gpu * 1e12 / megatron_gpt_flops_per_token(model, 4096) * gpus
    return Row("megatron-lm", MEGATRON, f"GPT {size}", model, 4096, "h100", gpus, 8, tp, pp,
               gpus // (tp * pp), 1, 1, batch, "none", tokens_per_s, mfu, MEGATRON_NOTE,
               vpp=None if pp > 1 else 1, sequence_parallel=tp > 1)


MEGATRON_LM = (
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 0.41),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 0.47),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 0.49),
    _megatron("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 0.46),
    _megatron("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 0.42),
    _megatron("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 0.43),
    _megatron("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 0.44),
    _megatron("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 0.48),
    _megatron("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 0.47),
)

# --- torchtitan (Llama 3.1, H100 96 GB HBM2e at 500 W, Grand Teton, 8 per node) -------------
TT_2412 = "pytorch/torchtitan:benchmarks/llama3_h100_202412_torchtitan.md@b5bcd76"
TT_ASYNC = "pytorch/torchtitan:benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md@b5bcd76"
TT_TRAINY = "pytorch/torchtitan:benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md@b5bcd76"
TT_NOTE = ("PyTorch FSDP2, seq 8192 (train_configs at the benchmark's date); H100 at 500 W with "
           "96 GB, below the SXM peak dsforge divides by; the fit is checked against 80 GB")
_SAC = ("; torchtitan's selective AC is per-op: it recomputes each layer's 2nd, 4th and 6th matmul "
        "(wk, wo, w3) in the backward, scored as dsforge's selective plus those forwards")
_SAC_MEMORY = ("torchtitan's per-op selective checkpointing stores only every other matmul output and "
               "recomputes the rest; dsforge's selective (Megatron's) drops only the s x s attention "
               "scores, which flash attention never stores, so it keeps every activation; and these "
               "GPUs have 96 GB, the fit is checked against 80")
FP8 = "Float8 linears (torchao): dsforge models BF16 only"
CP = ("context parallelism by ring attention (dsforge's cp is Ulysses' all-to-all, a "
      "different exchange)")


def _tt(ref: str, label: str, model: Model, gpus: int, tp: int, pp: int, local_batch: int,
        checkpointing: str, tokens_per_gpu: float, note: str, unscorable: str = "",
        seq: int = 8192, gpu: str = "h100", vpp: int | None = 1) -> Row:
    dp = gpus // (tp * pp)  # for the CP rows the cp ranks are counted in dp (they are unscorable)
    return Row("torchtitan", ref, label, model, seq, gpu, gpus, 8, tp, pp, dp, 3, 1 if pp > 1 else local_batch,
               dp * local_batch, checkpointing, tokens_per_gpu * gpus, None, f"{TT_NOTE}; {note}",
               vpp=vpp, sequence_parallel=tp > 1, unscorable=unscorable,
               memory_note=_SAC_MEMORY if _SAC in note else "", per_op_sac=_SAC in note)


TORCHTITAN = (
    _tt(TT_2412, "T1 8B FSDP", LLAMA3_8B, 8, 1, 1, 2, "selective", 5762, "eager" + _SAC),
    _tt(TT_2412, "T1 8B FSDP + compile", LLAMA3_8B, 8, 1, 1, 2, "selective", 6667, "torch.compile" + _SAC),
    _tt(TT_2412, "T1 8B FSDP + compile + Float8", LLAMA3_8B, 8, 1, 1, 2, "selective", 8532, "torch.compile", FP8),
    _tt(TT_2412, "T2 8B FSDP8 CP1 seq 32k", LLAMA3_8B, 8, 1, 1, 1, "full", 3890, "compile", FP8, seq=32768),
    _tt(TT_2412, "T2 8B FSDP4 CP2 seq 64k", LLAMA3_8B, 8, 1, 1, 1, "full", 2540, "compile", f"{FP8}; {CP}", seq=65536),
    _tt(TT_2412, "T2 8B FSDP2 CP4 seq 128k", LLAMA3_8B, 8, 1, 1, 1, "full", 1071, "compile", f"{FP8}; {CP}", seq=131072),
    _tt(TT_2412, "T2 8B FSDP1 CP8 seq 256k", LLAMA3_8B, 8, 1, 1, 1, "full", 548, "compile", f"{FP8}; {CP}", seq=262144),
    _tt(TT_2412, "T3 8B FSDP", LLAMA3_8B, 128, 1, 1, 2, "selective", 5605, "eager" + _SAC),
    _tt(TT_2412, "T3 8B FSDP + compile", LLAMA3_8B, 128, 1, 1, 2, "selective", 6514, "torch.compile" + _SAC),
    _tt(TT_2412, "T3 8B FSDP + compile + Float8", LLAMA3_8B, 128, 1, 1, 2, "selective", 8380, "torch.compile", FP8),
    _tt(TT_2412, "T4 70B FSDP32 TP8", LLAMA3_70B, 256, 8, 1, 16, "full", 829, "compile", FP8),
    _tt(TT_2412, "T4 70B FSDP32 TP8 + AsyncTP", LLAMA3_70B, 256, 8, 1, 16, "full", 876, "compile", FP8),
    _tt(TT_2412, "T5 405B FSDP8 TP8 PP8 1F1B", LLAMA3_405B, 512, 8, 8, 32, "full", 100, "compile, AsyncTP", FP8),
    _tt(TT_2412, "T5 405B FSDP8 TP8 PP8 interleaved", LLAMA3_405B, 512, 8, 8, 32, "full", 128, "compile, AsyncTP",
        FP8, vpp=None),
    _tt(TT_2412, "T6 405B FSDP8 CP1 seq 32k", LLAMA3_405B, 512, 8, 8, 8, "full", 76, "compile, AsyncTP", FP8,
        seq=32768),
    _tt(TT_2412, "T6 405B FSDP4 CP2 seq 64k", LLAMA3_405B, 512, 8, 8, 8, "full", 47, "compile, AsyncTP",
        f"{FP8}; {CP}", seq=65536),
    _tt(TT_2412, "T6 405B FSDP2 CP4 seq 128k", LLAMA3_405B, 512, 8, 8, 8, "full", 31, "compile, AsyncTP",
        f"{FP8}; {CP}", seq=131072),
    _tt(TT_2412, "T6 405B FSDP1 CP8 seq 256k", LLAMA3_405B, 512, 8, 8, 8, "full", 16, "compile, AsyncTP",
        f"{FP8}; {CP}", seq=262144),
    _tt(TT_ASYNC, "70B FSDP32 TP8 bf16 vanilla TP", LLAMA3_70B, 256, 8, 1, 16, "full", 597.3, "torch.compile"),
    _tt(TT_ASYNC, "70B FSDP32 TP8 bf16 async TP", LLAMA3_70B, 256, 8, 1, 16, "full", 652.4,
        "torch.compile, async TP (overlaps TP communication; dsforge does not)"),
    _tt(TT_ASYNC, "70B FSDP32 TP8 float8 tensorwise", LLAMA3_70B, 256, 8, 1, 16, "full", 809.8, "compile", FP8),
    _tt(TT_ASYNC, "70B FSDP32 TP8 float8 tensorwise async TP", LLAMA3_70B, 256, 8, 1, 16, "full", 942.4,
        "compile", FP8),
    _tt(TT_ASYNC, "70B FSDP32 TP8 float8 rowwise", LLAMA3_70B, 256, 8, 1, 16, "full", 599.6, "compile", FP8),
    _tt(TT_ASYNC, "70B FSDP32 TP8 float8 rowwise async TP", LLAMA3_70B, 256, 8, 1, 16, "full", 624.8,
        "compile", FP8),
    _tt(TT_ASYNC, "8B FSDP8 TP8 bf16 vanilla TP", LLAMA3_8B, 64, 8, 1, 12, "selective", 4378, "torch.compile" + _SAC),
    _tt(TT_ASYNC, "8B FSDP8 TP8 bf16 async TP", LLAMA3_8B, 64, 8, 1, 12, "selective", 4809.4,
        "torch.compile, async TP" + _SAC),
    _tt(TT_ASYNC, "8B FSDP8 TP8 float8 tensorwise", LLAMA3_8B, 64, 8, 1, 12, "selective", 5078.1, "compile", FP8),
    _tt(TT_ASYNC, "8B FSDP8 TP8 float8 tensorwise async TP", LLAMA3_8B, 64, 8, 1, 12, "selective", 5570.1,
        "compile", FP8),
    _tt(TT_ASYNC, "8B FSDP8 TP8 float8 rowwise", LLAMA3_8B, 64, 8, 1, 12, "selective", 3708.5, "compile", FP8),
    _tt(TT_ASYNC, "8B FSDP8 TP8 float8 rowwise async TP", LLAMA3_8B, 64, 8, 1, 12, "selective", 3914.9,
        "compile", FP8),
    _tt(TT_TRAINY, "8B FSDP32 (4 nodes) Float8", LLAMA3_8B, 32, 1, 1, 2, "selective", 10938, "compile", FP8,
        gpu="h200"),
    _tt(TT_TRAINY, "8B FSDP64 (8 nodes) Float8", LLAMA3_8B, 64, 1, 1, 2, "selective", 10753, "compile", FP8,
        gpu="h200"),
)

# --- The Ultra-Scale Playbook (nanotron), via the shared reference --------------------------
PLAYBOOK = ("../shared/reference/performance-anchors.md (Ultra-Scale Playbook benchmark data; "
            "the Playbook's own data files were not found in the index)")
PLAYBOOK_ROWS = (
    Row("playbook", PLAYBOOK, "8B DP2 PP4 ZeRO-1", LLAMA3_8B, 4096, "h100", 8, 8, 1, 4, 2, 1, 1, 64,
        "none", 7503 * 8, 0.452,
        "nanotron; secondary source: seq 4096, mb 1, global 64, 1F1B and no recompute assumed "
        "(as tools/search_anchors.py); the stated 45.2% does not follow from 7,503 tok/s/GPU"),
)

ROWS: tuple[Row, ...] = KEMPNERFORGE + LLM_FOUNDRY + MEGATRON_LM + TORCHTITAN + PLAYBOOK_ROWS


# --- scoring ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scored:
    row: Row
    measured: float  # MFU recomputed with dsforge's formula
    predicted: float | None
    fits: bool | None  # the memory model's verdict on the scored layout (None: not scored)
    memory_gib: float | None
    usable_gib: float | None  # the GPU's memory less the search's default headroom
    scored_as: str = ""  # the nearest accepted layout when the published one is refused
    reason: str = ""  # why it is not scored
    # The scored layout as dsforge resolved it (None: not scored): what a refit reads.
    resolved: Resolved | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted - self.measured

    @property
    def over_gpu(self) -> bool:
        """Estimated above the GPU's whole memory, not only above the headroom the fit keeps."""
        return self.fits is False and self.memory_gib > gpu_by_key(self.row.gpu).memory_bytes / GiB


def _recipe(row: Row, zero: int, vpp: int):
    raw = _raw_recipe_model(row.model, row.seq_len)
    nodes = max(1, row.gpus // row.gpus_per_node)
    raw.update(parallel={"tp": row.tp, "pp": row.pp, "vpp": vpp, "dp": row.dp,
                         "sequence_parallel": row.sequence_parallel},
               zero={"stage": zero},
               cluster={"nodes": nodes, "gpus_per_node": min(row.gpus, row.gpus_per_node), "gpu": row.gpu})
    raw["train"].update(micro_batch=row.micro_batch, global_batch=row.global_batch,
                        activation_checkpointing=row.checkpointing)
    return build_recipe(raw)


def predict(row: Row, zero: int | None = None, vpp: int | None = None) -> Ranked:
    """dsforge's evaluation of this exact layout (raises RecipeError if the validator refuses it)."""
    recipe = _recipe(row, row.zero if zero is None else zero, row.vpp if vpp is None else vpp)
    slots = (min(row.gpus, row.gpus_per_node),) * max(1, row.gpus // row.gpus_per_node)
    resolved = resolve(recipe, Topology(world_size=row.gpus, node_slots=slots, source="published"))
    ranked = evaluate(Candidate(resolved=resolved, exact_batch=True), engine_profile(row))
    return _with_per_op_sac(row, ranked) if row.per_op_sac else ranked


def per_op_sac_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token that torchtitan's per-op selective checkpointing runs again in
    the backward and dsforge's selective does not. Its policy (torchtitan's
    parallelize_llama.py at the benchmarks' dates) saves every matmul output but every second
    one of a layer's forward, counted afresh each time the layer runs: in Llama's order wq wk
    wv wo w1 w3 w2 it recomputes wk, wo and w3 (36.5% of a llama3-8b layer's matmuls). Every
    other op is recomputed as well: elementwise work, which the default profiles' efficiency
    stands for."""
    kv_width = m.query_groups * m.head_dim
    return 2.0 * m.num_layers * m.hidden_size * (kv_width + m.num_attention_heads * m.head_dim
                                                 + m.ffn_hidden_size)


def _with_per_op_sac(row: Row, ranked: Ranked) -> Ranked:
    """`ranked` with the recompute `per_op_sac_flops` counts added to its compute, at the rate
    of the layers' other matmuls: the compute term's hardware FLOPs grow by that share. Only
    for layouts without a pipeline, whose compute term is the whole model's."""
    assert row.pp == 1, "per-op SAC is scored without pipelines only"
    config = row.model.config(row.seq_len)
    hardware = flops_per_token(config, row.seq_len, row.checkpointing).hardware
    extra = ranked.time.compute * per_op_sac_flops(config) / hardware
    time = dataclasses.replace(ranked.time, compute=ranked.time.compute + extra)
    slower = ranked.time.total / time.total
    return dataclasses.replace(ranked, time=time, tokens_per_s=ranked.tokens_per_s * slower,
                               mfu=ranked.mfu * slower)


def engine_profile(row: Row):
    """The GPU's default profile without dsforge's host floors: those were measured on
    dsforge's own engine (Megatron's layers launched eagerly under DeepSpeed, one GPU), and the
    published runs ran other engines (torch.compile, CUDA graphs, Transformer Engine) whose
    host costs nobody measured here. The "before" commit's profile has no floors to clear."""
    profile = default_profile(row.gpu, row.gpus_per_node)
    floors = {f: 0.0 for f in ("host_layer_s", "host_layer_zero3_s") if hasattr(profile, f)}
    return dataclasses.replace(profile, **floors)


def _vpps(row: Row) -> list[int]:
    if row.vpp is not None:
        return [row.vpp]
    return [v for v in divisors(row.model.num_layers // row.pp) if v <= MAX_VPP]


def _best_over_vpp(row: Row, zero: int) -> tuple[Ranked, int]:
    """The fastest accepted vpp when the source does not publish one (else exactly its own)."""
    found, last_error = [], None
    for v in _vpps(row):
        try:
            found.append((predict(row, zero, v), v))
        except RecipeError as e:
            last_error = e
    if not found:
        raise last_error
    return min(found, key=lambda pair: pair[0].time.total)


def _rules(error: RecipeError) -> str:
    return ", ".join(sorted({p.rule for p in error.problems if p.severity == "error"}))


@cache
def score(row: Row) -> Scored:
    measured = row.measured_mfu
    if row.unscorable:
        return Scored(row, measured, None, None, None, None, reason=row.unscorable)
    scored_as = ""
    try:
        ranked, vpp = _best_over_vpp(row, row.zero)
    except RecipeError as refused:
        if not (row.zero == 3 and row.pp > 1):
            return Scored(row, measured, None, None, None, None,
                          reason=f"refused by dsforge's validator ({_rules(refused)}): {refused.problems[0].message}")
        # Only in the "before" run (5b31f63), where Z2 refused ZeRO-3 with pipelines: FSDP under a
        # pipeline (torchtitan, KempnerForge) keeps parameters gathered across microbatches and
        # shards gradients, so ZeRO-2 is the nearest accepted layout.
        ranked, vpp = _best_over_vpp(row, 2)
        scored_as = "ZeRO-2 (ZeRO-3 with pp > 1 refused, rule Z2)"
    if row.vpp is None:
        scored_as = "; ".join(filter(None, [scored_as, f"vpp {vpp} (not published; fastest in dsforge)"]))
    usable = default_profile(row.gpu, row.gpus_per_node).usable_memory_bytes
    return Scored(row, measured, ranked.mfu, ranked.memory.total <= usable, ranked.memory.total / GiB,
                  usable / GiB, scored_as=scored_as, resolved=ranked.resolved)


def score_all(rows: tuple[Row, ...] = ROWS) -> list[Scored]:
    return [score(r) for r in rows]


# --- statistics -----------------------------------------------------------------------------

def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's on the (tie-averaged) ranks; None when undefined."""
    if len(x) != len(y) or len(x) < 3:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / norm if norm else None


@dataclass(frozen=True)
class Stats:
    group: str
    rows: int  # all rows of the group
    scored: int
    median_abs_error: float | None  # MFU points (percentage points)
    worst_abs_error: float | None
    mean_error: float | None  # signed: > 0 = dsforge over-predicts
    spearman: float | None
    rejected_by_fit: int
    # Median of |predicted / measured - 1|: the relative error of the predicted throughput,
    # i.e. how far the measured step time lies from the predicted one, as a share of it. The
    # search's band (profile.PREDICTION_ERROR) is this figure for "all".
    median_relative_error: float | None = None
    # Of rejected_by_fit, those estimated above the GPU's whole memory (the rest fit the GPU but
    # not the headroom), and of those the ones no implementation difference explains.
    over_gpu: int = 0
    over_gpu_unexplained: int = 0


def stats_for(group: str, scored: list[Scored]) -> Stats:
    ok = [s for s in scored if s.predicted is not None]
    errors = [100 * abs(s.error) for s in ok]
    return Stats(group=group, rows=len(scored), scored=len(ok),
                 median_abs_error=statistics.median(errors) if errors else None,
                 worst_abs_error=max(errors) if errors else None,
                 mean_error=statistics.fmean(100 * s.error for s in ok) if ok else None,
                 spearman=spearman([s.measured for s in ok], [s.predicted for s in ok]),
                 rejected_by_fit=sum(1 for s in ok if s.fits is False),
                 median_relative_error=(statistics.median(abs(s.predicted / s.measured - 1) for s in ok)
                                        if ok else None),
                 over_gpu=sum(1 for s in ok if s.over_gpu),
                 over_gpu_unexplained=sum(1 for s in ok if s.over_gpu and not s.row.memory_note))


def statistics_table(scored: list[Scored]) -> list[Stats]:
    """One line per source, then all sources together."""
    lines = [stats_for(source, [s for s in scored if s.row.source == source]) for source in SOURCES]
    return lines + [stats_for("all", scored)]


def fit_rejections(scored: list[Scored]) -> list[Scored]:
    """Published runs (they trained) whose layout dsforge's memory model says does not fit."""
    return [s for s in scored if s.fits is False]


@dataclass(frozen=True)
class Choice:
    """A scenario (one source's runs of one model, sequence length, GPU type and GPU count)
    that measured two or more different layouts: the one dsforge predicts fastest, against
    the best one measured. Regret is how much MFU the planner's pick gave up."""
    source: str
    scenario: str
    pick: Scored  # the scored run with the highest predicted MFU (of equals, the best measured)
    best: Scored  # the scored run with the highest measured MFU
    layouts: int  # different layouts measured

    @property
    def regret(self) -> float:
        """MFU points: the best measured less the pick's measured (0: the pick was the best)."""
        return 100 * (self.best.measured - self.pick.measured)


def first_choices(scored: list[Scored]) -> list[Choice]:
    """Every scenario with two or more different scored layouts, in the order of ROWS. Runs
    that differ only in what dsforge does not model (torch.compile, float8, async TP) are one
    layout: the planner cannot choose between them."""
    scenarios: dict[tuple, list[Scored]] = {}
    for s in scored:
        if s.predicted is not None:
            r = s.row
            scenarios.setdefault((r.source, r.model.name, r.seq_len, r.gpu, r.gpus), []).append(s)
    choices = []
    for (source, model, seq_len, gpu, gpus), runs in scenarios.items():
        layouts = len({s.row.layout() for s in runs})
        if layouts < 2:
            continue
        # Equal predictions are the same layout measured twice (or one the model cannot tell
        # apart): the planner would pick it, and its best run is what it would get.
        choices.append(Choice(source=source, scenario=f"{model}, seq {seq_len}, {gpus} {gpu.upper()}",
                              pick=max(runs, key=lambda s: (round(s.predicted, 9), s.measured)),
                              best=max(runs, key=lambda s: s.measured), layouts=layouts))
    return choices


@dataclass(frozen=True)
class ScaleOut:
    """One published run measured on one node and again on several, nothing else changed:
    how much of its MFU it kept, measured and predicted."""

    source: str
    run: str
    one: Scored  # on one node
    many: Scored  # on several

    @property
    def measured_ratio(self) -> float:
        return self.many.measured / self.one.measured

    @property
    def predicted_ratio(self) -> float:
        return self.many.predicted / self.one.predicted


def scale_out_pairs(scored: list[Scored]) -> list[ScaleOut]:
    """Every scored run measured on one node and on more with the same per-GPU layout
    (model, sequence, GPU, tp, pp, micro-batch, checkpointing, ZeRO): what data parallelism
    across nodes costs it, the figure the inter-node bandwidth model decides."""
    runs: dict[tuple, list[Scored]] = {}
    for s in scored:
        if s.predicted is not None:
            r = s.row
            key = (r.source, r.label, r.model.name, r.seq_len, r.gpu, r.tp, r.pp, r.micro_batch,
                   r.checkpointing, r.zero)
            runs.setdefault(key, []).append(s)
    pairs = []
    for (source, label, *_), group in runs.items():
        one = [s for s in group if s.row.gpus <= s.row.gpus_per_node]
        if one:
            pairs += [ScaleOut(source, f"{label} {one[0].row.gpus} -> {s.row.gpus} {s.row.gpu.upper()}",
                               one[0], s)
                      for s in group if s.row.gpus > s.row.gpus_per_node]
    return pairs


def with_source(rows: tuple[Row, ...], source: str) -> tuple[Row, ...]:
    return tuple(r for r in rows if r.source == source)


__all__ = [
    "ROWS",
    "Choice",
    "Model",
    "Row",
    "ScaleOut",
    "Scored",
    "Stats",
    "fit_rejections",
    "first_choices",
    "megatron_gpt_flops_per_token",
    "predict",
    "scale_out_pairs",
    "score",
    "score_all",
    "spearman",
    "statistics_table",
] 
