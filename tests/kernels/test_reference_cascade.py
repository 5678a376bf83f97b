"""reference.cascade_attention_ref (the kernels' ground truth and the pool's CPU path) vs an
independent float64 softmax over each agent's explicit concatenation prefix + suffix, decoded in
true space, with visibility decided key by key on absolute positions. Plus its memory properties:
the prefix decoded once per call, never a copy per agent, score blocks bounded."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from polykv.codecs import Packed, get_codec
from polykv.kernels import reference
from polykv.kernels.reference import cascade_attention_ref, quantize_ref


def dense_cascade(q, kp, vp, ks, vs, lens, *, sm_scale=None, window=None, prefix_start=0,
                  prefix_end=None):
    """Dense true-space K/V: kp/vp [1, Hkv, P, D], ks/vs [N, Hkv, S, D]. Query j of agent n sits at
    absolute position prefix_end + lens[n] - n_q + j; prefix row i at prefix_start + i, suffix row i
    at prefix_end + i. Returns float64 out [N, Hq, n_q, D], lse [N, Hq, n_q] (0 / -inf: nothing
    visible)."""
    N, Hq, n_q, D = q.shape
    g = Hq // kp.shape[1]
    P = kp.shape[2]
    pend = prefix_start + P if prefix_end is None else prefix_end
    scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.zeros(N, Hq, n_q, D, dtype=torch.float64)
    lse = torch.full((N, Hq, n_q), float("-inf"), dtype=torch.float64)
    for n in range(N):
        L = int(lens[n])
        k = torch.cat([kp[0], ks[n, :, :L]], 1).double().repeat_interleave(g, 0)  # [Hq, P+L, D]
        v = torch.cat([vp[0], vs[n, :, :L]], 1).double().repeat_interleave(g, 0)
        kabs = torch.cat([torch.arange(prefix_start, prefix_start + P), pend + torch.arange(L)])
        for j in range(n_q):
            qa = pend + L - n_q + j
            vis = kabs <= qa
            if window is not None:
                vis &= kabs > qa - window
            if not vis.any():
                continue
            s = torch.einsum("hd,hkd->hk", q[n, :, j].double(), k[:, vis]) * scale
            lse[n, :, j] = torch.logsumexp(s, -1)
            out[n, :, j] = torch.einsum("hk,hkd->hd", torch.softmax(s, -1), v[:, vis])
    return out, lse


def empty_rows(codec, lead) -> Packed:
    """A Packed with zero rows (leading [*lead, 0])."""
    p = codec.encode(torch.zeros(*lead, 1, codec.head_dim))
    return p.index((..., slice(0, 0), slice(None)))


def case(kn, vn, D, Hkv, g, n_q, P, S, lens, *, innerq=False, seed=0, qdtype=torch.float32):
    """Random packed inputs plus the true-space dense K/V the independent computation reads."""
    torch.manual_seed(seed)
    N = len(lens)
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    s = torch.rand(Hkv, D) * 1.5 + 0.5 if innerq else None
    pk = quantize_ref(torch.randn(1, Hkv, P, D), kc, s) if P else empty_rows(kc, (1, Hkv))
    pv = vc.encode(torch.randn(1, Hkv, P, D)) if P else empty_rows(vc, (1, Hkv))
    sk = quantize_ref(torch.randn(N, Hkv, S, D), kc, s) if S else empty_rows(kc, (N, Hkv))
    sv = vc.encode(torch.randn(N, Hkv, S, D)) if S else empty_rows(vc, (N, Hkv))
    unscale = 1 if s is None else s[None, :, None, :]

    def dec(c, p, shape):
        return c.decode(p) if p.shape[-1] else torch.zeros(*shape, D)

    dense = (dec(kc, pk, (1, Hkv, 0)) / unscale, dec(vc, pv, (1, Hkv, 0)),
             dec(kc, sk, (N, Hkv, 0)) / unscale, dec(vc, sv, (N, Hkv, 0)))
    q = torch.randn(N, Hkv * g, n_q, D).to(qdtype)
    return q, (pk, pv, sk, sv), dense, torch.tensor(lens, dtype=torch.int32), kc, vc, s


def defined(lens, n_q):
    """(n, j) of the queries the contract defines: suffix position >= -1 (-1: an empty suffix's
    query, which sees the prefix only); earlier positions are left padding."""
    return [(n, j) for n, L in enumerate(lens) for j in range(n_q) if L - n_q + j >= -1]


CASES = [
    # kn, vn, D, Hkv, g, n_q, P, S, lens, window (W, prefix_start, prefix_end) or None, innerq
    ("q8_0", "turbo3", 64, 2, 3, 1, 37, 9, [0, 1, 5, 9], None, False),
    ("turbo4", "q4_0", 128, 2, 4, 3, 23, 7, [3, 7, 4], None, True),
    ("f16", "turbo2", 64, 1, 1, 2, 19, 6, [6, 2], None, False),
    ("turbo3", "turbo3", 64, 2, 2, 1, 0, 11, [11, 0, 4], None, True),  # no prefix rows
    ("bf16", "turbo8", 64, 2, 2, 2, 29, 0, [0, 0], None, False),  # no suffix storage at all
    ("turbo4", "turbo3", 64, 1, 4, 1, 7, 12, [1, 6, 12], (8, 13, 20), True),  # sliding layer
    ("q8_0", "f16", 128, 2, 2, 3, 5, 10, [3, 10, 7], (4, 0, 5), False),  # window inside the suffix
    ("q4_0", "turbo4", 64, 2, 3, 1, 9, 4, [0, 4, 2], (6, 40, 49), False),  # long document, window
]


@pytest.mark.parametrize("kn,vn,D,Hkv,g,n_q,P,S,lens,win,innerq", CASES)
def test_cascade_reference_equals_dense(kn, vn, D, Hkv, g, n_q, P, S, lens, win, innerq):
    q, packed, dense, sl, kc, vc, s = case(kn, vn, D, Hkv, g, n_q, P, S, lens, innerq=innerq,
                                           seed=D + P + S)
    kw = {} if win is None else dict(window=win[0], prefix_start=win[1], prefix_end=win[2])
    out, lse = cascade_attention_ref(q, *packed, sl, kc, vc, k_innerq=s, sm_scale=0.3, **kw)
    o2, l2 = dense_cascade(q, *dense, sl, sm_scale=0.3, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    for n, j in defined(lens, n_q):
        torch.testing.assert_close(out[n, :, j].double(), o2[n, :, j], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[n, :, j].double(), l2[n, :, j], atol=2e-5, rtol=2e-5)


def test_cascade_reference_takes_codec_names_and_half_queries():
    """The kernel contract's inputs: codec names, float16 q (out in float16, merged in float32)."""
    q, packed, dense, sl, kc, vc, _ = case("q8_0", "turbo3", 128, 2, 4, 1, 45, 6, [5, 0, 3],
                                           qdtype=torch.float16)
    out, lse = cascade_attention_ref(q, *packed, sl, "q8_0", "turbo3")
    o2, l2 = dense_cascade(q, *dense, sl)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), o2, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), l2, atol=1e-4, rtol=1e-4)


