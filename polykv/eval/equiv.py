"""Logit equivalence of a compressed KV cache against f16 KV (DESIGN §7).

Prompts file (--prompts FILE): JSON Lines, one object per line with three string fields

    {"context": "<long text that hides the needle>", "question": "<what to ask>", "needle": "<answer string>"}

e.g. {"context": "... The secret code for the Ashford vault is 3379470. ...",
      "question": "What is the secret code for the Ashford vault?", "needle": "3379470"}

Blank lines are ignored. The prompt is the model's chat template with one user message
"<context>\\n\\n<question>" (generation prompt added) when the tokenizer has a chat template
(SmolLM2-Instruct), else the plain completion "<context>\\n\\nQuestion: <question>\\nAnswer:".

Per prompt: the reference answer is greedy decoding with f16 KV (up to max_new_tokens, stopping at
EOS); it is teacher-forced through both runs (token by token, so every answer position attends to
the compressed KV of everything before it), and TV_t = 1/2 sum |p_t - q_t| over the full vocabulary
at every answer position. mean_tv and p95_tv are over all positions of all prompts. A *real*
divergence is a position inside the answer span (the reference answer up to and including its first
EOS or the token that ends its first line, whichever comes first: the recalled fact, not a chat
model's elaboration after it nor a base model's run-on) where the top-1 tokens differ and the
reference top-1/top-2 probability margin is >= 0.1;
real_frac = prompts with a real divergence / prompts. recall_mismatch = prompts where exactly one
run's free-running greedy answer contains the needle. PASS: real_frac <= 0.15, recall_mismatch = 0,
p95_tv < 0.30.
"""

from __future__ import annotations

import copy
import time

import torch

from ..generation import stop_token_ids
from .common import decode_steps, format_prompt, load_prompts, make_cache, prefill
from .common import progress as _bar

FORMAT_HELP = """\
--prompts FILE is JSON Lines: one object per line with string fields
  context   the long text that hides the needle
  question  what to ask about it
  needle    the exact string a correct answer contains (e.g. a 7-digit number)
Example line:
  {"context": "... The secret code for the Ashford vault is 3379470. ...", "question": "What is the secret code for the Ashford vault?", "needle": "3379470"}
Blank lines are ignored. With a chat template (SmolLM2-Instruct) the prompt is one user message
"<context>\\n\\n<question>"; without one (Gemma-3 base) it is "<context>\\n\\nQuestion: <question>\\nAnswer:".
--text FILE (ppl) is any UTF-8 text with at least --ctx tokens."""

MARGIN = 0.1
PASS_REAL_FRAC = 0.15
PASS_P95_TV = 0.30
DEFAULT_MAX_NEW = 24


def verdict_of(real_frac: float, recall_mismatch: int, p95_tv: float) -> str:
    ok = real_frac <= PASS_REAL_FRAC and recall_mismatch == 0 and p95_tv < PASS_P95_TV
    return "PASS" if ok else "FAIL"


def answer_span(tok, toks: list[int], stop: set[int]) -> int:
    """Number of answer positions: up to and including the first EOS or the token that ends the
    answer's first line, whichever comes first (the first line holds the recalled fact; lines after
    it, a chat model's elaboration or a base model's run-on, are not the answer)."""
    for i, t in enumerate(toks):
        if t in stop:
            return i + 1
        text = tok.decode(toks[: i + 1], skip_special_tokens=True).lstrip()
        if "\n" in text:
            return i + 1
    return len(toks)


@torch.inference_mode()
def reference_runs(model, tok, prompts=None, max_new_tokens: int = DEFAULT_MAX_NEW,
                   progress: bool = True) -> list[dict]:
    """Greedy f16-KV answers with their per-step distributions (reusable across cache types)."""
    rows = load_prompts(prompts)
    stop = stop_token_ids(tok, model)
    refs = []
    for r in _bar(rows, desc="equiv f16 reference", enabled=progress):
        ids = format_prompt(tok, r["context"], r["question"])
        cache = make_cache(model, "f16", "f16")
        first = prefill(model, cache, ids)
        toks, probs = decode_steps(model, cache, first, max_new_tokens, stop, keep_probs=True)
        answer = tok.decode(toks, skip_special_tokens=True)
        refs.append({"ids": ids, "tokens": toks, "probs": probs, "answer": answer,
                     "needle": r["needle"], "hit": r["needle"] in answer,
                     "span": answer_span(tok, toks, stop)})
        del cache
    return refs


