"""`polykv eval` commands: ppl, equiv, ruler, tiers (DESIGN §6).

With --json each command prints exactly one JSON object on stdout; progress bars go to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .equiv import FORMAT_HELP

app = typer.Typer(
    name="eval",
    help="Quality harness: perplexity, logit equivalence, RULER-style recall, tier overview.\n\n"
         + FORMAT_HELP.replace("\n", "\n\n"),
    no_args_is_help=True,
    add_completion=False,
)

K_HELP = "K storage type: f16, bf16, q8_0, q4_0, turbo8, turbo4, turbo3, turbo2"
V_HELP = "V storage type (same choices as --k)"
MODEL_HELP = "model: registry name (smollm2-135m, gemma3-270m), HF dir or .gguf (default smollm2-135m)"
INNERQ_HELP = ("InnerQ for turbo K: 'auto' (table from the cache dir), a table path, or 'none' "
               "(default: the preset's)")
PRESET_HELP = ("KV preset: default (K q8_0 / V turbo3), balanced (K turbo4+InnerQ auto / V turbo3), "
               "max (K turbo3+InnerQ auto / V turbo2); --k / --v / --innerq override it")


DEVICE_HELP = "torch device of the model and the caches (default: cpu)"
PRECISION_HELP = ("balanced / max without --k/--v: 'auto' = per-layer types from the model's calibrated "
                  "precision table when one exists (polykv calibrate --bits), 'none' = the preset's fixed "
                  "types, or a table path; the JSON field 'precision' says which was used")


def _load(model: Optional[str], threads: Optional[int], device: Optional[str] = None):
    import torch

    if threads:
        torch.set_num_threads(threads)
    from ..hf.loading import load_model

    return load_model(model, device=device)


ANCHORS_HELP = ("simulate anchors on the cache under test (measurement only, CPU materialize path; "
                "polykv/eval/anchors.py): 'recent=N,sink=N,anchor=q8_0|exact|TYPE' — the first N tokens and "
                "the N rows before each chunk read at that precision; adds the JSON field 'anchors'")


HEADS_HELP = ("per-head K/V types (polykv/eval/heads.py): 'TABLE@BITS' = a per-head precision table "
              "(polykv calibrate --per-head) allocated at BITS bits/value and stored head by head; replaces "
              "the per-layer types, keeps the ring; adds the JSON field 'head_types'")


def _heads(spec: Optional[str], anc):
    if not spec:
        return None
    if anc is not None:
        raise typer.BadParameter("--head-types and --anchors: one at a time (anchors simulate on a "
                                 "per-layer cache)")
    from .heads import HeadTypes

    try:
        return HeadTypes.parse(spec)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None


def _head_fields(r: dict, ht, model, recent: int) -> None:
    """The run's JSON with --head-types: field 'head_types' (the allocation, its bits/value and the
    f16 / held ratio a per-head store with this ring would reach at 2,048 tokens); 'precision' says
    the per-layer table was not used."""
    if ht is None:
        return
    from ..hf.kv_cache import model_layout

    r.pop("anchors", None)
    r["head_types"] = {**ht.as_dict(), "recent": recent,
                       "ratio_expected": round(ht.ratio_expected(model_layout(model), recent), 4)}
    r["precision"] = {"source": "head_types", "reason": "--head-types (per-head types)"}


OUTLIERS_HELP = ("simulate V outlier channels (measurement only, CPU materialize path; polykv/eval/outliers.py): "
                 "'c=32,by=rms|mean_abs|var|first,FROM=HI/LO,...' — every layer whose V type is FROM ('all': "
                 "every layer) holds C channels per KV head at HI and the rest at LO, channels chosen on "
                 "calibration text; keeps the ring; adds the JSON field 'v_outliers'")


def _outliers(spec: Optional[str], anc, ht):
    if not spec:
        return None
    if anc is not None or ht is not None:
        raise typer.BadParameter("--v-outliers, --head-types and --anchors are simulations: one at a time")
    from .outliers import VOutliers

    try:
        return VOutliers.parse(spec)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _outliers_ready(vo, m, tok):
    """The spec with its channels chosen on calibration text, and the context its run needs."""
    import contextlib

    if vo is None:
        return None, contextlib.nullcontext()
    from .outliers import attached

    return vo.calibrated(m, tok), attached()


def _outlier_fields(r: dict, vo, m, k, v, iq, ov, rec: int) -> None:
    if vo is not None:
        from .outliers import outlier_fields

        outlier_fields(r, vo, m, k, v, iq, ov, rec)


RECENT_HELP = ("recent window as storage: every layer's last N rows also held at q8_0 and read instead of "
               "the layer codec's copy (KVCache(recent=N)); default: the preset's (0 with explicit --k / --v)")


def _recent(preset: Optional[str], k: Optional[str], v: Optional[str], recent: Optional[int], anc) -> int:
    """R of an eval command, as KVCache(model, preset=..., k=..., v=..., recent=...) picks it; 0 with
    --anchors (the simulation runs on a cache without a ring; an explicit --recent with it is an error)."""
    from ..presets import recent_for

    if anc is not None:
        if recent:
            raise typer.BadParameter("--anchors simulates on a cache without a ring: drop --recent")
        return 0
    try:
        return recent_for(preset, k, v, recent)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _anchors(spec: Optional[str]):
    if not spec:
        return None
    from .anchors import Anchors

    try:
        return Anchors.parse(spec)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _innerq(value: Optional[str]):
    if value is None or value.lower() == "none":
        return None
    return value


def _emit(result: dict, as_json: bool, render) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        sys.stdout.flush()
        return
    from rich.console import Console

    Console().print(render(result))


def _kv_table(title: str, result: dict, keys: list[str]):
    from rich.table import Table

    t = Table(title=title)
    t.add_column("field")
    t.add_column("value", justify="right")
    for key in keys:
        if key in result:
            val = result[key]
            t.add_row(key, f"{val:.4f}" if isinstance(val, float) else str(val))
    return t


def _check_types(k: str, v: str) -> None:
    from ..codecs import CodecError, check_codec_name

    try:
        check_codec_name(k)
        check_codec_name(v)
    except CodecError as e:
        raise typer.BadParameter(str(e)) from None


def preset_overrides(model, preset: Optional[str], k: Optional[str], v: Optional[str],
                     precision: Optional[str], recent: Optional[int] = None
                     ) -> tuple[Optional[dict], Optional[dict]]:
    """(overrides, info) for an eval command, as KVCache(model, preset=...) picks them: a preset with a
    bits budget and no explicit --k / --v takes the calibrated precision table's per-layer types.
    recent: the run's ring R, which a ratio preset's budget pays for (None: the preset's own)."""
    from ..hf.precision import preset_precision

    p = None if precision is None or precision.lower() == "none" else precision
    try:
        return preset_precision(model, preset, "explicit --k / --v" if (k is not None or v is not None)
                                else None, p, recent=recent)
    except (KeyError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None


def resolve_kv(preset: Optional[str], k: Optional[str], v: Optional[str],
               innerq: Optional[str]) -> tuple[str, str, Optional[str]]:
    """(k, v, innerq) of an eval command, as `polykv demo` / `serve` resolve them: the preset (None:
    "default") gives K, V and InnerQ; an explicit --k / --v / --innerq wins ('none': no InnerQ)."""
    from ..presets import resolve

    try:
        k, v, iq = resolve(preset, k, v, innerq)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    _check_types(k, v)
    return k, v, _innerq(iq)


@app.command()
def ppl(preset: Optional[str] = typer.Option(None, "--preset", help=PRESET_HELP),
        k: Optional[str] = typer.Option(None, "--k", help=K_HELP),
        v: Optional[str] = typer.Option(None, "--v", help=V_HELP),
        ctx: int = typer.Option(2048, "--ctx", help="window length in tokens"),
        method: str = typer.Option("windows", "--method", help="windows (DESIGN §7: half prefilled, half "
                                   "scored in chunks of 64) or prefill-score (the PolyKV reference's: 70 % "
                                   "prefilled, 30 % scored in one pass; one window unless --windows)"),
        model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
        text: Optional[Path] = typer.Option(None, "--text", exists=True, dir_okay=False, help="UTF-8 text file (default: bundled Pride and Prejudice)"),
        windows: Optional[int] = typer.Option(None, "--windows", help="number of ctx windows (default: 8192 tokens' worth)"),
        innerq: Optional[str] = typer.Option(None, "--innerq", help=INNERQ_HELP),
        keep_layers_q8: int = typer.Option(0, "--keep-layers-q8", help="first/last n layers stored as q8_0"),
        precision: str = typer.Option("auto", "--precision", help=PRECISION_HELP),
        anchors: Optional[str] = typer.Option(None, "--anchors", help=ANCHORS_HELP + " (--method windows)"),
        head_types: Optional[str] = typer.Option(None, "--head-types", help=HEADS_HELP + " (--method windows)"),
        v_outliers: Optional[str] = typer.Option(None, "--v-outliers", help=OUTLIERS_HELP + " (--method windows)"),
        recent: Optional[int] = typer.Option(None, "--recent", min=0, help=RECENT_HELP),
        chunk: int = typer.Option(64, "--chunk", min=1, help="tokens per forward in the scored half "
                                  "(--method windows; 1: token by token, as decoding feeds them)"),
        skip_tokens: int = typer.Option(0, "--skip-tokens", min=0, help="start the windows after this many "
                                        "corpus tokens (--method windows)"),
        threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads"),
        device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object")):
    """Perplexity with compressed KV vs f16 KV (fields: ppl, ppl_ref, delta_pct, tokens; prefill-score
    adds kv_bytes_held, kv_bytes, kv_bytes_f16, bytes_ratio_held, bytes_ratio)."""
    k_arg, v_arg = k, v
    k, v, iq = resolve_kv(preset, k, v, innerq)
    if method not in ("windows", "prefill-score"):
        raise typer.BadParameter(f"unknown method {method!r}; valid methods: windows, prefill-score")
    from .ppl import eval_ppl, eval_prefill_score

    anc = _anchors(anchors)
    if anc is not None and method != "windows":
        raise typer.BadParameter("--anchors is measured with --method windows only")
    ht = _heads(head_types, anc)
    if ht is not None and method != "windows":
        raise typer.BadParameter("--head-types is measured with --method windows only")
    vo = _outliers(v_outliers, anc, ht)
    if vo is not None and method != "windows":
        raise typer.BadParameter("--v-outliers is measured with --method windows only")
    rec = _recent(preset, k_arg, v_arg, recent, anc)
    if (chunk != 64 or skip_tokens) and method != "windows":
        raise typer.BadParameter("--chunk / --skip-tokens apply to --method windows only")
    m, tok = _load(model, threads, device)
    run = eval_ppl if method == "windows" else eval_prefill_score
    ov, info = preset_overrides(m, preset, k_arg, v_arg, precision, None if anc is not None else rec)
    vo, ctx_vo = _outliers_ready(vo, m, tok)
    sim = anc if anc is not None else ht if ht is not None else vo
    extra = {"anchors": sim} if sim is not None else {}
    extra["recent"] = rec
    if method == "windows":
        extra.update(chunk=chunk, skip_tokens=skip_tokens)
    with ctx_vo:
        r = run(m, tok, k, v, ctx, text=text, windows=windows, innerq=iq, keep_layers_q8=keep_layers_q8,
                overrides=ov, **extra)
    r["preset"] = preset
    r["precision"] = info
    _head_fields(r, ht, m, rec)
    _outlier_fields(r, vo, m, k, v, iq, ov, rec)
    _emit(r, as_json, lambda r: _kv_table(f"ppl K {k} / V {v} @ {ctx}", r,
                                          ["ppl", "ppl_ref", "delta_pct", "tokens", "windows", "recent",
                                           "kv_bytes", "kv_bytes_f16", "bytes_ratio", "bits_per_value", "kv_bytes_held", "kv_bytes_f16",
                                           "bytes_ratio_held", "bytes_ratio", "seconds"]))


@app.command()
def equiv(preset: Optional[str] = typer.Option(None, "--preset", help=PRESET_HELP),
          k: Optional[str] = typer.Option(None, "--k", help=K_HELP),
          v: Optional[str] = typer.Option(None, "--v", help=V_HELP),
          model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
          prompts: Optional[Path] = typer.Option(None, "--prompts", exists=True, dir_okay=False, help="JSONL {context, question, needle} per line (see `polykv eval --help`)"),
          max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
          limit: Optional[int] = typer.Option(None, "--limit", help="use only the first N prompts"),
          innerq: Optional[str] = typer.Option(None, "--innerq", help=INNERQ_HELP),
          keep_layers_q8: int = typer.Option(0, "--keep-layers-q8"),
          precision: str = typer.Option("auto", "--precision", help=PRECISION_HELP),
          anchors: Optional[str] = typer.Option(None, "--anchors", help=ANCHORS_HELP),
          head_types: Optional[str] = typer.Option(None, "--head-types", help=HEADS_HELP),
          v_outliers: Optional[str] = typer.Option(None, "--v-outliers", help=OUTLIERS_HELP),
          recent: Optional[int] = typer.Option(None, "--recent", min=0, help=RECENT_HELP),
          details: bool = typer.Option(False, "--details", help="per-prompt answers and divergences (field: prompts)"),
          threads: Optional[int] = typer.Option(None, "--threads"),
          device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
          as_json: bool = typer.Option(False, "--json")):
    """Logit equivalence vs f16 KV (fields: real_frac, mean_tv, p95_tv, recall_mismatch, n, verdict)."""
    k_arg, v_arg = k, v
    k, v, iq = resolve_kv(preset, k, v, innerq)
    from .equiv import eval_equiv

    anc = _anchors(anchors)
    ht = _heads(head_types, anc)
    vo = _outliers(v_outliers, anc, ht)
    rec = _recent(preset, k_arg, v_arg, recent, anc)
    m, tok = _load(model, threads, device)
    from .common import load_prompts

    plist = load_prompts(prompts)[:limit] if limit else prompts
    ov, info = preset_overrides(m, preset, k_arg, v_arg, precision, None if anc is not None else rec)
    vo, ctx_vo = _outliers_ready(vo, m, tok)
    with ctx_vo:
        r = eval_equiv(m, tok, k, v, prompts=plist, innerq=iq, keep_layers_q8=keep_layers_q8,
                       max_new_tokens=max_new_tokens, overrides=ov,
                       anchors=anc if anc is not None else ht if ht is not None else vo,
                       details=details, recent=rec)
    r["preset"] = preset
    r["precision"] = info
    _head_fields(r, ht, m, rec)
    _outlier_fields(r, vo, m, k, v, iq, ov, rec)
    _emit(r, as_json, lambda r: _kv_table(f"equiv K {k} / V {v}", r,
                                          ["verdict", "real_frac", "mean_tv", "p95_tv", "recall_mismatch", "n",
                                           "recall", "recall_ref", "seconds"]))


@app.command()
def ruler(task: str = typer.Option("niah", "--task", help="niah, vt or codes (random-string needles)"),
          ctx: Optional[int] = typer.Option(None, "--ctx", help="prompt tokens (default 2048); codes: "
                                            "1024, 2048 or 4096 (default: all three)"),
          preset: Optional[str] = typer.Option(None, "--preset", help=PRESET_HELP),
          k: Optional[str] = typer.Option(None, "--k", help=K_HELP),
          v: Optional[str] = typer.Option(None, "--v", help=V_HELP),
          samples: Optional[int] = typer.Option(None, "--samples", help="samples (default 20); codes: the "
                                                "first S of each length (default: all 16)"),
          seed: int = typer.Option(0, "--seed", help="sample seed (codes: 0 is the bundled code_prompts.jsonl)"),
          model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
          text: Optional[Path] = typer.Option(None, "--text", exists=True, dir_okay=False, help="filler text file (default: Pride and "
                                              "Prejudice; not for codes)"),
          innerq: Optional[str] = typer.Option(None, "--innerq", help=INNERQ_HELP),
          precision: str = typer.Option("auto", "--precision", help=PRECISION_HELP),
          anchors: Optional[str] = typer.Option(None, "--anchors", help=ANCHORS_HELP),
          head_types: Optional[str] = typer.Option(None, "--head-types", help=HEADS_HELP),
          v_outliers: Optional[str] = typer.Option(None, "--v-outliers", help=OUTLIERS_HELP),
          recent: Optional[int] = typer.Option(None, "--recent", min=0, help=RECENT_HELP),
          threads: Optional[int] = typer.Option(None, "--threads"),
          device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
          details: bool = typer.Option(False, "--details", help="add every sample's answers (field: items)"),
          reference: Optional[Path] = typer.Option(None, "--reference", exists=True, dir_okay=False, help="JSON of an f16 run of the same "
                                                   "task/seed/samples with --details: reused as score_ref"),
          as_json: bool = typer.Option(False, "--json")):
    """RULER-style niah / vt / codes (fields: score, score_ref, samples; codes add by_ctx, by_kind)."""
    from .ruler import TASKS, eval_ruler, make_samples

    k_arg, v_arg = k, v
    k, v, iq = resolve_kv(preset, k, v, innerq)
    if task not in TASKS:
        raise typer.BadParameter(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if task == "codes":
        try:
            make_samples(None, task, ctx, samples, seed, text)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    ref = json.loads(reference.read_text(encoding="utf-8")) if reference is not None else None
    anc = _anchors(anchors)
    ht = _heads(head_types, anc)
    vo = _outliers(v_outliers, anc, ht)
    rec = _recent(preset, k_arg, v_arg, recent, anc)
    m, tok = _load(model, threads, device)
    ov, info = preset_overrides(m, preset, k_arg, v_arg, precision, None if anc is not None else rec)
    vo, ctx_vo = _outliers_ready(vo, m, tok)
    try:
        with ctx_vo:
            r = eval_ruler(m, tok, task, ctx, k, v, samples, seed, innerq=iq, text=text, details=details,
                           reference=ref, overrides=ov, anchors=anc if anc is not None else ht if ht is not None else vo,
                           recent=rec)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    r["preset"] = preset
    r["precision"] = info
    _head_fields(r, ht, m, rec)
    _outlier_fields(r, vo, m, k, v, iq, ov, rec)
    _emit(r, as_json, lambda r: _kv_table(f"ruler {task} @ {r['ctx']} K {k} / V {v}", r,
                                          ["score", "score_ref", "samples", "seconds"]))


@app.command()
def tiers(ctx: int = typer.Option(2048, "--ctx"),
          preset: Optional[str] = typer.Option(None, "--preset", help="named presets to run, comma-separated "
                                               "(e.g. default,balanced,max), after an f16 row; default: every "
                                               "KV type and the asymmetric pairs"),
          model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
          text: Optional[Path] = typer.Option(None, "--text", exists=True, dir_okay=False),
          prompts: Optional[Path] = typer.Option(None, "--prompts", exists=True, dir_okay=False),
          windows: Optional[int] = typer.Option(None, "--windows"),
          keep_layers_q8: int = typer.Option(0, "--keep-layers-q8"),
          no_equiv: bool = typer.Option(False, "--no-equiv", help="skip the logit-equivalence columns"),
          no_ppl: bool = typer.Option(False, "--no-ppl", help="skip the perplexity / bytes columns"),
          limit: Optional[int] = typer.Option(None, "--limit", help="use only the first N prompts"),
          max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
          precision: str = typer.Option("auto", "--precision", help="named presets: " + PRECISION_HELP),
          markdown: bool = typer.Option(False, "--markdown", help="print a Markdown table"),
          threads: Optional[int] = typer.Option(None, "--threads"),
          device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
          as_json: bool = typer.Option(False, "--json")):
    """Every KV tier and the asymmetric presets (field: rows)."""
    from .tiers import eval_tiers, named_presets, to_markdown

    try:
        rows = named_presets(preset) if preset is not None else None
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    m, tok = _load(model, threads, device)
    from .common import load_prompts

    plist = load_prompts(prompts)[:limit] if limit else prompts
    r = eval_tiers(m, tok, ctx=ctx, text=text, windows=windows, prompts=plist, presets=rows,
                   keep_layers_q8=keep_layers_q8, equiv=not no_equiv, ppl=not no_ppl,
                   max_new_tokens=max_new_tokens,
                   precision=None if precision.lower() == "none" else precision)
    if markdown and not as_json:
        sys.stdout.write(to_markdown(r) + "\n")
        return

    def render(r):
        from rich.table import Table

        ref = "—" if r["ppl_ref"] is None else f"{r['ppl_ref']:.3f}"
        t = Table(title=f"KV tiers @ {ctx} (ppl_ref {ref})")
        for c in ("K", "V", "bits/value", "KV bytes", "ppl Δ%", "mean TV", "p95 TV", "real_frac", "recall mm", "verdict"):
            t.add_column(c)
        for row in r["rows"]:
            f = lambda x, s: "—" if x is None else format(x, s)  # noqa: E731
            t.add_row(row["k"] + (" +InnerQ" if row["innerq"] else "")
                      + (f" ({row['preset']})" if row.get("preset") else ""), row["v"], f(row["bits_per_value"], ".3f"),
                      f(row["kv_bytes"], ",d"), f(row["ppl_delta_pct"], "+.2f"), f(row["mean_tv"], ".4f"),
                      f(row["p95_tv"], ".4f"), f(row["real_frac"], ".2f"), f(row["recall_mismatch"], "d"),
                      row["verdict"] or "—")
        return t

    _emit(r, as_json, render)


__all__ = ["app"]
