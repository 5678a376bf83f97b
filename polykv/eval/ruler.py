"""RULER-style long-context checks (DESIGN §7), seeded.

niah: one "The special magic number for <key> is: <7 digits>." sentence hidden in filler
      (Pride and Prejudice paragraphs) of about `ctx` tokens; sample i of S sits at depth
      i/(S-1) (0% .. 100% of the filler). Correct when the answer contains the 7-digit value.
vt:   variable tracking: "VAR <A> = <5 digits>." then hops "VAR <B> = <A>." ... (one chain of 5
      variables, 4 hops) scattered through the filler in order. Question: which variables are
      assigned the value. Correct (exact) when the answer names every variable of the chain.
codes: random strings (8-digit numbers, digit combinations, hyphenated passwords, hex ids, serial
      keys, mixed-case tokens, uuid prefixes, ip:port) in technical prose or the novel, 16 prompts at
      each of 1024 / 2048 / 4096 nominal tokens (polykv/data/make_codes.py; seed 0 is the bundled
      code_prompts.jsonl). --ctx picks one length (default: all three), --samples the first S of
      each. Correct when the answer holds the code exactly, as a whole string (`code_found`).
The generation prompt is followed by a RULER-style answer prefix ("The special magic number for
<key> is:" / "... they are:" / "The <thing> is"), so the model answers directly.
score = % of samples correct with the cache under test; score_ref = the same with f16 KV.
"""

from __future__ import annotations

import random
import re
import string
import time

import torch

from ..generation import stop_token_ids
from .common import decode_steps, format_prompt, is_f16_reference, load_text, make_cache, prefill
from .common import progress as _bar

TASKS = ("niah", "vt", "codes")
CODES_MAX_NEW = 32
_WORDS = ("amber", "falcon", "harbor", "meadow", "copper", "willow", "summit", "lantern", "orchid",
          "glacier", "saffron", "ember", "cobalt", "thistle", "juniper", "marble", "canyon", "velvet",
          "raven", "quartz", "pepper", "cedar", "topaz", "breeze")


def _paragraphs(text: str) -> list[str]:
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in paras if len(p) > 40]


def _filler(tok, paras: list[str], rng: random.Random, budget: int) -> list[str]:
    """Consecutive paragraphs from a random start, about `budget` tokens in all."""
    start = rng.randrange(len(paras))
    out, used, i = [], 0, start
    while used < budget:
        p = paras[i % len(paras)]
        n = len(tok(p, add_special_tokens=False)["input_ids"]) + 2
        if used + n > budget and out:
            break
        out.append(p)
        used += n
        i += 1
    return out


def _question_niah(key: str) -> str:
    return (f"What is the special magic number for {key} mentioned in the provided text? "
            "Answer with the number only.")


def _question_vt(value: str) -> str:
    return (f"Find all variables that are assigned the value {value} in the text above, directly or "
            "through other variables. Answer with the variable names only.")


_OVERHEAD = 80  # tokens of the template + question
_NEEDLE = {"niah": 20, "vt": 60}  # tokens of the needle / the variable chain
_MIN_FILLER = 32


def make_sample(tok, task: str, ctx: int, rng: random.Random, depth: float, paras: list[str]) -> dict:
    """One sample: {context, question, answers (all must appear), depth}."""
    if task == "niah":
        key = f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}"
        value = str(rng.randrange(1_000_000, 10_000_000))
        needle = f"The special magic number for {key} is: {value}."
        body = _filler(tok, paras, rng, ctx - _OVERHEAD - _NEEDLE["niah"])
        pos = round(depth * len(body))
        body.insert(pos, needle)
        return {"context": "\n\n".join(body), "question": _question_niah(key), "answers": [value],
                "depth": depth, "prefix": f"The special magic number for {key} is:"}
    if task == "vt":
        names = set()
        while len(names) < 5:
            names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
        names = list(names)
        value = str(rng.randrange(10_000, 100_000))
        stmts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, 5)]
        body = _filler(tok, paras, rng, ctx - _OVERHEAD - _NEEDLE["vt"])
        slots = sorted(rng.sample(range(len(body) + 1), k=min(5, len(body) + 1)))
        while len(slots) < 5:
            slots.append(slots[-1])
        for j, (slot, st) in enumerate(zip(slots, stmts)):
            body.insert(slot + j, st)
        return {"context": "\n\n".join(body), "question": _question_vt(value), "answers": names,
                "depth": depth,
                "prefix": ("According to the chain of variable assignments in the text above, 5 variables "
                           f"are assigned the value {value}, they are:")}
    raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")


