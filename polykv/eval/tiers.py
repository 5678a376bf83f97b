"""Tier overview: every KV type (K = V) and the asymmetric presets, with measured bytes, perplexity
delta and logit equivalence in one table.

InnerQ rows use a table calibrated on the *end* of the corpus (the last INNERQ_CALIB_TOKENS tokens),
while perplexity windows come from its start, so calibration and evaluation never share text.
"""

from __future__ import annotations

import time

import torch

from .common import load_text
from .equiv import eval_equiv, reference_runs
from .ppl import corpus_windows, default_windows, eval_ppl, tokenize

# (k, v, innerq)
SYMMETRIC = [("f16", "f16", False), ("q8_0", "q8_0", False), ("q4_0", "q4_0", False),
             ("turbo8", "turbo8", False), ("turbo4", "turbo4", False), ("turbo3", "turbo3", False),
             ("turbo2", "turbo2", False)]
ASYMMETRIC = [("q8_0", "turbo3", False), ("q8_0", "turbo2", False), ("turbo4", "turbo3", True),
              ("turbo3", "turbo3", True)]
PRESETS = SYMMETRIC + ASYMMETRIC
INNERQ_CALIB_TOKENS = 4096


def preset_label(k: str, v: str, innerq: bool) -> str:
    return f"K {k}{'+InnerQ' if innerq else ''} / V {v}"


def named_presets(names: str | list[str]) -> list[tuple]:
    """Rows for named presets (polykv.presets; "default,balanced" or a list), f16 first as the
    reference: (k, v, innerq, name). A preset's InnerQ "auto" becomes this module's InnerQ table
    (calibrated on text disjoint from the evaluated windows), like every InnerQ row here."""
    from ..presets import PRESETS

    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    rows = [("f16", "f16", False, None)]
    for n in names:
        if n not in PRESETS:
            raise ValueError(f"unknown preset {n!r}; choose one of {sorted(PRESETS)}")
        p = PRESETS[n]
        rows.append((p.k, p.v, p.innerq is not None, n))
    return rows


def calibration_table(model, tok, text=None, tokens: int = INNERQ_CALIB_TOKENS, ctx: int = 1024):
    """InnerQ table from the last `tokens` tokens of the corpus (not saved to the cache dir)."""
    from ..hf.capture import calibrate_innerq

    ids = tokenize(tok, load_text(text))
    tail = ids[-tokens:]
    chunks = [torch.tensor(tail[i:i + ctx]) for i in range(0, len(tail), ctx)]
    return calibrate_innerq(model, tok, chunks, max_tokens=ctx, save=False)


