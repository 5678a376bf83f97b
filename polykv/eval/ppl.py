"""Perplexity under a compressed KV cache (DESIGN §7 "ppl Δ").

The corpus is tokenized once and cut into consecutive, non-overlapping windows of `ctx` tokens (the
tokenizer's BOS, when it adds one, is the first token of every window). Per window the first half is
prefilled into the cache under test; the second half is scored in chunks of 64 tokens, each chunk
attending to the compressed KV of everything before it and written compressed after it. Scored
tokens per window: ctx - ctx//2 (the prefill's last logit predicts the first scored token).
Δ% = (ppl / ppl_ref - 1) * 100 where the reference is the same procedure with f16 KV.

--text FILE: any UTF-8 text file; it must hold at least `ctx` tokens.

method "prefill-score" (`eval_prefill_score`, the PolyKV reference's own method): per window of
`ctx` tokens, the first round(0.7 * ctx) tokens are prefilled into the cache under test in one
forward; the remaining tokens are scored teacher-forced in one more forward that attends to that
compressed prefix (and, exactly, to its own tokens). Scored tokens per window: ctx - round(0.7 * ctx)
(the prefill's last logit predicts the first one). Bytes are measured on the caches right after the
prefill (the compressed prefix everything is scored against): kv_bytes_held = storage as allocated
(growth slack included), kv_bytes = the same storage compacted to its rows; kv_bytes_f16 = the f16
cache of the same prefix, compacted. Each from `untyped_storage().nbytes()` (KVCache.nbytes).
"""

from __future__ import annotations

import math
import time

import torch

from .common import is_f16_reference, load_text, make_cache, model_device
from .common import progress as _bar

CHUNK = 64
PREFIX_FRAC = 0.7  # prefill-score: share of each window prefilled (the PolyKV reference's split)


