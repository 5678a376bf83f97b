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

    python -m polykv.bench.spec_host --baseline REF [--agents 8,32] [--rounds 20] [--json FILE]

`--baseline`: before / after in one process (a noisy shared machine moves separate runs by up to
2x). `polykv/spec/*.py` at git REF is imported beside the working tree's as its own package, and
each round runs plain, then every method with both trees, in a shuffled order (the pool's
`polykv.spec` classes swapped per call; the n-gram index one per tree, the outputs tree rebuilt
every call, the step times shared as in a plain run), adaptive and with a fixed cost_per_draft 0.1
(both trees then take the same widths: the same batch steps). Only `polykv/spec` differs between
the sides. Every call's answers must equal plain's (greedy is lossless). Medians over the rounds:
host ms per step, x plain (each call over the same round's plain call) and, for the working tree,
after / before of the same round (host per step; the draft part per step).
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

    def get_input_embeddings(self):  # the model interface the pool reads (no weights here)
        return None

    def get_output_embeddings(self):
        return None

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

    class Timed(saved[1]):  # each static step's seconds into _STATIC[0]["static"] (a CUDA graph on the GPU)
        def _capture(self, B, n_q, keep=0, wide=None):
            cap = super()._capture(B, n_q, keep, wide)
            fn = cap.fn

            def timed():
                t = time.perf_counter()
                try:
                    return fn()
                finally:
                    acc = _STATIC[0]
                    if acc is not None:
                        acc["static"] = acc.get("static", 0.0) + time.perf_counter() - t

            cap.fn = timed
            return cap

    decode_graph.graphs_supported = lambda cache: True
    decode_graph.DecodeGraphs = functools.partial(Timed, capture=False)
    try:
        yield
    finally:
        decode_graph.graphs_supported, decode_graph.DecodeGraphs = saved


_STATIC: list = [None]  # the acc dict of the call being timed (static steps add their seconds)

# step_verify is launch_verify + PendingVerify.result (both timed, never the composite twice)
_PARTS = (("step", "polykv.pool.agents", "AgentBatch", ("step_tokens", "launch_verify", "step_tokens_ahead")),
          ("step", "polykv.pool.agents", "PendingTokens", ("result",)),  # the pipelined plain loop's read
          ("step", "polykv.pool.agents", "PendingVerify", ("result",)),  # a verify step's host half
          ("record", "polykv.spec.speculator", "Speculator", ("record",)),
          ("draft", "polykv.spec.speculator", "Speculator", ("propose_all",)),
          ("ahead", "polykv.spec.speculator", "Speculator", ("ahead",)))  # between launch and result


def _wrap_timed(klass, name: str, part: str, acc: dict, saved: list) -> None:
    """Replace klass.name by a wrapper adding its seconds to acc[part]; (klass, name, fn) to saved."""
    fn = getattr(klass, name)

    def wrap(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[part] = acc.get(part, 0.0) + time.perf_counter() - t

    saved.append((klass, name, fn))
    setattr(klass, name, wrap)


@contextlib.contextmanager
def _timed_parts(acc: dict):
    """Seconds inside the batch step (model included), the speculator's record and its drafting
    (propose_all: drafters and the width planner), summed into acc[part]."""
    import importlib

    saved = []
    for part, mod, cls, names in _PARTS:
        klass = getattr(importlib.import_module(mod), cls, None)
        for name in names:
            if getattr(klass, name, None) is not None:  # None: a tree before the pipelined plain loop
                _wrap_timed(klass, name, part, acc, saved)
    _STATIC[0] = acc
    try:
        yield
    finally:
        _STATIC[0] = None
        for klass, name, fn in saved:
            setattr(klass, name, fn)


_NAMES = ("step", "static", "record", "draft", "ahead", "loop")


def _part(p: str, wall: float, model: float, info: dict) -> float:
    """Host seconds of part p in one call. "step": the batch step's host work outside its static
    step (building and launching it, reading its ids, acceptance, rollback); "static": the static
    step's own work minus the model (a CUDA graph on the GPU: device time there); "ahead":
    `Speculator.ahead` (between a verify step's launch and its read: under the device's step on
    the GPU); "loop": the host time outside the others. (The one prefill forward per call runs
    eagerly, outside the static steps: its model time, ~us here, lands in "step" and is taken off
    "static".)"""
    parts = info["parts"]
    if p == "loop":
        return wall - model - sum(v for k, v in parts.items() if k != "static")
    if p == "step":
        return parts.get("step", 0.0) - parts.get("static", 0.0)
    if p == "static":
        return parts.get("static", 0.0) - model
    return parts.get(p, 0.0)


def _critical(wall: float, model: float, info: dict) -> float:
    """Host seconds the device waits for in a speculative loop on the GPU: everything but the static
    steps (device work there) and `ahead` (overlapped with the step in flight). For the pipelined
    plain loop this is host work the device does not wait for while it stays below a step's time."""
    return wall - model - _part("static", wall, model, info) - _part("ahead", wall, model, info)


def measure(agents=(8, 32), tokens: int = 64, repeats: int = 3,
            methods=("prompt_lookup", "suffix_tree"), sync: bool = True, seed: int = 0) -> dict:
    """Per (agents, side) medians over `repeats` timed calls (module doc). sync: each method also
    runs with `SharedKVPool.spec_overlap` off ("<method> sync": the synchronous loop, each step's
    outputs added to the tree before the next drafts) in the same rounds, the speculative sides
    in a shuffled order per round; every speculative call's answers must equal plain's."""
    torch.set_num_threads(1)
    pool, doc, lm, prompts = _setup()
    sides = [("plain", None, True)]
    for m in methods:
        sides.append((m, {"method": m, "num_draft_tokens": 4}, True))
        if sync:
            sides.append((m + " sync", {"method": m, "num_draft_tokens": 4}, False))
    rng = random.Random(seed)
    rows = []
    saved_overlap = pool.spec_overlap
    with torch.no_grad(), _static_steps():
        for n in agents:
            ps = [list(p) for p in prompts[:n]]
            res = {name: [] for name, _, _ in sides}
            for r in range(repeats + 1):  # round 0: warm-up (static steps built)
                order = sides[1:]
                rng.shuffle(order)
                for name, spec, overlap in [sides[0]] + order:
                    pool._docs[doc].outputs = None
                    pool.spec_overlap = overlap
                    lm.seconds = 0.0
                    parts: dict = {}
                    try:
                        with _timed_parts(parts):
                            t = time.perf_counter()
                            pool.generate(doc, ps, max_new_tokens=tokens, speculative=spec)
                            wall = time.perf_counter() - t
                    finally:
                        pool.spec_overlap = saved_overlap
                    info = dict(pool.last_generate, parts=parts)
                    if spec is None:
                        want = info["answer_ids"]
                    elif info["answer_ids"] != want:
                        raise AssertionError(f"{name}: answers differ from plain's")
                    if r:
                        res[name].append((wall, lm.seconds, info))
            plain = [(w - m) / i["steps"] for w, m, i in res["plain"]]
            plain_crit = [_critical(w, m, i) / i["steps"] for w, m, i in res["plain"]]
            for name, _, _ in sides:
                runs = res[name]
                info = runs[-1][2]
                st = info.get("speculative", {})
                host = [(w - m) / i["steps"] for w, m, i in runs]
                crit = [_critical(w, m, i) / i["steps"] for w, m, i in runs]
                rows.append(dict(agents=n, side=name, steps=statistics.median(i["steps"] for _, _, i in runs),
                                 new_tokens=sum(info["new_tokens"]),
                                 host_ms_per_step=statistics.median(host) * 1e3,
                                 critical_ms_per_step=statistics.median(crit) * 1e3,
                                 x_plain=statistics.median(h / p for h, p in zip(host, plain)),
                                 critical_x_plain=statistics.median(c / p for c, p in zip(crit, plain_crit)),
                                 model_ms_per_step=statistics.median(m / i["steps"] for _, m, i in runs) * 1e3,
                                 ms_per_token=statistics.median((w - m) / sum(i["new_tokens"]) for w, m, i in runs) * 1e3,
                                 parts_ms_per_step={p: statistics.median(_part(p, w, m, i) / i["steps"] for w, m, i in runs) * 1e3
                                                    for p in _NAMES},
                                 tokens_per_step=round(st.get("tokens_per_step", 1.0), 3),
                                 acceptance=round(st.get("acceptance", 0.0), 3),
                                 full_accepts=st.get("full_accepts", 0), agent_steps=st.get("agent_steps", 0),
                                 graph_captures=sum(i["graph_captures"] for _, _, i in runs)))
            for row in rows[-len(sides):]:  # overlap over sync, round by round (same round's calls)
                other = res.get(row["side"] + " sync")
                if other:
                    mine = res[row["side"]]
                    row["critical_over_sync"] = statistics.median(
                        (_critical(wa, ma, ia) / ia["steps"]) / (_critical(wb, mb, ib) / ib["steps"])
                        for (wa, ma, ia), (wb, mb, ib) in zip(mine, other))
    return dict(rows=rows, tokens=tokens, repeats=repeats, torch_threads=torch.get_num_threads(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def load_spec(ref: str):
    """The package `polykv/spec` at git `ref`, imported under its own name (`_spec_<ref>`)."""
    import importlib.util
    import pathlib
    import subprocess
    import tempfile

    root = pathlib.Path(__file__).resolve().parents[2]
    git = ["git", "-C", str(root)]
    names = subprocess.run(git + ["ls-tree", "--name-only", ref, "polykv/spec/"], check=True,
                           capture_output=True, text=True).stdout.split()
    name = "_spec_" + "".join(c if c.isalnum() else "_" for c in ref)
    d = pathlib.Path(tempfile.mkdtemp()) / name
    d.mkdir()
    for n in names:
        if n.endswith(".py"):
            src = subprocess.run(git + ["show", f"{ref}:{n}"], check=True, capture_output=True, text=True).stdout
            (d / pathlib.Path(n).name).write_text(src)
    spec = importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _spec_package(mod):
    """`polykv.spec`'s classes the pool looks up at call time, taken from package `mod`."""
    import polykv.spec as live

    names = ("SpecConfig", "Speculator", "NgramIndex", "SuffixTree")
    saved = {n: getattr(live, n) for n in names}
    for n in names:
        setattr(live, n, getattr(mod, n))
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(live, n, v)


@contextlib.contextmanager
def _timed_parts_of(mod, acc: dict):
    """`_timed_parts` with the speculator's record / propose_all of package `mod`."""
    from polykv.spec import speculator

    saved = []
    klass = mod.Speculator
    if klass is speculator.Speculator:  # the working tree's: `_timed_parts` wraps these already
        with _timed_parts(acc):
            yield
        return
    for part, name in (("record", "record"), ("draft", "propose_all")):
        _wrap_timed(klass, name, part, acc, saved)
    try:
        with _timed_parts(acc):  # the batch step's parts (its record / draft wraps: the live package's)
            yield
    finally:
        for klass, name, fn in saved:
            setattr(klass, name, fn)


def compare(ref: str, agents=(8, 32), tokens: int = 64, rounds: int = 20,
            methods=("prompt_lookup", "suffix_tree"), seed: int = 0) -> dict:
    """Before (polykv/spec at `ref`) / after (the working tree) in one process (module doc)."""
    import polykv.spec as live
    from polykv.spec import NgramIndex

    torch.set_num_threads(1)
    base = load_spec(ref)
    pool, doc, lm, prompts = _setup()
    d = pool._docs[doc]
    trees = {"before": base, "after": live}
    index = {"before": base.NgramIndex(d.ids), "after": NgramIndex(d.ids)}
    sides = [("plain", None, None)]
    for m in methods:
        for cost in (None, 0.1):
            for tree in trees:
                cfg = {"method": m, "num_draft_tokens": 4}
                if cost is not None:
                    cfg["cost_per_draft"] = cost
                sides.append((m + ("" if cost is None else " fixed"), cfg, tree))
    rng = random.Random(seed)
    rows = []
    with torch.no_grad(), _static_steps():
        for n in agents:
            ps = [list(p) for p in prompts[:n]]
            res: dict = {}
            for r in range(rounds + 1):  # round 0: warm-up
                order = sides[1:]
                rng.shuffle(order)
                for name, cfg, tree in [sides[0]] + order:
                    mod = trees[tree] if tree else live
                    d.outputs = None
                    d.ngram = index[tree] if tree else d.ngram
                    lm.seconds = 0.0
                    parts: dict = {}
                    with _spec_package(mod), _timed_parts_of(mod, parts):
                        t = time.perf_counter()
                        pool.generate(doc, ps, max_new_tokens=tokens, speculative=cfg)
                        wall = time.perf_counter() - t
                    info = dict(pool.last_generate, parts=parts)
                    if name == "plain":
                        want = info["answer_ids"]
                    elif info["answer_ids"] != want:
                        raise AssertionError(f"{name} ({tree}) answers differ from plain's")
                    if r:
                        res.setdefault((name, tree), []).append((wall, lm.seconds, info))
            plain_runs = [(w - m) / i["steps"] for w, m, i in res[("plain", None)]]
            plain = statistics.median(plain_runs)
            for (name, tree), runs in res.items():
                host = [(w - m) / i["steps"] for w, m, i in runs]
                other = res.get((name, {"before": "after", "after": "before"}.get(tree)))
                paired = {}
                if tree == "after" and other:  # round by round: after / before of the same round
                    paired = dict(host_after_over_before=statistics.median(
                        (wa - ma) / ia["steps"] / ((wb - mb) / ib["steps"]) for (wa, ma, ia), (wb, mb, ib) in zip(runs, other)),
                        draft_after_over_before=statistics.median(
                            _part("draft", wa, ma, ia) / ia["steps"] / (_part("draft", wb, mb, ib) / ib["steps"])
                            for (wa, ma, ia), (wb, mb, ib) in zip(runs, other)))
                rows.append(dict(agents=n, side=name, tree=tree, host_ms_per_step=statistics.median(host) * 1e3,
                                 x_plain=statistics.median(h / p for h, p in zip(host, plain_runs)), **paired,
                                 steps=statistics.median(i["steps"] for _, _, i in runs),
                                 us_per_token=statistics.median((w - m) / sum(i["new_tokens"]) for w, m, i in runs) * 1e6,
                                 parts_ms_per_step={p: statistics.median(_part(p, w, m, i) / i["steps"] for w, m, i in runs) * 1e3
                                                    for p in _NAMES}))
    return dict(rows=rows, baseline=ref, tokens=tokens, rounds=rounds, torch_threads=torch.get_num_threads(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None, help="git ref: before / after in one process (module doc)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-sync", action="store_true", help="leave out the synchronous-loop sides")
    a = ap.parse_args(argv)
    if a.baseline:
        out = compare(a.baseline, tuple(int(x) for x in a.agents.split(",")), a.tokens, a.rounds)
        for r in out["rows"]:
            print(f"agents {r['agents']:3d} {r['side']:19s} {r['tree'] or '':6s} host {r['host_ms_per_step']:6.3f} ms/step "
                  f"x plain {r['x_plain']:.2f}, {r['steps']:5.1f} steps, {r['us_per_token']:5.1f} us/token; "
                  + (f"after/before host {r['host_after_over_before']:.3f} draft {r['draft_after_over_before']:.3f}; "
                     if "host_after_over_before" in r else "")
                  + ", ".join(f"{p} {v:.3f}" for p, v in r["parts_ms_per_step"].items()), file=sys.stderr)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    out = measure(tuple(int(x) for x in a.agents.split(",")), a.tokens, a.repeats, sync=not a.no_sync)
    for r in out["rows"]:
        print(f"agents {r['agents']:3d} {r['side']:18s} host {r['host_ms_per_step']:6.3f} ms/step "
              f"(x plain {r['x_plain']:.2f}), critical {r['critical_ms_per_step']:6.3f} (x plain {r['critical_x_plain']:.2f}"
              + (f", / sync {r['critical_over_sync']:.3f}" if "critical_over_sync" in r else "")
              + f"), model {r['model_ms_per_step']:.2f}, {r['steps']:4.1f} steps, {r['tokens_per_step']:.2f} tok/verify, "
              f"acc {r['acceptance']:.2f}, full {r['full_accepts']}/{r['agent_steps']}, captures {r['graph_captures']}; "
              + ", ".join(f"{p} {v:.3f}" for p, v in r["parts_ms_per_step"].items()),
              file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
