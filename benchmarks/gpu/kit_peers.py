"""dsforge beside a peer framework on the same job (issue 39): the shape file a peer reads,
peers.json's rows, their table and bar chart.

A row per run: `framework`, `version`, `settings`, `model`, `seq_len`, `global_batch_tokens`,
`precision`, `measured_steps`, `tokens_per_s_per_gpu`, `mfu`, `first_loss`, `last_loss`,
`device`, and `matches` (the dsforge run a peer row is compared with). dsforge's rows and their
peers' carry the same `model`, `precision` and `seq_len`. MFU is dsforge's formula for every
row (docs/flops.md: 6N + 12 L s heads head_dim, on the device table's bf16 peak), so the
frameworks are counted alike; a row's tokens/s come from its median measured step.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsforge.estimate.flops import flops_per_token
from dsforge.estimate.params import count_params
from kit_format import num, pct
from kit_plan import Measurement, PeerSpec, RunSpec
from kit_steps import peer_paths, resolve_run

PRECISION = "bf16 (fp32 weights and Adam states)"


def write_shape(peer: PeerSpec, spec: RunSpec, gpu: str, work: Path) -> Path:
    """The model of `spec`'s recipe as a peer builds it (peer_loop.py `build_model`)."""
    m = resolve_run(spec, gpu).recipe.model
    shape = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
             "ffn_hidden_size": m.ffn_hidden_size, "num_layers": m.num_layers,
             "num_attention_heads": m.num_attention_heads, "num_kv_heads": m.query_groups,
             "head_dim": m.head_dim, "max_seq_len": m.max_seq_len, "rotary_base": m.rotary_base,
             "norm_epsilon": m.norm_epsilon, "tie_embeddings": m.tie_embeddings,
             "init_std": m.init_std}
    path, _ = peer_paths(peer, work)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(shape, indent=2) + "\n")
    return path


def model_name(spec: RunSpec, gpu: str) -> str:
    """How peers.json names the model: the preset, else the recipe's name, and its size."""
    recipe = resolve_run(spec, gpu).recipe
    billions = count_params(recipe.model).total / 1e9
    return f"{recipe.model.preset or recipe.name} ({billions:.2f}B)"


def _mfu(tokens_per_s: float | None, spec: RunSpec, gpu: str, peak: float | None) -> float | None:
    if not tokens_per_s or not peak:
        return None
    train = resolve_run(spec, gpu).recipe
    return tokens_per_s * flops_per_token(train.model, train.train.seq_len, "none").model / peak


def dsforge_row(run: dict, spec: RunSpec, gpu: str, version: str | None) -> dict:
    """A kit run row (kit_results.run_row) as a peers.json row."""
    train = resolve_run(spec, gpu).recipe.train
    return {"framework": "dsforge", "version": version, "matches": spec.label,
            "settings": {"zero": resolve_run(spec, gpu).recipe.zero.stage,
                         "checkpointing": train.activation_checkpointing,
                         "micro_batch": train.micro_batch, "compile": "none"},
            "model": model_name(spec, gpu), "seq_len": train.seq_len,
            "global_batch_tokens": train.global_batch * train.seq_len, "precision": PRECISION,
            "measured_steps": run.get("measured_steps"),
            "tokens_per_s_per_gpu": run.get("tokens_per_s_per_gpu"), "mfu": run.get("mfu"),
            "first_loss": run.get("first_loss"), "last_loss": run.get("last_loss"),
            "device": run.get("device"), "status": run.get("status")}