@torch.inference_mode()
def eval_equiv(model, tok, k: str = "q8_0", v: str = "turbo3", prompts=None, innerq=None,
               keep_layers_q8: int = 0, max_new_tokens: int = DEFAULT_MAX_NEW, progress: bool = True,
               refs: list[dict] | None = None, details: bool = False, overrides=None, anchors=None,
               recent: int = 0) -> dict:
    """Logit equivalence of K/V stored as k/v against f16 KV over needle prompts (DESIGN §7).

    prompts: JSONL path / list of {context, question, needle} / None (bundled needle_prompts.jsonl).
    refs: precomputed `reference_runs(...)` (same prompts) to skip the f16 runs.
    overrides: {layer: (k, v)} per-layer types (a preset's calibrated precision policy).
    anchors: `polykv.eval.anchors.Anchors` simulated on the cache under test (field "anchors").
    recent: R, the recent window as storage on the cache under test (field "recent").
    Returns {real_frac, mean_tv, p95_tv, recall_mismatch, n, verdict, ...}."""
    t0 = time.time()
    if refs is None:
        refs = reference_runs(model, tok, prompts, max_new_tokens, progress)
    stop = stop_token_ids(tok, model)
    tvs, n_real, mismatch, hits, per = [], 0, 0, 0, []
    for ref in _bar(refs, desc=f"equiv {k}/{v}", enabled=progress):
        cache = make_cache(model, k, v, innerq=innerq, keep_layers_q8=keep_layers_q8, overrides=overrides,
                           anchors=anchors, recent=recent)
        first = prefill(model, cache, ref["ids"])
        forced_cache = copy.deepcopy(cache)
        # free-running greedy answer (recall)
        toks, _ = decode_steps(model, cache, first, max_new_tokens, stop)
        answer = tok.decode(toks, skip_special_tokens=True)
        hit = ref["needle"] in answer
        hits += hit
        mismatch += hit != ref["hit"]
        # teacher-forced reference answer (TV, divergences)
        _, q = decode_steps(model, forced_cache, first, 0, stop, force=ref["tokens"], keep_probs=True)
        p = ref["probs"]
        tv = 0.5 * (p - q).abs().sum(-1)
        tvs.append(tv)
        top2 = p.topk(2, dim=-1)
        margin = top2.values[:, 0] - top2.values[:, 1]
        differs = top2.indices[:, 0] != q.argmax(-1)
        span = ref.get("span", len(ref["tokens"]))
        real = bool((differs & (margin >= MARGIN))[:span].any())
        n_real += real
        if details:
            per.append({"answer_ref": ref["answer"], "answer": answer, "hit_ref": ref["hit"], "hit": hit,
                        "real_divergence": real, "max_tv": float(tv.max())})
        del cache, forced_cache
    all_tv = torch.cat(tvs).double()
    n = len(refs)
    real_frac = n_real / n
    p95 = float(torch.quantile(all_tv, 0.95))
    out = {
        "real_frac": real_frac, "mean_tv": float(all_tv.mean()), "p95_tv": p95,
        "recall_mismatch": mismatch, "n": n, "verdict": verdict_of(real_frac, mismatch, p95),
        "k": k, "v": v, "recall": hits, "recall_ref": sum(r["hit"] for r in refs),
        "positions": int(all_tv.numel()), "seconds": round(time.time() - t0, 1),
    }
    if anchors is not None:
        out["anchors"] = anchors.as_dict()
    if recent:
        out["recent"] = recent
    if details:
        out["prompts"] = per
    return out


__all__ = ["FORMAT_HELP", "eval_equiv", "reference_runs", "verdict_of"]