def default_windows(ctx: int) -> int:
    """8192 tokens' worth of windows (4 x 2048, 8 x 1024), at least one."""
    return max(1, 8192 // ctx)


_TOKENS: dict = {}


def tokenize(tok, text: str) -> list[int]:
    """Token ids of a corpus (no special tokens), memoized per tokenizer and text."""
    key = (id(tok), len(text), hash(text))
    if key not in _TOKENS:
        if len(_TOKENS) > 4:
            _TOKENS.clear()
        _TOKENS[key] = tok(text, add_special_tokens=False)["input_ids"]
    return _TOKENS[key]


def corpus_windows(tok, text: str, ctx: int, windows: int | None, skip_tokens: int = 0) -> list[list[int]]:
    """Consecutive windows of ctx tokens (BOS first when the tokenizer adds one)."""
    if ctx < 4:
        raise ValueError(f"ctx must be >= 4, got {ctx}")
    ids = tokenize(tok, text)
    with_special = tok("a")["input_ids"]
    bos = tok.bos_token_id if (tok.bos_token_id is not None and with_special
                               and with_special[0] == tok.bos_token_id) else None
    body = ctx - (1 if bos is not None else 0)
    ids = ids[skip_tokens:]
    avail = len(ids) // body
    if avail == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of ctx={ctx}")
    n = default_windows(ctx) if windows is None else int(windows)
    if n < 1:
        raise ValueError(f"windows must be >= 1, got {windows}")
    n = min(n, avail)
    out = []
    for w in range(n):
        chunk = ids[w * body:(w + 1) * body]
        out.append(([bos] if bos is not None else []) + chunk)
    return out


@torch.inference_mode()
def score_window(model, cache, ids: list[int], chunk: int = CHUNK) -> tuple[float, int]:
    """(sum of NLL in nats, scored tokens) for one window; the cache under test is filled as we go."""
    dev = model_device(model)
    x = torch.tensor(ids, device=dev)[None]
    n = x.shape[1]
    half = n // 2
    out = model(input_ids=x[:, :half], past_key_values=cache, use_cache=True, logits_to_keep=1)
    last = out.logits[0, -1].float()
    nll, count = 0.0, 0
    # Token t is predicted by position t-1: the prefill's last position predicts x[half]; the
    # chunks feed positions half .. n-2 (x[n-1] is scored but never needs to be fed).
    for start in range(half, n, chunk):
        stop = min(start + chunk, n)
        tgt = x[0, start:stop]
        lg = last[None]
        if stop - start > 1 or stop < n:
            feed_stop = min(stop, n - 1)
            out = model(input_ids=x[:, start:feed_stop], past_key_values=cache, use_cache=True)
            logits = out.logits[0].float()
            lg = torch.cat([last[None], logits[: stop - start - 1]], 0)
            last = logits[-1]
        lp = torch.log_softmax(lg, -1)
        nll -= float(lp.gather(1, tgt[:, None]).sum())
        count += tgt.numel()
    return nll, count


@torch.inference_mode()
def score_prefill(model, cache, ids: list[int], frac: float = PREFIX_FRAC) -> dict:
    """Prefill round(frac * n) tokens in one forward, score the rest in one forward against that
    prefix. Returns {nll (nats, summed), tokens (scored), prefix, bytes_held, bytes} (bytes: the
    cache after the prefill, as allocated / compacted)."""
    n = len(ids)
    split = round(frac * n)
    if not 1 <= split < n:
        raise ValueError(f"prefix of {split} tokens out of {n}: need 1 <= prefix < tokens")
    x = torch.tensor(ids, device=model_device(model))[None]
    out = model(input_ids=x[:, :split], past_key_values=cache, use_cache=True, logits_to_keep=1)
    held = cache.nbytes()
    cache.compact()
    compact = cache.nbytes()
    lg = out.logits[0, -1:].float()
    if split < n - 1:  # x[n-1] is scored, never fed
        out = model(input_ids=x[:, split:n - 1], past_key_values=cache, use_cache=True)
        lg = torch.cat([lg, out.logits[0].float()], 0)
    lp = torch.log_softmax(lg, -1)
    nll = -float(lp.gather(1, x[0, split:, None]).sum())
    return {"nll": nll, "tokens": n - split, "prefix": split, "bytes_held": held, "bytes": compact}


def eval_prefill_score(model, tok, k: str = "q8_0", v: str = "turbo3", ctx: int = 2048, text=None,
                       windows: int | None = 1, innerq=None, keep_layers_q8: int = 0,
                       frac: float = PREFIX_FRAC, progress: bool = True, skip_tokens: int = 0,
                       overrides=None, recent: int = 0) -> dict:
    """Perplexity by the reference's method (module docstring), K/V stored as k/v vs f16 KV.
    windows: consecutive ctx-token windows (default one: the first ctx tokens of the text).
    Returns {ppl, ppl_ref, delta_pct, tokens, kv_bytes_held, kv_bytes, kv_bytes_f16, bytes_ratio_held,
    bytes_ratio, ...}; bytes are summed over windows. overrides: {layer: (k, v)} for the test cache;
    recent: R, its recent window (`KVCache(..., recent=R)`)."""
    t0 = time.time()
    wins = corpus_windows(tok, load_text(text), ctx, 1 if windows is None else windows, skip_tokens)
    runs = {}
    for key, (kk, vv, iq, keep, ov, rr) in {"test": (k, v, innerq, keep_layers_q8, overrides, recent),
                                            "ref": ("f16", "f16", None, 0, None, 0)}.items():
        tot = {"nll": 0.0, "tokens": 0, "prefix": 0, "bytes_held": 0, "bytes": 0}
        for ids in _bar(wins, desc=f"prefill-score {kk}/{vv} ctx={ctx}", enabled=progress):
            cache = make_cache(model, kk, vv, innerq=iq, keep_layers_q8=keep, overrides=ov, recent=rr)
            r = score_prefill(model, cache, ids, frac)
            for f in tot:
                tot[f] += r[f]
            if key == "test":
                report = cache.memory_report()
            del cache
        runs[key] = tot
    t, ref = runs["test"], runs["ref"]
    ppl, ppl_ref = math.exp(t["nll"] / t["tokens"]), math.exp(ref["nll"] / ref["tokens"])
    return {
        "ppl": ppl, "ppl_ref": ppl_ref, "delta_pct": (ppl / ppl_ref - 1.0) * 100.0, "tokens": t["tokens"],
        "method": "prefill-score", "k": k, "v": v, "ctx": ctx, "windows": len(wins), "prefix_tokens": t["prefix"],
        "prefix_frac": frac, "innerq": bool(report["innerq"]), "keep_layers_q8": keep_layers_q8,
        "overrides": len(overrides or {}), "bits_per_value": report["bits_per_value"],
        "kv_bytes_held": t["bytes_held"], "kv_bytes": t["bytes"], "kv_bytes_f16": ref["bytes"],
        "kv_bytes_f16_held": ref["bytes_held"], "bytes_ratio_held": ref["bytes"] / t["bytes_held"],
        "bytes_ratio": ref["bytes"] / t["bytes"], "seconds": round(time.time() - t0, 1),
        **({"recent": recent} if recent else {}),
    }


def _run(model, tok, wins, k, v, innerq, keep_layers_q8, show, desc, overrides=None, anchors=None,
         chunk: int = CHUNK, recent: int = 0):
    nll, count, report = 0.0, 0, None
    for ids in _bar(wins, desc=desc, enabled=show):
        cache = make_cache(model, k, v, innerq=innerq, keep_layers_q8=keep_layers_q8, overrides=overrides,
                           anchors=anchors, recent=recent)
        a, b = score_window(model, cache, ids, chunk)
        nll += a
        count += b
        cache.compact()
        report = cache.memory_report()
        if anchors is not None:
            from .anchors import Anchors, anchored_bits

            report["anchors"] = {**anchors.as_dict(),
                                 **(anchored_bits(cache) if isinstance(anchors, Anchors) else {})}
        del cache
    return nll, count, report


def eval_ppl(model, tok, k: str = "q8_0", v: str = "turbo3", ctx: int = 2048, text=None,
             windows: int | None = None, innerq=None, keep_layers_q8: int = 0, progress: bool = True,
             ppl_ref: float | None = None, skip_tokens: int = 0, overrides=None, anchors=None,
             chunk: int = CHUNK, recent: int = 0) -> dict:
    """Perplexity with K/V stored as k/v vs the f16 reference (DESIGN §7).

    text: file path or literal text (None: bundled Pride and Prejudice); windows: number of ctx
    windows (None: 8192 tokens' worth); ppl_ref: reuse a reference perplexity computed on the same
    windows; skip_tokens: start the windows after this many corpus tokens; overrides: {layer: (k, v)}
    per-layer types of the cache under test (a preset's calibrated precision policy); anchors:
    `polykv.eval.anchors.Anchors` simulated on the cache under test (adds the field "anchors":
    the spec and the bits/value stored / with the anchors held at their precision, last window);
    chunk: tokens fed per forward in the scored half (1: token by token, as decoding feeds them;
    the reference uses the same; adds the field "chunk" when not the default 64); recent: R, the
    recent window as storage on the cache under test (`KVCache(..., recent=R)`; field "recent").
    Bytes (last window, compacted, each from the caches' tensors): kv_bytes, and when the f16 reference
    runs here (no ppl_ref), kv_bytes_f16 and bytes_ratio = kv_bytes_f16 / kv_bytes.
    Returns {ppl, ppl_ref, delta_pct, tokens, ...} (tokens = scored tokens)."""
    t0 = time.time()
    wins = corpus_windows(tok, load_text(text), ctx, windows, skip_tokens)
    nll, count, report = _run(model, tok, wins, k, v, innerq, keep_layers_q8, progress,
                              f"ppl {k}/{v} ctx={ctx}", overrides, anchors, chunk, recent)
    ppl = math.exp(nll / count)
    f16_bytes = None
    if ppl_ref is None:
        if is_f16_reference(k, v, keep_layers_q8, overrides, anchors, recent):
            ppl_ref, f16_bytes = ppl, report["kv_bytes"]
        else:
            rn, rc, rep = _run(model, tok, wins, "f16", "f16", None, 0, progress, f"ppl f16 ctx={ctx}",
                               chunk=chunk)
            ppl_ref, f16_bytes = math.exp(rn / rc), rep["kv_bytes"]
    return {
        "ppl": ppl, "ppl_ref": ppl_ref, "delta_pct": (ppl / ppl_ref - 1.0) * 100.0, "tokens": count,
        "k": k, "v": v, "ctx": ctx, "windows": len(wins), "innerq": bool(report and report["innerq"]),
        "keep_layers_q8": keep_layers_q8, "overrides": len(overrides or {}),
        "kv_bytes": report["kv_bytes"] if report else None,
        "bits_per_value": report["bits_per_value"] if report else None,
        "seconds": round(time.time() - t0, 1),
        **({"anchors": report["anchors"]} if anchors is not None and report else {}),
        **({"chunk": chunk} if chunk != CHUNK else {}),
        **({"recent": recent} if recent else {}),
        **({"kv_bytes_f16": f16_bytes, "bytes_ratio": f16_bytes / report["kv_bytes"]}
           if f16_bytes and report and report["kv_bytes"] else {}),
    }


__all__ = ["CHUNK", "PREFIX_FRAC", "corpus_windows", "default_windows", "eval_ppl", "eval_prefill_score",
           "score_prefill", "score_window"]
