"""Host time per batch step of `SharedKVPool.generate`, plain vs speculative, with the model's time
taken out: what the Python loop around the forward costs (drafting, the width planner, recording,
rollback, page bookkeeping, the per-agent lists of the captured step).

    python -m polykv.bench.spec_host [--agents 8,32] [--tokens 64] [--repeats 3] [--json FILE]

The model is a stand-in whose forward costs ~nothing: a random next-token table (`_TableLM`,
vocabulary 512) whose greedy continuation of any token is fixed, over a document that follows the
table except where a token was replaced at random (p = 0.35). Agents' prompts are pieces of the
document, so prompt lookup drafts from it and the table accepts a draft until the next replaced
token (acceptance ~0.6, as a model that quotes would). The document is prefilled by a tiny random
Llama (the pool needs real KV); the decode loop then runs the table. Steps go through
`DecodeGraphs` with capture=False (the path a CUDA graph replays on the GPU, run eagerly here), so
the host work measured is the GPU loop's host work.

Per (agents, side): one untimed warm-up call (builds the static steps), then `repeats` timed
calls; host_ms_per_step = (wall seconds - seconds inside the model's forward) / batch steps, the
median over repeats. Plain and speculative sides run alternately in the same process.
parts_ms_per_step splits it: "step" (AgentBatch.step_tokens / step_verify / step_tokens_ahead and
the pipelined loop's PendingTokens.result, minus the model), "record" (Speculator.record: contexts,
acceptance, the outputs tree's log), "draft" (Speculator.propose_all: drafters — the outputs tree's
adds included — and the width planner), "loop": the rest, the generate loop itself (each part the
median over repeats, so they need not add up to the host figure exactly).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

VOCAB = 512


class _Tok:
    pad_token_id, eos_token_id, chat_template = 0, 1, None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)

    def get_vocab(self):
        return {}


class _TableLM(torch.nn.Module):
    """logits[t] = one-hot of nxt[t]: greedy decoding follows the table. Counts its own seconds."""

    def __init__(self, nxt: list[int], config, generation_config):
        super().__init__()
        table = torch.full((VOCAB, VOCAB), -10.0)
        table[torch.arange(VOCAB), torch.tensor(nxt)] = 10.0
        self.register_buffer("table", table)
        self.config, self.generation_config = config, generation_config
        self.seconds = 0.0

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache=True, logits_to_keep=1, **kw):
        t = time.perf_counter()
        logits = self.table[input_ids[:, -max(1, int(logits_to_keep)):]]
        self.seconds += time.perf_counter() - t
        return SimpleNamespace(logits=logits)


def _setup(doc_tokens: int = 1800, replace: float = 0.35, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..pool import SharedKVPool

    rng = random.Random(seed)
    ids = list(range(3, VOCAB))
    nxt = list(range(VOCAB))
    perm = ids[:]
    rng.shuffle(perm)
    for a, b in zip(ids, perm):
        nxt[a] = b
    nxt[0] = nxt[1] = nxt[2] = 3
    doc, t = [], 3
    for _ in range(doc_tokens):
        t = nxt[t] if rng.random() > replace else rng.choice(ids)
        doc.append(t)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      eos_token_id=1, pad_token_id=0, bos_token_id=2)
    llama = LlamaForCausalLM(cfg).eval()
    pool = SharedKVPool(llama, _Tok(), k="q8_0", v="turbo3")
    did = pool.add_document(doc)
    lm = _TableLM(nxt, llama.config, llama.generation_config)
    pool.model = lm
    prompts = [doc[(97 * i) % (doc_tokens - 16):][:12] for i in range(64)]
    return pool, did, lm, prompts


@contextlib.contextmanager
def _static_steps():
    """Batches build `DecodeGraphs` steps (capture=False) on the CPU: the GPU loop's host path."""
    import functools

    from ..pool import decode_graph

    saved = decode_graph.graphs_supported, decode_graph.DecodeGraphs
    decode_graph.graphs_supported = lambda cache: True
    decode_graph.DecodeGraphs = functools.partial(saved[1], capture=False)
    try:
        yield
    finally:
        decode_graph.graphs_supported, decode_graph.DecodeGraphs = saved


