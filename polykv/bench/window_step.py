"""Probe (GPU): the pool's decode step on a model with sliding-window layers — Gemma-3-1B's attention
shape (4 q heads / 1 KV head, head_dim 256, window 512, five sliding layers per full one), 6 layers,
random weights, bf16, a 32k-token document, K q8_0 / V turbo3 — with the sliding layers on the
kernels' windowed cascade (issue G) against the torch reference that served them before, in one
run: eager and captured steps at 8 and 32 agents, median of 8 steps after 2 warm-ups.

    PYTHONPATH=. POLYKV_CACHE_DIR=.pkvcache python3 polykv/bench/window_step.py [--recent 8]

--recent R: the pools hold recent windows of R rows (what `preset=` pools hold): a sliding layer's
window then joins its windowed cascade as a third pass (kernels route) or the reference's merge.

Writes $OUT/window_step.json (or ./window_step.json): {tag: {ms, ms_gpu, ...}}, the greedy
tokens' agreement between the two routes, and eager vs captured logits at 32 agents
(`eager_vs_graph`: argmax flips and their margins).
"""

from __future__ import annotations

import json
import os

import torch

from polykv.bench.e2e import Clock, greedy_steps, use_attention
from polykv.pool import SharedKVPool
from polykv.pool import agent_cache

DOC_TOKENS, SUFFIX_TOKENS, LAYERS = 32768, 64, 6


def build_gemma(device, dtype=torch.bfloat16):
    """Gemma-3-1B attention and MLP shapes, LAYERS layers (the last one full attention)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=32768, hidden_size=1152, intermediate_size=6912,
                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=256, sliding_window=512,
                           layer_types=["sliding_attention"] * (LAYERS - 1) + ["full_attention"],
                           max_position_embeddings=65536)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _reference_for_windows(orig):
    """agent_cache's cascade entry with sliding-window calls sent to the torch reference (the route
    before the windowed kernels)."""
    def call(*a, window=None, **k):
        if window is not None:
            k["backend"] = "reference"
        return orig(*a, window=window, **k)
    return call


def eager_vs_graph(pool, doc: str, sfx: list, steps: int = 5) -> list:
    """Eager and captured steps of the same batch (kernels route), fed the eager run's greedy
    tokens: per step the largest logit difference and every agent whose argmax differs, with the
    eager logits' top-2 margin (a near-tie flips on rounding; a wide margin is a bug)."""
    runs = {}
    for graphs in (False, True):
        with pool.open_batch(doc, capacity=len(sfx), seq_capacity=100, graphs=graphs) as b:
            aids = [b.add(s) for s in sfx]
            logits = b.step()
            runs[graphs] = []
            for i in range(steps):
                logits = {a: lg.float().clone() for a, lg in logits.items()}
                runs[graphs].append(logits)
                feed = runs[False][i]  # both runs follow the eager run's tokens
                b.feed({a: int(torch.argmax(feed[a])) for a in aids})
                logits = b.step()
    rows = []
    for i, (e, c) in enumerate(zip(runs[False], runs[True])):
        flips = []
        for a in e:
            if int(e[a].argmax()) != int(c[a].argmax()):
                top = e[a].topk(2).values
                flips.append((a, float(top[0] - top[1])))
        diff = max(float((e[a] - c[a]).abs().max()) for a in e)
        rows.append(dict(step=i, max_logit_diff=diff, flips=flips))
        print(f"eager vs graph, step {i}: max |logit diff| {diff:.4g}, argmax flips (agent, margin) "
              f"{flips}", flush=True)
    return rows


def main(device: str = "cuda", recent: int = 0) -> dict:
    dev = torch.device(device)
    clock = Clock(dev)
    model = build_gemma(dev)
    use_attention(model, "polykv")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (DOC_TOKENS,), generator=g).tolist()
    sfx = torch.randint(3, model.config.vocab_size, (32, SUFFIX_TOKENS), generator=g).tolist()
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False, prefill_chunk=4096,
                        recent=recent)
    res: dict = {"recent": recent}
    doc = pool.add_document(ids)
    orig = agent_cache.cascade_attention

    def run(tag: str, n: int, graphs: bool) -> None:
        with pool.open_batch(doc, capacity=n, seq_capacity=100, graphs=graphs) as b:
            for s in sfx[:n]:
                b.add(s)
            r = greedy_steps(clock, b)
            r.pop("step")
            res[tag] = r
            print(tag, {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}, flush=True)

    for n in (8, 32):
        for graphs in (False, True):
            mode = "graph" if graphs else "eager"
            run(f"kernels_{mode}_{n}", n, graphs)
            agent_cache.cascade_attention = _reference_for_windows(orig)
            try:
                run(f"reference_{mode}_{n}", n, graphs)
            finally:
                agent_cache.cascade_attention = orig
            a, b = res[f"kernels_{mode}_{n}"]["toks"], res[f"reference_{mode}_{n}"]["toks"]
            same = sum(x == y for x, y in zip(a, b))
            res[f"same_steps_{mode}_{n}"] = [same, len(a)]
            print(f"{mode} {n} agents: kernels {res[f'kernels_{mode}_{n}']['ms']:.3f} ms, reference "
                  f"{res[f'reference_{mode}_{n}']['ms']:.3f} ms, same greedy tokens in {same}/{len(a)} steps",
                  flush=True)
    res["flips_32"] = eager_vs_graph(pool, doc, sfx)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "window_step.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recent", type=int, default=0)
    main(recent=ap.parse_args().recent)
