"""Probe (GPU): the pool's recent windows (issue K, `SharedKVPool(recent=R)`) in captured decode steps —
the check that let `graphs_supported` capture batches with windows (session 12). Random-initialised
Llama-3-8B-shape model, 4 layers, bf16, a 32k-token document, K q8_0 / V turbo3, R = 8, 32 agents:
eager vs captured logits over 5 steps fed the same tokens (`window_step.eager_vs_graph`: argmax
flips with their top-2 margins), then the step time of both (median of 8 steps after 2 warm-ups).

    PYTHONPATH=. POLYKV_CACHE_DIR=.pkvcache python3 polykv/bench/ring_graphs.py
    PYTHONPATH=. POLYKV_CACHE_DIR=.pkvcache python3 polykv/bench/ring_graphs.py --cost

--cost: what a window costs a captured step instead — the same model, document and batch with R = 0
and R = 8, alternating twice, at 8 and 32 agents (writes $OUT/ring_cost.json).
Writes $OUT/ring_graphs.json.
"""

from __future__ import annotations

import json
import os

import torch

from polykv.bench.e2e import Clock, build_model, greedy_steps, use_attention
from polykv.bench.window_step import eager_vs_graph
from polykv.pool import SharedKVPool


def main(device: str = "cuda", layers: int = 4, doc_tokens: int = 32768, agents: int = 32,
         recent: int = 8, tiny: bool = False) -> dict:
    dev = torch.device(device)
    model = build_model(layers, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, tiny=tiny)
    use_attention(model, "polykv")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (doc_tokens,), generator=g).tolist()
    sfx = torch.randint(3, model.config.vocab_size, (agents, 64), generator=g).tolist()
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", recent=recent, progress=False,
                        prefill_chunk=4096)
    doc = pool.add_document(ids)
    res: dict = {"recent": recent, "agents": agents, "flips": eager_vs_graph(pool, doc, sfx)}
    clock = Clock(dev)
    for graphs in (False, True):
        with pool.open_batch(doc, capacity=agents, seq_capacity=100, graphs=graphs) as b:
            for s in sfx:
                b.add(s)
            r = greedy_steps(clock, b)
            r.pop("step")
            tag = "graph" if graphs else "eager"
            res[tag] = r
            print(tag, {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "ring_graphs.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


def cost(device: str = "cuda", layers: int = 4, doc_tokens: int = 32768, recent: int = 8,
         agents=(8, 32)) -> dict:
    """Captured step time with R = 0 and R = recent, alternating twice per agent count (the
    spread between runs shows beside the difference)."""
    dev = torch.device(device)
    model = build_model(layers, dev, torch.bfloat16)
    use_attention(model, "polykv")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (doc_tokens,), generator=g).tolist()
    res: dict = {}
    for n in agents:
        sfx = torch.randint(3, model.config.vocab_size, (n, 64), generator=g).tolist()
        for r in (0, recent, 0, recent):
            pool = SharedKVPool(model, None, k="q8_0", v="turbo3", recent=r, progress=False,
                                prefill_chunk=4096)
            doc = pool.add_document(ids)
            with pool.open_batch(doc, capacity=n, seq_capacity=100, graphs=True) as b:
                for s in sfx:
                    b.add(s)
                row = greedy_steps(Clock(dev), b)
                row.pop("step", None)
            res.setdefault(f"{n}_R{r}", []).append(row)
            print(n, r, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}, flush=True)
            del pool
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "ring_cost.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


if __name__ == "__main__":
    import sys

    cost() if "--cost" in sys.argv[1:] else main()
