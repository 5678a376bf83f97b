"""Attention microbenchmark (GPU): packed-KV Triton kernels vs torch SDPA over dense fp16 KV.

bench_attention(ctxs, agents, pairs) -> {"rows": [{ctx, agents, k, v, ms, ms_sdpa_f16, speedup,
gbps, ...}]}. agents == 1 and suffix == 0: fused decode of one sequence over ctx compressed tokens.
Otherwise: cascade — `agents` sequences share a ctx-token compressed prefix and each has its own
`suffix`-token compressed suffix; the baselines are SDPA over `agents` dense fp16 copies of
prefix+suffix (ms_sdpa_f16) and the fp16 dense cascade (ms_dense_cascade: dense_cascade, the shared
prefix read once). SDPA runs its flash backend (cuDNN off). Layer shape defaults to Llama-3-8B (32 q heads, 8 KV heads, head_dim 128), one query
per agent. Timing: triton.testing.do_bench (CUDA events, L2 flushed between reps), median, of CUDA-graph
replays (ms, ms_sdpa_f16) and of eager calls (ms_eager, ms_sdpa_f16_eager: host launch overhead in).
gbps = bytes the kernel must read (packed K/V of every visible row, counted from the tensors) / time.
"""

from __future__ import annotations

import math

import torch

from ..codecs import get_codec


def _median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graphed(fn):
    """Capture fn (warmed up) in a CUDA graph; returns the replay callable. Times of replays leave
    the host's launch overhead out (as a graph-captured decode step in an engine would)."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def _time(fn, warmup, rep):
    """(graph-replay median ms, eager median ms)."""
    fn()
    torch.cuda.synchronize()
    eager = _median_ms(fn, warmup, rep)
    try:
        gr = graphed(fn)
        return _median_ms(gr, warmup, rep), eager
    except Exception:  # capture can fail for a path; report eager then
        return eager, eager


def _sdpa(q, k, v):
    """torch SDPA, flash backend only: torch 2.11 otherwise picks cuDNN for decode shapes and
    rebuilds its plan every call, which is not what a tuned baseline would run."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def dense_cascade(q, prefix_k, prefix_v, suffix_k, suffix_v):
    """The fp16 cascade a user can write with torch alone (FlashInfer-style): every agent's query
    heads of a KV head stacked as query rows of ONE flash-attention call over the shared prefix
    (read once, non-causal), one flash call over the per-agent suffixes, and an LSE merge.
    q [N, Hq, 1, D]; prefix_k/v [1, Hkv, P, D]; suffix_k/v [N, Hkv, S, D] (all visible: one query
    per agent at the end of its suffix). Returns [N, Hq, 1, D]."""
    N, Hq, _, D = q.shape
    hkv = prefix_k.shape[1]
    grp = Hq // hkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    qp = q.view(N, hkv, grp, D).permute(1, 0, 2, 3).reshape(1, hkv, N * grp, D)
    o_p, l_p = flash(qp, prefix_k, prefix_v)[:2]  # [1, Hkv, N*grp, D], lse [1, Hkv, N*grp]
    o_s, l_s = flash(q.view(N, hkv, grp, D), suffix_k, suffix_v)[:2]
    o_p = o_p.view(hkv, N, grp, D).transpose(0, 1)
    l_p = l_p.view(hkv, N, grp).transpose(0, 1)
    m = torch.maximum(l_p, l_s)
    w_p, w_s = torch.exp(l_p - m), torch.exp(l_s - m)
    out = (o_p * w_p[..., None] + o_s * w_s[..., None]) / (w_p + w_s)[..., None]
    return out.reshape(N, Hq, 1, D)


def _rows_bytes(p) -> int:
    return p.nbytes()


