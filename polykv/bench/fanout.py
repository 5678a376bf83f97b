"""Fan-out memory benchmark: KV bytes with N agents alive over one shared document.

Three ways to serve N agents that share a `doc_tokens` document and each add `suffix_tokens` own
tokens, every figure measured from real tensors (DESIGN §7: untyped_storage().nbytes(), each storage
once) while all N agents are alive:

* naive      N real f16 DynamicCaches: copy.deepcopy of the prefilled document cache, each then
             extended by its agent's suffix through a real forward.
* ref_style  what the original PolyKV does: one compressed blob (the pool's compressed document) plus
             one dense decompressed copy per agent (stored as f16 — favourable to it; the model runs
             in float32 on CPU) extended by the agent's suffix K/V.
* shared     polykv: the compressed prefix once + N private compressed suffixes, measured from the
             pool's tensors after a real batched suffix prefill (`AgentBatch.add` + `step`, capacity
             exactly N agents x suffix_tokens rows).

Agents' suffixes are distinct stretches of real text (Pride and Prejudice, bundled) after the document.
"""

from __future__ import annotations

import copy
import gc
import time
from pathlib import Path

import torch

from ..cache.accounting import storage_bytes


def _text_ids(tok, n: int) -> list[int]:
    path = Path(__file__).resolve().parent.parent / "data" / "pride_and_prejudice.txt"
    text = path.read_text(encoding="utf-8", errors="replace")
    ids: list[int] = []
    step = 200_000
    for a in range(0, len(text), step):
        ids += tok(text[a:a + step], add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            break
    if len(ids) < n:
        raise ValueError(f"need {n} tokens of text, have {len(ids)}")
    return ids[:n]


@torch.no_grad()
def bench_fanout(model, tok, agents=(1, 2, 4, 8, 16, 32), doc_tokens: int = 2048,
                 suffix_tokens: int = 64, k: str = "q8_0", v: str = "turbo3", plot: str | None = None,
                 log=None) -> dict:
    """Returns {rows: [{agents, naive_bytes, ref_style_bytes, shared_bytes, naive_over_shared,
    ref_over_shared}], doc_tokens, suffix_tokens, k, v, f16_single_doc_bytes, compressed_doc_bytes,
    seconds}; writes a PNG (bytes vs agents, log y) to `plot` when given."""
    from ..pool import SharedKVPool
    from ..pool.prefill import F16DynamicCache

    say = log or (lambda *_: None)
    t0 = time.perf_counter()
    agents = sorted({int(a) for a in agents})
    n_max = agents[-1]
    ids = _text_ids(tok, doc_tokens + n_max * suffix_tokens)
    doc_ids = ids[:doc_tokens]
    suffixes = [ids[doc_tokens + i * suffix_tokens: doc_tokens + (i + 1) * suffix_tokens] for i in range(n_max)]
    P = doc_tokens
    dev = next(model.parameters()).device

    pool = SharedKVPool(model, tok, k=k, v=v)
    say(f"prefill {doc_tokens} tokens")
    doc, f16 = pool._add_document_with_f16(doc_ids, name="fanout")
    d = pool._docs[doc]
    doc_bytes = storage_bytes(d.tensors())
    f16_single = storage_bytes(f16.tensors())
    rows = {n: {"agents": n} for n in agents}

    # (a) naive: N real f16 copies, each extended by its suffix through the model
    say("naive copies")
    caches, suffix_kv = [], []
    for i in range(n_max):
        c = copy.deepcopy(f16)
        s = torch.tensor([suffixes[i]], device=dev)
        model(input_ids=s, position_ids=torch.arange(P, P + suffix_tokens, device=dev)[None],
              past_key_values=c, use_cache=True, logits_to_keep=1)
        caches.append(c)
        suffix_kv.append([(lay.keys[:, :, -suffix_tokens:].clone(), lay.values[:, :, -suffix_tokens:].clone())
                          for lay in c.layers])
        if i + 1 in rows:
            rows[i + 1]["naive_bytes"] = storage_bytes([t for cc in caches for t in cc.tensors()])
    del caches
    gc.collect()

    # (b) reference style: one compressed blob + a dense f16 decompressed copy per agent
    say("ref-style copies")
    dense = []
    for i in range(n_max):
        c = F16DynamicCache(config=model.config)
        for li, layer in enumerate(d.layers):
            kd, vd = layer.dense(torch.float16)
            sk, sv = suffix_kv[i][li]
            c.update(torch.cat([kd, sk], 2), torch.cat([vd, sv], 2), li)
        dense.append(c)
        if i + 1 in rows:
            rows[i + 1]["ref_style_bytes"] = storage_bytes(d.tensors() + [t for cc in dense for t in cc.tensors()])
    del dense, suffix_kv
    gc.collect()

    # (c) shared: polykv, real batched suffix prefill
    for n in agents:
        say(f"shared {n}")
        with pool.open_batch(doc, capacity=n, seq_capacity=suffix_tokens) as b:
            for i in range(n):
                b.add(suffixes[i])
            b.step()
            rows[n]["shared_bytes"] = storage_bytes(d.tensors() + b.cache.tensors())
    out_rows = []
    for n in agents:
        r = rows[n]
        r["naive_over_shared"] = r["naive_bytes"] / r["shared_bytes"]
        r["ref_over_shared"] = r["ref_style_bytes"] / r["shared_bytes"]
        out_rows.append(r)
    result = dict(rows=out_rows, doc_tokens=doc_tokens, suffix_tokens=suffix_tokens, k=k, v=v,
                  f16_single_doc_bytes=f16_single, compressed_doc_bytes=doc_bytes,
                  shared_growth=out_rows[-1]["shared_bytes"] / out_rows[0]["shared_bytes"],
                  seconds=time.perf_counter() - t0)
    if plot:
        plot_fanout(result, plot)
    return result


def plot_fanout(result: dict, path) -> None:
    """PNG: KV bytes vs agents (log y) for naive / ref-style / shared."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["agents"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for key, label, style in (("naive_bytes", "naive: N f16 DynamicCache copies", "o-"),
                              ("ref_style_bytes", "ref-style: blob + N dense f16 copies", "s-"),
                              ("shared_bytes", f"polykv shared ({result['k']}/{result['v']})", "^-")):
        ax.plot(x, [r[key] / 2**20 for r in rows], style, label=label)
    ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ticks = [a for i, a in enumerate(x) if i == len(x) - 1 or x[i + 1] / a >= 1.2]  # no overlaps
    ax.set_xticks(ticks, [str(a) for a in ticks])
    ax.set_xlabel("agents alive")
    ax.set_ylabel("KV bytes (MiB, measured)")
    ax.set_title(f"KV memory, {result['doc_tokens']}-token document + {result['suffix_tokens']}-token suffixes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def format_fanout(result: dict) -> str:
    lines = [f"doc {result['doc_tokens']} tokens, suffix {result['suffix_tokens']} tokens, "
             f"K={result['k']} V={result['v']}",
             f"{'agents':>6} {'naive MiB':>10} {'ref MiB':>10} {'shared MiB':>10} {'naive/sh':>9} {'ref/sh':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['agents']:>6} {r['naive_bytes'] / 2**20:>10.1f} {r['ref_style_bytes'] / 2**20:>10.1f} "
                     f"{r['shared_bytes'] / 2**20:>10.2f} {r['naive_over_shared']:>9.1f} {r['ref_over_shared']:>7.1f}")
    return "\n".join(lines)
