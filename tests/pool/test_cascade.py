"""Cascade attention (shared prefix + per-agent suffix, merged by LSE) == attention over the
concatenation, on the same compressed data."""

import math

import pytest
import torch

from polykv.codecs import get_codec
from polykv.pool.attention import cascade_torch


def _dense_reference(q, kp, vp, ks, vs, lens, scale, window=None, prefix_start=0, prefix_end=None):
    N, Hq, n_q, D = q.shape
    Hkv = kp.shape[1]
    g = Hq // Hkv
    P = kp.shape[2]
    pend = prefix_start + P if prefix_end is None else prefix_end
    out = torch.zeros(N, Hq, n_q, D)
    for n in range(N):
        L = int(lens[n])
        k = torch.cat([kp[0], ks[n, :, :L]], 1).repeat_interleave(g, 0)  # [Hq, P+L, D]
        v = torch.cat([vp[0], vs[n, :, :L]], 1).repeat_interleave(g, 0)
        kabs = torch.cat([torch.arange(prefix_start, prefix_start + P), pend + torch.arange(L)])
        for j in range(n_q):
            qa = pend + L - n_q + j
            vis = kabs <= qa
            if window is not None:
                vis &= kabs > qa - window
            if not vis.any():
                continue
            s = torch.einsum("hd,hkd->hk", q[n, :, j], k[:, vis]) * scale
            out[n, :, j] = torch.einsum("hk,hkd->hd", torch.softmax(s, -1), v[:, vis])
    return out


@pytest.mark.parametrize("k,v", [("q8_0", "turbo3"), ("turbo4", "q4_0"), ("f16", "turbo2")])
@pytest.mark.parametrize("n_q", [1, 3])
def test_cascade_equals_concatenation(k, v, n_q):
    torch.manual_seed(0)
    D, Hkv, Hq, P, N, S = 64, 2, 6, 37, 4, 9
    kc, vc = get_codec(k, D), get_codec(v, D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, S, D)), vc.encode(torch.randn(N, Hkv, S, D))
    lens = torch.tensor([0, n_q, 5, S]) if n_q > 1 else torch.tensor([0, 1, 5, S])
    q = torch.randn(N, Hq, n_q, D)
    out, lse = cascade_torch(q, pk, pv, sk, sv, lens, kc, vc)
    ref = _dense_reference(q, kc.decode(pk), vc.decode(pv), kc.decode(sk), vc.decode(sv), lens,
                           1 / math.sqrt(D))
    # agent 0 has an empty suffix: its last query (suffix position -1) sees exactly the prefix.
    # Queries at positions < -1 are left padding (undefined by the contract) and not compared.
    for n in range(N):
        for j in range(n_q):
            if lens[n] - n_q + j >= -1:
                torch.testing.assert_close(out[n, :, j], ref[n, :, j], atol=2e-4, rtol=2e-4)
    assert lse.shape == (N, Hq, n_q) and torch.isfinite(lse).all()


def test_cascade_innerq_and_window():
    torch.manual_seed(1)
    D, Hkv, Hq, P, N, S, W = 64, 1, 4, 7, 3, 12, 8
    kc, vc = get_codec("turbo4", D), get_codec("turbo3", D)
    s = torch.rand(Hkv, D) + 0.5
    kraw = torch.randn(1, Hkv, P, D)
    ksraw = torch.randn(N, Hkv, S, D)
    pk = kc.encode(kraw * s[None, :, None])
    sk = kc.encode(ksraw * s[None, :, None])
    pv, sv = vc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(N, Hkv, S, D))
    lens = torch.tensor([1, 6, 12])
    q = torch.randn(N, Hq, 1, D)
    # a sliding layer keeps only the last W-1 rows of a 20-token document: rows at positions 13..19
    out, _ = cascade_torch(q, pk, pv, sk, sv, lens, kc, vc, k_innerq=s, window=W, prefix_start=13,
                           prefix_end=20)
    ref = _dense_reference(q, kc.decode(pk) / s, vc.decode(pv), kc.decode(sk) / s, vc.decode(sv),
                           lens, 1 / math.sqrt(D), window=W, prefix_start=13, prefix_end=20)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
