"""End-to-end check on CUDA: KVCache and SharedKVPool running the Triton kernels vs the torch
reference (`force_reference`), on a random-initialised model of Llama-3-8B layer shape (timing and
kernel agreement do not depend on trained weights).

    PYTHONPATH=. python3 polykv/bench/gpu_integration.py [--out DIR]

Prints a short table; writes gpu_integration.json under --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def build_model(layers: int = 2, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                      max_position_embeddings=131072, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@torch.inference_mode()
def kvcache_logits(model, ids: torch.Tensor, k: str, v: str, steps: int) -> torch.Tensor:
    """Prefill ids[:, :-steps], then teacher-force the last `steps` tokens one at a time through a
    KVCache; returns the decode logits [steps, vocab] (float32)."""
    from polykv.hf.kv_cache import KVCache

    cache = KVCache(model, k=k, v=v)
    n = ids.shape[1] - steps
    model(ids[:, :n], past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = []
    for t in range(n, ids.shape[1]):
        o = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        out.append(o.logits[0, -1].float())
    return torch.stack(out)


@torch.inference_mode()
def decode_graph_logits(model, ids: torch.Tensor, k: str, v: str, steps: int, capture: bool):
    """As kvcache_logits, the decode steps through polykv.hf.DecodeGraph (captured or eager)."""
    from polykv.hf import DecodeGraph, KVCache

    cache = KVCache(model, k=k, v=v)
    n = ids.shape[1] - steps
    model(ids[:, :n], past_key_values=cache, use_cache=True, logits_to_keep=1)
    runner = DecodeGraph(model, cache, max_new_tokens=steps, capture=capture)
    return torch.stack([runner.step(ids[:, t:t + 1])[0].clone() for t in range(n, ids.shape[1])])


@torch.inference_mode()
def padded_batch_rel(model, k: str, v: str, lengths=(700, 523, 611), steps: int = 4) -> float:
    """A left-padded KVCache batch decoding on the fused kernel (kv_start from the mask) vs each
    sequence decoded alone: max relative logit error over the steps."""
    from polykv.hf import KVCache

    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 32000, (n,), generator=g).cuda() for n in lengths]
    L = max(lengths)
    ids = torch.zeros(len(seqs), L, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, s_ in enumerate(seqs):
        ids[i, L - len(s_):], mask[i, L - len(s_):] = s_, 1
    feed = torch.randint(0, 32000, (steps, len(seqs), 1), generator=g).cuda()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    c = KVCache(model, k=k, v=v)
    model(ids, attention_mask=mask, position_ids=pos, past_key_values=c, use_cache=True, logits_to_keep=1)
    alone = []
    for s_ in seqs:
        ci = KVCache(model, k=k, v=v)
        model(s_[None], past_key_values=ci, use_cache=True, logits_to_keep=1)
        alone.append(ci)
    worst, p = 0.0, pos[:, -1:]
    for t in feed:
        mask, p = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), p + 1
        got = model(t, attention_mask=mask, position_ids=p, past_key_values=c, use_cache=True).logits[:, -1]
        for i, ci in enumerate(alone):
            want = model(t[i:i + 1], past_key_values=ci, use_cache=True).logits[0, -1]
            worst = max(worst, rel(got[i], want))
    return worst


@torch.inference_mode()
def pool_logits(model, doc_ids: list[int], suffixes: list[list[int]], k: str, v: str, steps: int,
                graphs: bool = True):
    """Agents over one shared document; fixed tokens fed each step. Returns (logits [steps, N, vocab],
    ms per decode step, pool memory report, cuda bytes allocated for the document)."""
    from polykv.pool import SharedKVPool

    pool = SharedKVPool(model, None, k=k, v=v, progress=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    doc = pool.add_document(doc_ids)
    torch.cuda.synchronize()
    doc_cuda_bytes = torch.cuda.memory_allocated() - before
    gen = torch.Generator().manual_seed(1)
    feeds = torch.randint(0, 32000, (steps, len(suffixes)), generator=gen).tolist()
    out, times = [], []
    with pool.open_batch(doc, capacity=len(suffixes), seq_capacity=max(map(len, suffixes)) + steps + 1,
                         graphs=graphs) as b:
        aids = [b.add(s) for s in suffixes]
        logits = b.step()  # suffix prefill
        for s in range(steps):
            out.append(torch.stack([logits[a] for a in aids]))
            b.feed({a: feeds[s][i] for i, a in enumerate(aids)})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = b.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[1:]) if len(times) > 1 else times
    return torch.stack(out), times[len(times) // 2], pool.memory_report(), doc_cuda_bytes


def main() -> None:
    from polykv.kernels import dispatch

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    model = build_model()
    res: dict = {"device": torch.cuda.get_device_name(), "model": "random Llama-8B layer shape x2 layers, bf16"}
    rows = []
    g = torch.Generator().manual_seed(0)
    for k, v in [("q8_0", "turbo3"), ("turbo4", "turbo3"), ("f16", "f16")]:
        ids = torch.randint(0, 32000, (1, 1040), generator=g).cuda()
        dispatch.force_reference(False)
        a = kvcache_logits(model, ids, k, v, 16)
        dispatch.force_reference(True)
        b = kvcache_logits(model, ids, k, v, 16)
        dispatch.force_reference(None)
        rows.append({"what": "KVCache decode logits", "k": k, "v": v, "rel_err": rel(a, b),
                     "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())})
    doc = torch.randint(0, 32000, (3000,), generator=g).tolist()
    suffixes = [torch.randint(0, 32000, (int(n),), generator=g).tolist() for n in (1, 5, 17, 64, 3, 40, 9, 128)]
    for k, v in [("q8_0", "turbo3"), ("turbo4", "turbo3")]:
        dispatch.force_reference(False)
        a, ms_a, mem, doc_bytes = pool_logits(model, doc, suffixes, k, v, 8)
        dispatch.force_reference(True)
        b, ms_b, _, _ = pool_logits(model, doc, suffixes, k, v, 8)
        dispatch.force_reference(None)
        rows.append({"what": "pool cascade logits (8 agents)", "k": k, "v": v, "rel_err": rel(a, b),
                     "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                     "kv_bytes_shared": mem.get("kv_bytes_shared"), "cuda_alloc_delta_doc": doc_bytes})
    # Captured decode steps (CUDA graphs) vs the same kernels run eagerly.
    for k, v in [("q8_0", "turbo3"), ("turbo4", "turbo3")]:
        a, ms_g, _, _ = pool_logits(model, doc, suffixes, k, v, 8, graphs=True)
        b, ms_e, _, _ = pool_logits(model, doc, suffixes, k, v, 8, graphs=False)
        rows.append({"what": "pool graph vs eager (8 agents)", "k": k, "v": v, "rel_err": rel(a, b),
                     "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                     "ms_graph": ms_g, "ms_eager": ms_e})
        ids = torch.randint(0, 32000, (1, 1040), generator=g).cuda()
        a = decode_graph_logits(model, ids, k, v, 16, capture=True)
        b = decode_graph_logits(model, ids, k, v, 16, capture=False)
        rows.append({"what": "DecodeGraph captured vs static eager", "k": k, "v": v,
                     "rel_err": rel(a, b), "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())})
        c = kvcache_logits(model, ids, k, v, 16)
        rows.append({"what": "DecodeGraph captured vs KVCache fused", "k": k, "v": v,
                     "rel_err": rel(a, c), "top1_agree": float((a.argmax(-1) == c.argmax(-1)).float().mean())})
    for k, v in [("q8_0", "turbo3")]:
        rows.append({"what": "KVCache left-padded batch vs alone", "k": k, "v": v,
                     "rel_err": padded_batch_rel(model, k, v), "top1_agree": float("nan")})
    res["checks"] = rows
    # Decode step time of the whole (2-layer) model: 32 agents over a 16k-token shared document.
    doc = torch.randint(0, 32000, (16384,), generator=g).tolist()
    suffixes = [torch.randint(0, 32000, (64,), generator=g).tolist() for _ in range(32)]
    timing = []
    for forced in (False, True):
        dispatch.force_reference(forced)
        _, ms, mem, doc_bytes = pool_logits(model, doc, suffixes, "q8_0", "turbo3", 6)
        timing.append({"path": "reference" if forced else "triton", "agents": 32, "doc_tokens": 16384,
                       "ms_per_step": ms, "kv_bytes_shared": mem.get("kv_bytes_shared"),
                       "cuda_alloc_delta_doc": doc_bytes})
    dispatch.force_reference(None)
    res["pool_step"] = timing
    with open(os.path.join(args.out, "gpu_integration.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'check':34} {'K/V':16} {'rel_err':>9} {'top1':>6}")
    for r in rows:
        print(f"{r['what']:34} {r['k'] + '/' + r['v']:16} {r['rel_err']:9.2e} {r['top1_agree']:6.3f}")
    for t in timing:
        print(f"pool step 32 agents @16k, {t['path']:9}: {t['ms_per_step']:.2f} ms "
              f"(doc KV {t['cuda_alloc_delta_doc'] / 2**20:.1f} MiB cuda alloc delta)")
    bad = [r for r in rows if not (r["rel_err"] < 2e-2)]
    if bad:
        raise SystemExit(f"FAILED: {bad}")


if __name__ == "__main__":
    main()
