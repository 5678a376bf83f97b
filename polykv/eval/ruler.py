"""RULER-style long-context checks (DESIGN §7), seeded.

niah: one "The special magic number for <key> is: <7 digits>." sentence hidden in filler
      (Pride and Prejudice paragraphs) of about `ctx` tokens; sample i of S sits at depth
      i/(S-1) (0% .. 100% of the filler). Correct when the answer contains the 7-digit value.
vt:   variable tracking: "VAR <A> = <5 digits>." then hops "VAR <B> = <A>." ... (one chain of 5
      variables, 4 hops) scattered through the filler in order. Question: which variables are
      assigned the value. Correct (exact) when the answer names every variable of the chain.
The generation prompt is followed by a RULER-style answer prefix ("The special magic number for
<key> is:" / "... they are:"), so the model answers directly.
score = % of samples correct with the cache under test; score_ref = the same with f16 KV.
"""

from __future__ import annotations

import random
import string
import time

import torch

from .common import decode_steps, eos_ids, format_prompt, load_text, make_cache, prefill
from .common import progress as _bar

TASKS = ("niah", "vt")
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


def make_sample(tok, task: str, ctx: int, rng: random.Random, depth: float, paras: list[str]) -> dict:
    """One sample: {context, question, answers (all must appear), depth}."""
    overhead = 80  # template + question
    if task == "niah":
        key = f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}"
        value = str(rng.randrange(1_000_000, 10_000_000))
        needle = f"The special magic number for {key} is: {value}."
        body = _filler(tok, paras, rng, ctx - overhead - 20)
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
        body = _filler(tok, paras, rng, ctx - overhead - 60)
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


def make_samples(tok, task: str, ctx: int, samples: int, seed: int, text=None) -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    rng = random.Random(seed)
    paras = _paragraphs(load_text(text))
    return [make_sample(tok, task, ctx, rng, i / max(1, samples - 1), paras) for i in range(samples)]


@torch.inference_mode()
def _score(model, tok, items, k, v, innerq, keep_layers_q8, max_new, show) -> tuple[list[bool], list[str]]:
    stop = eos_ids(tok, model)
    ok, answers = [], []
    for it in _bar(items, desc=f"ruler {k}/{v}", enabled=show):
        cache = make_cache(model, k, v, innerq=innerq, keep_layers_q8=keep_layers_q8)
        first = prefill(model, cache, it["ids"])
        toks, _ = decode_steps(model, cache, first, max_new, stop)
        ans = tok.decode(toks, skip_special_tokens=True)
        answers.append(ans)
        ok.append(all(a in ans for a in it["answers"]))
        del cache
    return ok, answers


def eval_ruler(model, tok, task: str = "niah", ctx: int = 2048, k: str = "q8_0", v: str = "turbo3",
               samples: int = 20, seed: int = 0, innerq=None, keep_layers_q8: int = 0, text=None,
               progress: bool = True, max_new_tokens: int | None = None, details: bool = False) -> dict:
    """RULER-style niah / vt at about `ctx` prompt tokens; returns {score, score_ref, samples, ...}
    (scores in % of samples answered exactly, reference = f16 KV)."""
    t0 = time.time()
    items = make_samples(tok, task, ctx, samples, seed, text)
    for it in items:
        it["ids"] = format_prompt(tok, it["context"], it["question"], it["prefix"])
    max_new = max_new_tokens or (12 if task == "niah" else 30)
    ok, answers = _score(model, tok, items, k, v, innerq, keep_layers_q8, max_new, progress)
    if (k, v) == ("f16", "f16") and not keep_layers_q8:
        ok_ref, answers_ref = ok, answers
    else:
        ok_ref, answers_ref = _score(model, tok, items, "f16", "f16", None, 0, max_new, progress)
    n = len(items)
    out = {
        "score": 100.0 * sum(ok) / n, "score_ref": 100.0 * sum(ok_ref) / n, "samples": n,
        "task": task, "ctx": ctx, "k": k, "v": v, "seed": seed,
        "prompt_tokens": {"min": min(len(it["ids"]) for it in items),
                          "max": max(len(it["ids"]) for it in items)},
        "seconds": round(time.time() - t0, 1),
    }
    if details:
        out["items"] = [{"depth": it["depth"], "answers": it["answers"], "answer": a, "ok": o,
                         "answer_ref": ar, "ok_ref": orf}
                        for it, a, o, ar, orf in zip(items, answers, ok, answers_ref, ok_ref)]
    return out


__all__ = ["TASKS", "eval_ruler", "make_samples"]