def eval_tiers(model, tok, ctx: int = 2048, text=None, windows: int | None = None, prompts=None,
               presets=None, keep_layers_q8: int = 0, equiv: bool = True, innerq=None,
               max_new_tokens: int = 24, progress: bool = True, ppl: bool = True,
               on_row=None, precision="auto") -> dict:
    """One row per preset: {k, v, innerq, preset, bits_per_value, kv_bytes, ppl, ppl_delta_pct, mean_tv,
    p95_tv, real_frac, recall_mismatch, verdict}. presets: (k, v, innerq[, name]) tuples (default:
    PRESETS; `named_presets` builds them from polykv.presets names). bits_per_value / kv_bytes are measured from the
    cache tensors after a ctx-token window (kv_bytes: allocated storage, compacted).
    innerq: a table for the InnerQ rows (default: calibrated on the end of the corpus).
    ppl / equiv: compute those columns (the other ones are None); on_row(row): called per row.
    precision: for named balanced / max rows, as KVCache(preset=...): "auto" = per-layer types from
    the model's calibrated precision table when one exists, None = the fixed types, or a table path;
    row["precision"] says which ("calibrated" / "fixed"; None for unnamed rows). Named rows carry
    their preset's recent window (`Preset.recent`, row["recent"]) as KVCache(preset=...) does."""
    from ..hf.precision import preset_policy
    from ..presets import PRESETS as NAMED

    t0 = time.time()
    presets = PRESETS if presets is None else presets
    n_win = default_windows(ctx) if windows is None else windows
    wins = corpus_windows(tok, load_text(text), ctx, n_win)
    calib_tokens = INNERQ_CALIB_TOKENS
    table = innerq
    if table is None and any(p[2] for p in presets):
        total = len(tokenize(tok, load_text(text)))
        used = len(wins) * ctx
        if total - used < 1024:
            raise ValueError(f"corpus too short to calibrate InnerQ on text disjoint from the {used} "
                             "evaluated tokens")
        calib_tokens = min(INNERQ_CALIB_TOKENS, total - used)
        table = calibration_table(model, tok, text, calib_tokens)
    ref = eval_ppl(model, tok, "f16", "f16", ctx, text, n_win, progress=progress) if ppl else None
    refs = reference_runs(model, tok, prompts, max_new_tokens, progress) if equiv else None
    rows = []
    for k, v, iq, *name in presets:
        rec = NAMED[name[0]].recent if name and name[0] else 0
        row = {"k": k, "v": v, "innerq": bool(iq), "label": preset_label(k, v, iq),
               "preset": name[0] if name else None, "precision": None, "recent": rec}
        ov = None
        if name and name[0]:
            ov, info = preset_policy(model, name[0], precision)
            row["precision"] = info["source"]
        if ppl and (k, v, iq) == ("f16", "f16", False) and not keep_layers_q8:
            r = ref  # the reference run is this row
            row.update({"bits_per_value": r["bits_per_value"], "kv_bytes": r["kv_bytes"], "ppl": r["ppl"],
                        "ppl_delta_pct": 0.0})
        elif ppl:
            r = eval_ppl(model, tok, k, v, ctx, text, n_win, innerq=table if iq else None,
                         keep_layers_q8=keep_layers_q8, progress=progress, ppl_ref=ref["ppl"],
                         overrides=ov, recent=rec)
            row.update({"bits_per_value": r["bits_per_value"], "kv_bytes": r["kv_bytes"], "ppl": r["ppl"],
                        "ppl_delta_pct": r["delta_pct"]})
        else:
            row.update({"bits_per_value": None, "kv_bytes": None, "ppl": None, "ppl_delta_pct": None})
        if equiv:
            e = eval_equiv(model, tok, k, v, innerq=table if iq else None,
                           keep_layers_q8=keep_layers_q8, max_new_tokens=max_new_tokens,
                           progress=progress, refs=refs, overrides=ov, recent=rec)
            row.update({"mean_tv": e["mean_tv"], "p95_tv": e["p95_tv"], "real_frac": e["real_frac"],
                        "recall_mismatch": e["recall_mismatch"], "verdict": e["verdict"]})
        else:
            row.update({"mean_tv": None, "p95_tv": None, "real_frac": None, "recall_mismatch": None,
                        "verdict": None})
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return {"rows": rows, "ctx": ctx, "windows": len(wins), "tokens": ref["tokens"] if ref else None,
            "ppl_ref": ref["ppl"] if ref else None, "keep_layers_q8": keep_layers_q8,
            "equiv_prompts": len(refs) if refs else 0, "innerq_calib_tokens": calib_tokens,
            "model": getattr(model.config, "model_type", ""), "seconds": round(time.time() - t0, 1)}


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def to_markdown(result: dict) -> str:
    """The tiers result as a Markdown table."""
    lines = ["| K | V | bits/value | KV bytes | ppl | ppl Δ% | mean TV | p95 TV | real_frac | recall mismatch | verdict |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        k = r["k"] + (" +InnerQ" if r.get("innerq") else "") + (f" ({r['preset']})" if r.get("preset") else "")
        if r.get("precision") == "calibrated":
            k += ", calibrated per layer"
        lines.append(
            f"| {k} | {r['v']} | {_fmt(r['bits_per_value'], '.3f')} | {_fmt(r['kv_bytes'], ',d')} | "
            f"{_fmt(r.get('ppl'), '.3f')} | {_fmt(r['ppl_delta_pct'], '+.2f')} | {_fmt(r['mean_tv'], '.4f')} | "
            f"{_fmt(r['p95_tv'], '.4f')} | {_fmt(r['real_frac'], '.2f')} | {_fmt(r['recall_mismatch'], 'd')} | "
            f"{r.get('verdict') or '—'} |")
    return "\n".join(lines)


__all__ = ["ASYMMETRIC", "PRESETS", "SYMMETRIC", "calibration_table", "eval_tiers", "named_presets",
           "preset_label", "to_markdown"]
