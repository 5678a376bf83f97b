"""A pool whose documents total 2x its GPU budget serves all of them with no re-prefill (issue H).

Four 16,384-token documents (Llama-3-8B-shape model, 4 layers, random weights, bf16) in a pool whose
`gpu_budget_bytes` holds 2.5 of them and whose host tier is unbounded; two rounds of `generate`
(8 agents, 8 new tokens) on every document. Counts prefills and compares every answer with an
unbudgeted all-GPU pool's.

    PYTHONPATH=. python3 polykv/bench/tier_budget.py OUT.json           # GPU
    PYTHONPATH=. python3 polykv/bench/tier_budget.py OUT.json --tiny    # CPU, tiny model (smoke)
"""

from __future__ import annotations

import argparse
import json
import time

import torch


class _IdTok:
    """Token ids in, ids out: answers compare as strings of ids."""
    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def run(tiny: bool = False, n_docs: int = 4, doc_tokens: int = 16384, agents: int = 8,
        new_tokens: int = 8, log=print) -> dict:
    from polykv.bench.e2e import build_model
    from polykv.pool import SharedKVPool

    dev = torch.device("cpu" if tiny else "cuda")
    if tiny:
        doc_tokens = min(doc_tokens, 300)
    model = build_model(2 if tiny else 4, dev, torch.float32 if tiny else torch.bfloat16, tiny=tiny)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, V, (doc_tokens,), generator=g).tolist() for _ in range(n_docs)]
    prompts = [torch.randint(0, V, (16,), generator=g).tolist() for _ in range(agents)]
    kw = dict(k="q8_0", v="turbo3", progress=False, prefill_chunk=4096)
    ref = SharedKVPool(model, _IdTok(), **kw)
    want = [ref.generate(ref.add_document(d), prompts, max_new_tokens=new_tokens) for d in docs]
    one = ref.memory_report()["kv_bytes_shared"] // n_docs
    del ref
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    pool = SharedKVPool(model, _IdTok(), gpu_budget_bytes=2 * one + one // 2, host_budget_bytes=1 << 40,
                        stream_chunk_rows=128 if tiny else 16384, **kw)
    prefills = []
    real = pool._prefill
    pool._prefill = lambda d, **k: (prefills.append(d.id), real(d, **k))[1]
    ids = [pool.add_document(d) for d in docs]
    out = dict(doc_bytes=one, gpu_budget=pool.gpu_budget_bytes, rounds=[])
    for rnd in range(2):
        for i, doc in enumerate(ids):
            tier = {d["id"]: d.get("tier") for d in pool.documents()}[doc]
            t = time.perf_counter()
            got = pool.generate(doc, prompts, max_new_tokens=new_tokens)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rep = pool.memory_report()
            out["rounds"].append(dict(round=rnd, doc=i, tier_before=tier, s=time.perf_counter() - t,
                                      same_as_unbudgeted=got == want[i],
                                      tier_bytes={k: v for k, v in rep.items() if "tier" in k}))
            log(out["rounds"][-1])
    out["prefills"] = len(prefills)
    out["all_resident"] = all(d["resident"] for d in pool.documents())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    res = run(tiny=a.tiny)
    print("prefills", res["prefills"], "all resident", res["all_resident"],
          "all answers as unbudgeted", all(r["same_as_unbudgeted"] for r in res["rounds"]))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