def code_found(code: str, answer: str) -> bool:
    """The code appears in the answer exactly and whole: not inside a longer run of letters / digits
    nor continued by another hyphenated group ("12-34" is not found in "12-345" or "12-34-56")."""
    pat = r"(?<![A-Za-z0-9-])" + re.escape(code) + r"(?![A-Za-z0-9]|-[A-Za-z0-9])"
    return re.search(pat, answer) is not None


def code_samples(ctx: int | None, samples: int | None, seed: int, text=None) -> list[dict]:
    """The codes set (make_codes.make(seed)): every length, or the `ctx` one; the first `samples` of each."""
    from ..data.make_codes import CTXS, make

    if text is not None:
        raise ValueError("--text does not apply to the codes task (its filler is bundled: make_codes.py)")
    if ctx is not None and ctx not in CTXS:
        raise ValueError(f"codes: ctx must be one of {', '.join(map(str, CTXS))} (or none for all), got {ctx}")
    if samples is not None and samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    out = []
    for c in (CTXS if ctx is None else (ctx,)):
        rows = [r for r in make(seed) if r["ctx"] == c][:samples]
        out += [{"context": r["context"], "question": r["question"], "answers": [r["needle"]],
                 "depth": r["depth"], "prefix": r["prefix"], "id": r["id"], "kind": r["kind"],
                 "genre": r["genre"], "ctx": c} for r in rows]
    return out


def make_samples(tok, task: str, ctx: int | None, samples: int | None, seed: int, text=None) -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if task == "codes":
        return code_samples(ctx, samples, seed, text)
    ctx = 2048 if ctx is None else ctx
    least = _OVERHEAD + _NEEDLE[task] + _MIN_FILLER  # the template, question and needle leave room for filler
    if ctx < least:
        raise ValueError(f"{task}: ctx must be >= {least} prompt tokens, got {ctx}")
    samples = 20 if samples is None else samples
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    rng = random.Random(seed)
    paras = _paragraphs(load_text(text))
    return [make_sample(tok, task, ctx, rng, i / max(1, samples - 1), paras) for i in range(samples)]


@torch.inference_mode()
def _score(model, tok, items, k, v, innerq, keep_layers_q8, max_new, show,
           match=None, overrides=None, anchors=None, recent: int = 0) -> tuple[list[bool], list[str]]:
    stop = stop_token_ids(tok, model)
    ok, answers = [], []
    for it in _bar(items, desc=f"ruler {k}/{v}", enabled=show):
        cache = make_cache(model, k, v, innerq=innerq, keep_layers_q8=keep_layers_q8, overrides=overrides,
                           anchors=anchors, recent=recent)
        first = prefill(model, cache, it["ids"])
        toks, _ = decode_steps(model, cache, first, max_new, stop)
        ans = tok.decode(toks, skip_special_tokens=True)
        answers.append(ans)
        ok.append(all((match(a, ans) if match else a in ans) for a in it["answers"]))
        del cache
    return ok, answers


def _breakdown(items, ok, ok_ref, key) -> dict:
    out = {}
    for it, o, r in zip(items, ok, ok_ref):
        d = out.setdefault(str(it[key]), {"n": 0, "correct": 0, "correct_ref": 0})
        d["n"] += 1
        d["correct"] += o
        d["correct_ref"] += r
    for d in out.values():
        d["score"], d["score_ref"] = 100.0 * d["correct"] / d["n"], 100.0 * d["correct_ref"] / d["n"]
    return out


