"""What the agents' recent window (polykv.pool.ring) buys the shared pool: perplexity of a suffix
decoded through SharedKVPool, with and without the window, against an f16 pool (docs/pool.md,
"Recent windows").

Per window of `--ctx` tokens of the corpus (`polykv.eval.ppl.corpus_windows`, Pride and Prejudice by
default): the first half is the document (prefilled once, compressed, shared); the second half is one
agent's suffix, scored token by token — run as ONE forward of all its columns, which reads exactly
the rows token-by-token decoding reads (each query its own window and the rows before it, written
compressed first; tests/pool/test_ring_pool.py::test_one_forward_equals_token_by_token, and
`--check-tbt N` here compares the two on the real model). Scored: suffix tokens 2.. (token 1's
prediction comes from the document's prefill).

    python scripts/pool_ring_ppl.py --ctx 2048 --windows 2 --configs f16:0 default:0 default:8 \
        balanced:0 balanced:32 max:0 max:8 --threads 1 --json out.json

A config is PRESET:R (SharedKVPool(preset=PRESET, recent=R)), or f16:0 (k=v=f16, the reference).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def make_pool(model, tok, spec: str):
    from polykv.pool import SharedKVPool

    name, r = spec.split(":")
    if name == "f16":
        return SharedKVPool(model, tok, k="f16", v="f16", recent=int(r), progress=False)
    return SharedKVPool(model, tok, preset=name, recent=int(r), progress=False)


@torch.inference_mode()
def score(pool, ids: list[int], check_tbt: int = 0) -> dict:
    """NLL of ids[half+1:] given the document ids[:half] and the suffix before each token."""
    half = len(ids) // 2
    doc = pool.add_document(ids[:half])
    suffix = ids[half:]
    out = {}
    with pool.open_batch(doc, capacity=2, seq_capacity=len(suffix)) as b:
        aid = b.add(suffix[:-1])
        logits, _ = b._forward([b._get(aid)], keep=len(suffix) - 1)  # [1, n, vocab], every column
        lp = torch.log_softmax(logits[0].float(), -1)
        tgt = torch.tensor(suffix[1:])
        nll = -lp[torch.arange(len(tgt)), tgt]
        out.update(nll=float(nll.sum()), tokens=len(tgt), kv_bytes_agents=pool.memory_report()["kv_bytes_agents"],
                   kv_bytes_ring=pool.memory_report()["kv_bytes_ring"])
        if check_tbt:  # the same columns decoded one token per step by a second agent
            t = b.add(suffix[:1])
            steps = [b.step()[t]]
            for tokid in suffix[1:check_tbt]:
                b.feed({t: tokid})
                steps.append(b.step()[t])
            one = logits[0, :check_tbt].float()
            out["tbt_max_abs_logit_diff"] = float((torch.stack(steps) - one).abs().max())
    pool.remove_document(doc)
    return out


def main(argv=None) -> dict:
    from polykv import load_model
    from polykv.eval.common import load_text
    from polykv.eval.ppl import corpus_windows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default=None)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=["f16:0", "default:0", "default:8"])
    ap.add_argument("--check-tbt", type=int, default=0, help="compare N columns with token-by-token steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    wins = corpus_windows(tok, load_text(a.text), a.ctx, a.windows)
    rows = []
    for spec in a.configs:
        t0 = time.time()
        pool = make_pool(model, tok, spec)
        per = [score(pool, w, a.check_tbt) for w in wins]
        nll, n = sum(p["nll"] for p in per), sum(p["tokens"] for p in per)
        row = dict(config=spec, k=pool.k_type, v=pool.v_type, recent=pool.recent,
                   precision=(pool.precision or {}).get("source") if isinstance(pool.precision, dict) else pool.precision,
                   ppl=math.exp(nll / n), tokens=n, per_window_ppl=[math.exp(p["nll"] / p["tokens"]) for p in per],
                   kv_bytes_agents=per[-1]["kv_bytes_agents"], kv_bytes_ring=per[-1]["kv_bytes_ring"],
                   seconds=round(time.time() - t0, 1))
        if a.check_tbt:
            row["tbt_max_abs_logit_diff"] = max(p["tbt_max_abs_logit_diff"] for p in per)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ref = next((r["ppl"] for r in rows if r["config"].startswith("f16")), None)
    for r in rows:
        r["delta_pct"] = None if ref is None else (r["ppl"] / ref - 1) * 100
    res = dict(ctx=a.ctx, windows=len(wins), scored="second half of each window, token by token", rows=rows,
               ppl_ref=ref)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({r["config"]: round(r["delta_pct"], 3) if r["delta_pct"] is not None else None for r in rows}))
    return res


if __name__ == "__main__":
    main()