_PARTS = (("step", "polykv.pool.agents", "AgentBatch", ("step_tokens", "step_verify", "step_tokens_ahead")),
          ("step", "polykv.pool.agents", "PendingTokens", ("result",)),  # the pipelined plain loop's read
          ("record", "polykv.spec.speculator", "Speculator", ("record",)),
          ("draft", "polykv.spec.speculator", "Speculator", ("propose_all",)))


@contextlib.contextmanager
def _timed_parts(acc: dict):
    """Seconds inside the batch step (model included), the speculator's record and its drafting
    (propose_all: drafters and the width planner), summed into acc[part]."""
    import importlib

    saved = []
    for part, mod, cls, names in _PARTS:
        klass = getattr(importlib.import_module(mod), cls, None)
        for name in names:
            fn = getattr(klass, name, None)
            if fn is None:  # a tree before the pipelined plain loop
                continue

            def wrap(*a, _fn=fn, _part=part, **kw):
                t = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    acc[_part] = acc.get(_part, 0.0) + time.perf_counter() - t

            saved.append((klass, name, fn))
            setattr(klass, name, wrap)
    try:
        yield
    finally:
        for klass, name, fn in saved:
            setattr(klass, name, fn)


_NAMES = ("step", "record", "draft", "loop")


def _part(p: str, wall: float, model: float, info: dict) -> float:
    """Host seconds of part p in one call; "loop": the host time outside the other three."""
    parts = info["parts"]
    if p == "loop":
        return wall - model - sum(parts.values())
    return parts.get(p, 0.0) - (model if p == "step" else 0.0)


def measure(agents=(8, 32), tokens: int = 64, repeats: int = 3,
            methods=("prompt_lookup", "suffix_tree")) -> dict:
    torch.set_num_threads(1)
    pool, doc, lm, prompts = _setup()
    sides = [("plain", None)] + [(m, {"method": m, "num_draft_tokens": 4}) for m in methods]
    rows = []
    with torch.no_grad(), _static_steps():
        for n in agents:
            ps = [list(p) for p in prompts[:n]]
            res = {name: [] for name, _ in sides}
            for r in range(repeats + 1):  # round 0: warm-up (static steps built)
                for name, spec in sides:
                    pool._docs[doc].outputs = None
                    lm.seconds = 0.0
                    parts: dict = {}
                    with _timed_parts(parts):
                        t = time.perf_counter()
                        pool.generate(doc, ps, max_new_tokens=tokens, speculative=spec)
                        wall = time.perf_counter() - t
                    info = dict(pool.last_generate, parts=parts)
                    if r:
                        res[name].append((wall, lm.seconds, info))
            for name, _ in sides:
                runs = res[name]
                info = runs[-1][2]
                steps = info["steps"]
                st = info.get("speculative", {})
                rows.append(dict(agents=n, side=name, steps=steps, new_tokens=sum(info["new_tokens"]),
                                 host_ms_per_step=statistics.median((w - m) / steps for w, m, _ in runs) * 1e3,
                                 model_ms_per_step=statistics.median(m / steps for _, m, _ in runs) * 1e3,
                                 ms_per_token=statistics.median((w - m) / sum(i["new_tokens"]) for w, m, i in runs) * 1e3,
                                 parts_ms_per_step={p: statistics.median(_part(p, w, m, i) / steps for w, m, i in runs) * 1e3
                                                    for p in _NAMES},
                                 tokens_per_step=round(st.get("tokens_per_step", 1.0), 3),
                                 acceptance=round(st.get("acceptance", 0.0), 3),
                                 graph_captures=sum(i["graph_captures"] for _, _, i in runs)))
    return dict(rows=rows, tokens=tokens, repeats=repeats, torch_threads=torch.get_num_threads(),
                date=time.strftime("%Y-%m-%d"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = measure(tuple(int(x) for x in a.agents.split(",")), a.tokens, a.repeats)
    for r in out["rows"]:
        print(f"agents {r['agents']:3d} {r['side']:13s} host {r['host_ms_per_step']:6.2f} ms/step "
              f"(model {r['model_ms_per_step']:.2f}), {r['steps']:3d} steps, {r['tokens_per_step']:.2f} tok/verify, "
              f"acc {r['acceptance']:.2f}, host {r['ms_per_token']:.3f} ms/token, captures {r['graph_captures']}; "
              + ", ".join(f"{p} {v:.2f}" for p, v in r["parts_ms_per_step"].items()),
              file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