def eval_ruler(model, tok, task: str = "niah", ctx: int | None = 2048, k: str = "q8_0", v: str = "turbo3",
               samples: int | None = 20, seed: int = 0, innerq=None, keep_layers_q8: int = 0, text=None,
               progress: bool = True, max_new_tokens: int | None = None, details: bool = False,
               reference: dict | None = None, overrides=None, anchors=None, recent: int = 0) -> dict:
    """RULER-style niah / vt at about `ctx` prompt tokens, or the codes set; returns {score,
    score_ref, samples, ...} (scores in % of samples answered exactly, reference = f16 KV).
    ctx / samples None: 2048 / 20 for niah and vt, every length / every prompt for codes.
    reference: the details=True result of an f16 run on the same samples (skips the f16 runs).
    codes add by_ctx and by_kind: {key: {n, correct, correct_ref, score, score_ref}}.
    overrides: {layer: (k, v)} per-layer types (a preset's calibrated precision policy).
    anchors: `polykv.eval.anchors.Anchors` simulated on the cache under test (field "anchors").
    recent: R, the recent window as storage on the cache under test (field "recent")."""
    t0 = time.time()
    items = make_samples(tok, task, ctx, samples, seed, text)
    for it in items:
        it["ids"] = format_prompt(tok, it["context"], it["question"], it["prefix"])
    max_new = max_new_tokens or {"niah": 12, "vt": 30, "codes": CODES_MAX_NEW}[task]
    match = code_found if task == "codes" else None
    ok, answers = _score(model, tok, items, k, v, innerq, keep_layers_q8, max_new, progress, match, overrides,
                         anchors, recent)
    if reference is not None:
        ref_items = reference.get("items") or []
        if (reference.get("task"), reference.get("seed"), len(ref_items)) != (task, seed, len(items)) or any(
                r["answers"] != it["answers"] for r, it in zip(ref_items, items)):
            raise ValueError("reference: not a details=True result on the same task, seed and samples")
        ok_ref, answers_ref = [r["ok"] for r in ref_items], [r["answer"] for r in ref_items]
    elif is_f16_reference(k, v, keep_layers_q8, overrides, anchors, recent):
        ok_ref, answers_ref = ok, answers
    else:
        ok_ref, answers_ref = _score(model, tok, items, "f16", "f16", None, 0, max_new, progress, match)
    n = len(items)
    out = {
        "score": 100.0 * sum(ok) / n, "score_ref": 100.0 * sum(ok_ref) / n, "samples": n,
        "task": task, "ctx": ctx if task != "codes" else sorted({it["ctx"] for it in items}),
        "k": k, "v": v, "seed": seed,
        "prompt_tokens": {"min": min(len(it["ids"]) for it in items),
                          "max": max(len(it["ids"]) for it in items)},
        "seconds": round(time.time() - t0, 1),
    }
    if anchors is not None:
        out["anchors"] = anchors.as_dict()
    if recent:
        out["recent"] = recent
    if task == "codes":
        out["by_ctx"] = _breakdown(items, ok, ok_ref, "ctx")
        for key, d in out["by_ctx"].items():
            lens = [len(it["ids"]) for it in items if str(it["ctx"]) == key]
            d["prompt_tokens"] = {"min": min(lens), "max": max(lens)}
        out["by_kind"] = _breakdown(items, ok, ok_ref, "kind")
    if details:
        out["items"] = [{"id": it.get("id"), "depth": it["depth"], "answers": it["answers"], "answer": a,
                         "ok": o, "answer_ref": ar, "ok_ref": orf, "prompt_tokens": len(it["ids"])}
                        for it, a, o, ar, orf in zip(items, answers, ok, answers_ref, ok_ref)]
    return out


__all__ = ["TASKS", "code_found", "code_samples", "eval_ruler", "make_samples"]