def bench_one(ctx: int, agents: int, kname: str, vname: str, *, hq: int = 32, hkv: int = 8,
              d: int = 128, suffix: int = 0, n_q: int = 1, device="cuda", sdpa: bool = True,
              tune: dict | None = None, warmup: int = 25, rep: int = 100) -> dict:
    from ..kernels import attention_decode, cascade_attention

    tune = tune or {}
    kc, vc = get_codec(kname, d), get_codec(vname, d)
    g = torch.Generator(device=device).manual_seed(ctx * 131 + agents)
    scale = 1.0 / math.sqrt(d)

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float16, generator=g)

    kp = kc.encode(rnd(1, hkv, ctx, d))
    vp = vc.encode(rnd(1, hkv, ctx, d))
    q = rnd(agents, hq, n_q, d)
    row = dict(ctx=ctx, agents=agents, k=kname, v=vname, suffix=suffix, hq=hq, hkv=hkv, d=d)
    if agents == 1 and suffix == 0:
        fn = lambda: attention_decode(q, kp, vp, kc, vc, sm_scale=scale, **tune)  # noqa: E731
        nbytes = _rows_bytes(kp) + _rows_bytes(vp)
    else:
        sk = kc.encode(rnd(agents, hkv, max(suffix, 1), d))
        sv = vc.encode(rnd(agents, hkv, max(suffix, 1), d))
        sl = torch.full((agents,), suffix, dtype=torch.int32, device=device)
        fn = lambda: cascade_attention(q, kp, vp, sk, sv, sl, kc, vc, sm_scale=scale,  # noqa: E731
                                       **tune)
        nbytes = _rows_bytes(kp) + _rows_bytes(vp) + (
            (_rows_bytes(sk) + _rows_bytes(sv)) if suffix else 0)
    ms, ms_eager = _time(fn, warmup, rep)
    row.update(ms=ms, ms_eager=ms_eager, bytes=nbytes, gbps=nbytes / ms / 1e6)
    del kp, vp
    if sdpa:
        total = ctx + suffix
        kd = rnd(agents, hkv, total, d)
        vd = rnd(agents, hkv, total, d)
        fs = lambda: _sdpa(q, kd, vd)  # noqa: E731
        ms_s, ms_s_eager = _time(fs, warmup, rep)
        row["ms_sdpa_f16_eager"] = ms_s_eager
        dense = kd.numel() * 2 * 2
        row.update(ms_sdpa_f16=ms_s, speedup=ms_s / ms, gbps_sdpa=dense / ms_s / 1e6,
                   bytes_sdpa=dense)
        del kd, vd
        if agents > 1:  # the fp16 dense cascade: shared prefix read once
            pkd, pvd = rnd(1, hkv, ctx, d), rnd(1, hkv, ctx, d)
            skd, svd = rnd(agents, hkv, max(suffix, 1), d), rnd(agents, hkv, max(suffix, 1), d)
            fc = lambda: dense_cascade(q, pkd, pvd, skd, svd)  # noqa: E731
            ms_c, ms_c_eager = _time(fc, warmup, rep)
            row.update(ms_dense_cascade=ms_c, ms_dense_cascade_eager=ms_c_eager,
                       speedup_dense_cascade=ms_c / ms)
            del pkd, pvd, skd, svd
    else:
        row.update(ms_sdpa_f16=None, speedup=None)
    torch.cuda.empty_cache()
    return row


def bench_attention(ctxs=(4096, 16384, 65536, 131072), agents=(1,),
                    pairs=(("q8_0", "turbo3"), ("turbo4", "turbo3"), ("turbo3", "turbo3")),
                    *, suffix: int | None = None, tune: dict | None = None, **kw) -> dict:
    """One row per (ctx, agents, pair). suffix defaults to 0 for a single agent and 128 for
    several (cascade)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_attention needs a CUDA GPU")
    rows = []
    for ctx in ctxs:
        for n in agents:
            sfx = suffix if suffix is not None else (0 if n == 1 else 128)
            for kname, vname in pairs:
                rows.append(bench_one(int(ctx), int(n), kname, vname, suffix=sfx, tune=tune, **kw))
    return {"rows": rows}