def peer_row(peer: PeerSpec, record: dict, spec: RunSpec, gpu: str, work: Path,
             device: str | None, peak: float | None) -> dict:
    """The peer's output (work/peers/LABEL.json) as a peers.json row."""
    _, out = peer_paths(peer, work)
    data = _read(out) or {}
    steps = data.get("steps") or []
    measured = [s for s in steps if not s.get("warmup")]
    per_s = data.get("tokens_per_s")
    train = resolve_run(spec, gpu).recipe.train
    return {"framework": data.get("framework") or peer.framework,
            "version": _version(data.get("versions") or {}), "matches": spec.label,
            "settings": data.get("settings") or {"compile": peer.compile},
            "model": model_name(spec, gpu), "seq_len": train.seq_len,
            "global_batch_tokens": train.global_batch * train.seq_len, "precision": PRECISION,
            "measured_steps": len(measured) if steps else None, "tokens_per_s_per_gpu": per_s,
            "mfu": _mfu(per_s, spec, gpu, peak),
            "first_loss": steps[0]["loss"] if steps else None,
            "last_loss": steps[-1]["loss"] if steps else None, "device": device,
            "peak_memory_bytes": data.get("peak_memory_bytes"),
            "status": record.get("status") if data else f"{record.get('status')}; no output"}


def _version(versions: dict) -> str | None:
    return ", ".join(f"{k} {v}" for k, v in versions.items() if v) or None


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows(measurement: Measurement, runs: list[dict], records: dict, work: Path, gpu: str,
         peak: float | None, version: str | None) -> list[dict]:
    """dsforge's row and its peers' for each run of the measurement planned on `gpu`."""
    out = []
    by_label = {r["label"]: r for r in runs}
    for spec in measurement.runs:
        run = by_label.get(spec.label)
        if run is None:
            continue
        out.append(dsforge_row(run, spec, gpu, version))
        for peer in (p for p in measurement.peers if p.matches == spec.label and gpu in p.gpus):
            out.append(peer_row(peer, records.get(peer.label, {}), spec, gpu, work,
                                run.get("device"), peak))
    return out


def render(peer_rows: list[dict]) -> str:
    """The side-by-side table, each peer against its dsforge row."""
    if not peer_rows:
        return ""
    lines = ["| job | framework | settings | measured steps | tok/s/GPU | MFU | vs dsforge "
             "| loss first -> last | status |", "|---|---|---|---:|---:|---:|---:|---|---|"]
    base = {r["matches"]: r for r in peer_rows if r["framework"] == "dsforge"}
    for r in peer_rows:
        ours = base.get(r["matches"], {}).get("tokens_per_s_per_gpu")
        mine = r.get("tokens_per_s_per_gpu")
        ratio = f"{mine / ours:.2f}x" if mine and ours else "-"
        settings = ", ".join(f"{k} {v}" for k, v in (r.get("settings") or {}).items())
        loss = f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}" \
            if r.get("first_loss") is not None and r.get("last_loss") is not None else "-"
        lines.append(f"| {r['model']}, seq {r['seq_len']}, {r['global_batch_tokens']:,} tokens a "
                     f"step | {r['framework']} | {settings} | {r.get('measured_steps') or '-'} "
                     f"| {num(mine)} | {pct(r.get('mfu'))} | {ratio} | {loss} | {r.get('status')} |")
    return ("### dsforge and a peer on the same job (peers.json; MFU by dsforge's formula for "
            "every row; the same corpus and tokenizer, sample order not shared)\n" + "\n".join(lines))


def chart(peer_rows: list[dict], path: Path) -> Path | None:
    """Bars of tokens/s per GPU and MFU for each row, grouped by job (dsforge report's
    style: matplotlib, one PNG). None where matplotlib is missing or nothing was measured."""
    measured = [r for r in peer_rows if r.get("tokens_per_s_per_gpu")]
    if not measured:
        return None
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['framework']}\n{_short(r.get('settings') or {})}" for r in measured]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(measured), 4))
    for ax, key, title in ((axes[0], "tokens_per_s_per_gpu", "tokens/s per GPU"),
                           (axes[1], "mfu", "MFU (dsforge's formula)")):
        values = [r.get(key) or 0.0 for r in measured]
        colours = ["tab:blue" if r["framework"] == "dsforge" else "tab:grey" for r in measured]
        ax.bar(range(len(values)), values, color=colours)
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_title(title)
    fig.suptitle(f"{measured[0]['model']}, seq {measured[0]['seq_len']}, "
                 f"{measured[0]['global_batch_tokens']:,} tokens a step, {measured[0]['device']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short(settings: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items() if k in ("compile", "checkpointing", "zero"))