def test_query_that_sees_nothing_gets_zero_and_minus_inf():
    """No prefix rows and an empty suffix; or a window that ends before the kept prefix rows."""
    q, packed, _, sl, kc, vc, _ = case("q8_0", "turbo3", 64, 2, 2, 1, 0, 5, [0, 3])
    out, lse = cascade_attention_ref(q, *packed, sl, kc, vc)
    assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all() and out[1].abs().sum() > 0
    # suffix position -1 of a 30-token document is absolute 29; a 3-wide window sees 27..29, and the
    # kept prefix rows sit at 10..14
    q, packed, _, sl, kc, vc, _ = case("turbo4", "q4_0", 64, 1, 2, 1, 5, 4, [0, 2])
    out, lse = cascade_attention_ref(q, *packed, sl, kc, vc, window=3, prefix_start=10,
                                     prefix_end=30)
    assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


def test_chunked_agents_equal_one_block(monkeypatch):
    """A score budget of one agent's block per chunk gives the same result as one block for all."""
    q, packed, _, sl, kc, vc, s = case("turbo4", "turbo3", 64, 2, 3, 2, 31, 8, [8, 0, 5, 2, 7],
                                       innerq=True)
    kw = dict(k_innerq=s, window=6, prefix_start=2, prefix_end=33)
    whole, lw = cascade_attention_ref(q, *packed, sl, kc, vc, **kw)
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 1)
    chunked, lc = cascade_attention_ref(q, *packed, sl, kc, vc, **kw)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lc, lw, atol=1e-6, rtol=1e-6)


