"""`polykv demo`: one bundled document, 8 agents asking 8 questions, answers + measured memory.

The document (polykv/data/demo_document.md) is prefilled once and compressed (K=q8_0, V=turbo3 by
default) into a SharedKVPool; the agents run batched (one forward per step for all of them), each with
its own private compressed suffix. Memory figures are measured from real tensors (DESIGN §7):

    kv_bytes_prefix      the shared compressed document (one copy)
    kv_bytes_agents      the agents' private suffix storage at its peak (allocated capacity)
    kv_bytes_shared      prefix + agents: everything polykv held for this run
    kv_bytes_naive_f16   N real f16 DynamicCaches (copy.deepcopy of the document's f16 cache, each
                         extended through the model by its agent's prompt and answer), allocated at
                         once and measured — not a multiplication
    kv_bytes_naive_f16_single  one such f16 copy of the document alone
    ratio                kv_bytes_naive_f16 / kv_bytes_shared
"""

from __future__ import annotations

import copy
import gc
import json
import re
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9.]+", " ", s.lower()).strip()


@torch.no_grad()
def _naive_copies(model, f16, doc_len: int, suffixes: list[list[int]]) -> int:
    """Allocate len(suffixes) real f16 DynamicCache copies, extend each by its tokens, measure."""
    from .cache.accounting import storage_bytes

    dev = next(model.parameters()).device
    caches = []
    for s in suffixes:
        c = copy.deepcopy(f16)
        if s:
            model(input_ids=torch.tensor([s], device=dev),
                  position_ids=torch.arange(doc_len, doc_len + len(s), device=dev)[None],
                  past_key_values=c, use_cache=True, logits_to_keep=1)
        caches.append(c)
    total = storage_bytes([t for c in caches for t in c.tensors()])
    del caches
    gc.collect()
    return total


def run_demo(model=None, tok=None, agents: int = 8, k: str | None = "q8_0", v: str | None = "turbo3",
             max_new_tokens: int = 32, document: str | None = None, questions=None, speculative=None,
             preset: str | None = None) -> dict:
    """Run the demo; returns a JSON-ready dict: agents, doc_tokens, questions, expected, answers,
    hits, kv_bytes_shared, kv_bytes_prefix, kv_bytes_agents, kv_bytes_naive_f16,
    kv_bytes_naive_f16_single, ratio, k, v, preset, recent, seconds (total) and timings; with
    `speculative` (`SharedKVPool.generate`'s argument), also `speculative` = its stats. `preset`: the
    pool's preset (types, InnerQ, recent window, calibrated table; `k` / `v` override its types, None
    keeps them); without one the pool holds exactly `k` / `v`."""
    if agents < 1:
        raise ValueError(f"agents must be >= 1, got {agents}")
    from .cache.accounting import storage_bytes
    from .pool import SharedKVPool

    t0 = time.perf_counter()
    if model is None or tok is None:
        from .hf.loading import load_model

        model, tok = load_model()
    t_load = time.perf_counter() - t0
    text = document if document is not None else (DATA / "demo_document.md").read_text(encoding="utf-8")
    qa = questions if questions is not None else json.loads((DATA / "demo_questions.json").read_text())
    qa = [qa[i % len(qa)] for i in range(agents)]
    qs = [q["question"] for q in qa]
    expected = [q.get("answer", "") for q in qa]

    pool = SharedKVPool(model, tok, k=k, v=v, preset=preset)
    t1 = time.perf_counter()
    doc, f16 = pool._add_document_with_f16(text, name="demo")
    t_prefill = time.perf_counter() - t1
    d = pool._docs[doc]
    prefix_bytes = storage_bytes(d.tensors())
    f16_single = storage_bytes(f16.tensors())

    t2 = time.perf_counter()
    answers = pool.generate(doc, qs, max_new_tokens=max_new_tokens, speculative=speculative)
    t_gen = time.perf_counter() - t2
    info = pool.last_generate
    agent_bytes = int(info["kv_bytes_agents_peak"])

    t3 = time.perf_counter()
    naive = _naive_copies(model, f16, d.length,
                          [s + a for s, a in zip(info["suffix_ids"], info["answer_ids"])])
    t_naive = time.perf_counter() - t3
    del f16
    hits = [bool(e) and _norm(e) in _norm(a) for e, a in zip(expected, answers)]
    shared = prefix_bytes + agent_bytes
    extra = {"speculative": info["speculative"]} if "speculative" in info else {}
    return dict(extra, agents=agents, doc_tokens=d.length, questions=qs, expected=expected, answers=answers,
                hits=hits, hit_count=sum(hits), kv_bytes_shared=shared, kv_bytes_prefix=prefix_bytes,
                kv_bytes_agents=agent_bytes, kv_bytes_naive_f16=naive,
                kv_bytes_naive_f16_single=f16_single, ratio=naive / shared if shared else 0.0,
                k=pool.k_type, v=pool.v_type, preset=preset, recent=pool.recent, max_new_tokens=max_new_tokens,
                seconds=time.perf_counter() - t0,
                timings=dict(load=t_load, prefill=t_prefill, generate=t_gen, naive_measure=t_naive))


def format_demo(result: dict) -> str:
    """Plain-text printout of a run_demo result."""
    mib = 2**20
    out = [f"polykv demo: {result['agents']} agents over one {result['doc_tokens']}-token document "
           f"(K={result['k']}, V={result['v']})", ""]
    for i, (q, a, e, h) in enumerate(zip(result["questions"], result["answers"], result["expected"],
                                         result["hits"])):
        out.append(f"[{i}] Q: {q}")
        out.append(f"    A: {a}")
        out.append(f"    expected: {e}  {'OK' if h else 'MISS'}")
    out += ["",
            f"answers containing the expected fact: {result['hit_count']}/{len(result['hits'])}",
            f"KV shared (prefix {result['kv_bytes_prefix'] / mib:.2f} MiB once + agents "
            f"{result['kv_bytes_agents'] / mib:.2f} MiB): {result['kv_bytes_shared'] / mib:.2f} MiB",
            f"KV naive f16 ({result['agents']} real DynamicCache copies, measured): "
            f"{result['kv_bytes_naive_f16'] / mib:.2f} MiB "
            f"(one copy {result['kv_bytes_naive_f16_single'] / mib:.2f} MiB)",
            f"ratio naive / shared: {result['ratio']:.1f}x",
            f"time {result['seconds']:.1f} s (prefill {result['timings']['prefill']:.1f} s, generate "
            f"{result['timings']['generate']:.1f} s, naive measurement {result['timings']['naive_measure']:.1f} s)"]
    return "\n".join(out)