def test_prefix_decoded_once_per_call(monkeypatch):
    """However many chunks, K's and V's prefix rows are decoded exactly once, as one [1, Hkv, P]
    block; every other decode is suffix rows."""
    N, Hkv, P, S = 5, 2, 33, 4
    q, (pk, pv, sk, sv), _, sl, kc, vc, _ = case("turbo4", "q8_0", 64, Hkv, 2, 1, P, S,
                                                 [4, 1, 0, 3, 2])
    seen = []
    for c in (kc, vc):
        for name in ("decode", "decode_rotated"):
            orig = getattr(c, name)

            def spy(p, _orig=orig):
                seen.append(tuple(p.shape))
                return _orig(p)

            monkeypatch.setattr(c, name, spy)
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 1)  # one agent per chunk
    cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc)
    assert seen.count((1, Hkv, P)) == 2, seen
    assert all(sh == (1, Hkv, P) or sh[1:] == (Hkv, S) for sh in seen), seen
    assert sum(sh[0] for sh in seen if sh[1:] == (Hkv, S)) == 2 * N  # each agent's suffix once


def test_no_allocation_grows_with_agents_times_prefix(monkeypatch):
    """256 agents over a 4096-row prefix: a dense prefix copy per agent would be 2 GiB (K alone),
    one score block for all agents 32 MiB. With the budget at 8 agents per block no single
    allocation may exceed 4x the prefix's dense float32 size (1 MiB)."""
    N, Hkv, g, P, S, D = 256, 1, 8, 4096, 5, 64
    q, packed, _, sl, kc, vc, _ = case("turbo4", "turbo3", D, Hkv, g, 1, P, S,
                                       [n % (S + 1) for n in range(N)])
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 8 * Hkv * g * P)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, _ = cascade_attention_ref(q, *packed, sl, kc, vc)
    biggest = max(e.self_cpu_memory_usage for e in prof.events())
    assert out.shape == q.shape
    assert biggest <= 4 * Hkv * P * D * 4, f"{biggest / 2**20:.1f} MiB in one allocation"


def test_long_prompt_split_over_query_rows(monkeypatch):
    """One agent's long prompt (n_q = 512 queries x 8 heads over a 2048-row prefix): one score block
    for all its rows would be 32 MiB; with the budget at 64 rows per block no allocation exceeds 2x
    that block (the prefix's dense float32 rows dominate), and the result equals the unsplit one."""
    Hkv, g, n_q, P, S, D = 1, 8, 512, 2048, 512, 64
    q, packed, _, sl, kc, vc, _ = case("q8_0", "turbo3", D, Hkv, g, n_q, P, S, [S])
    whole, lw = cascade_attention_ref(q, *packed, sl, kc, vc)
    block = 64 * P  # float32 elements of a 64-row score block
    monkeypatch.setattr(reference, "_SCORE_BUDGET", block)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        split, ls = cascade_attention_ref(q, *packed, sl, kc, vc)
    biggest = max(e.self_cpu_memory_usage for e in prof.events())
    assert biggest <= max(2 * block * 4, Hkv * P * D * 4), f"{biggest / 2**20:.1f} MiB in one allocation"
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ls, lw, atol=1e-5, rtol=1e-5)
