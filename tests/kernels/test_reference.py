"""reference.py vs plain dense softmax attention over K/V decoded by the DESIGN §3 spec decoder of
tests/codecs (cheap: every K x V pair)."""

import itertools
import math

import pytest
import torch

from polykv.codecs import CODEC_NAMES, get_codec
from polykv.kernels import (attention_decode_ref, cascade_attention_ref, dequantize_ref,
                            merge_attention_ref, quantize_ref)

from ..codecs.test_codecs import spec_decode


def dense_attention(q, k, v, lens, causal, window=None, sm_scale=None):
    """float64 softmax attention over dense K/V [B, Hkv, S, D] with explicit masks."""
    B, Hq, n, D = q.shape
    g = Hq // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * (sm_scale or 1 / math.sqrt(D))
    S = k.shape[2]
    out = torch.zeros(B, Hq, n, D, dtype=torch.float64)
    lse = torch.full((B, Hq, n), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for j in range(n):
            qpos = int(lens[b]) - n + j
            vis = [p for p in range(S) if p < lens[b] and (not causal or p <= qpos)
                   and (window is None or p > qpos - window)]
            if not vis:
                continue
            sc = s[b, :, j, vis]
            lse[b, :, j] = torch.logsumexp(sc, -1)
            out[b, :, j] = torch.einsum("hk,hkd->hd", torch.softmax(sc, -1), v[b][:, vis])
    return out, lse


def _close(a, b, tol=1e-4):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) <= tol


@pytest.mark.parametrize("kn,vn", list(itertools.product(CODEC_NAMES, CODEC_NAMES)))
def test_reference_equals_dense_all_pairs(kn, vn):
    torch.manual_seed(hash((kn, vn)) % 1000)
    B, Hkv, g, n, S, D = 2, 2, 2, 2, 13, 64
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    k = kc.encode(torch.randn(B, Hkv, S, D))
    v = vc.encode(torch.randn(B, Hkv, S, D))
    q = torch.randn(B, Hkv * g, n, D)
    lens = torch.tensor([13, 7], dtype=torch.int32)
    out, lse = attention_decode_ref(q, k, v, kc, vc, kv_lens=lens)
    o2, l2 = dense_attention(q, spec_decode(k, kn, D), spec_decode(v, vn, D), lens, True)
    assert _close(out, o2) and _close(lse, l2)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_reference_gqa_window_innerq(group, window):
    torch.manual_seed(group)
    B, Hkv, n, S, D = 2, 2, 3, 11, 128
    kc, vc = get_codec("turbo4", D), get_codec("turbo3", D)
    s = torch.rand(Hkv, D) * 1.5 + 0.5
    kt = torch.randn(B, Hkv, S, D)
    k = quantize_ref(kt, kc, innerq=s)
    v = vc.encode(torch.randn(B, Hkv, S, D))
    q = torch.randn(B, Hkv * group, n, D)
    lens = torch.tensor([11, 5], dtype=torch.int32)
    out, lse = attention_decode_ref(q, k, v, kc, vc, kv_lens=lens, window=window, k_innerq=s)
    kd = spec_decode(k, "turbo4", D) / s[None, :, None, :].double()  # true-space keys
    o2, l2 = dense_attention(q, kd, spec_decode(v, "turbo3", D), lens, True, window)
    assert _close(out, o2) and _close(lse, l2)


def test_no_visible_key_and_merge_inf():
    D = 64
    kc = get_codec("q8_0", D)
    k = kc.encode(torch.randn(1, 1, 4, D))
    q = torch.randn(1, 1, 1, D)
    out, lse = attention_decode_ref(q, k, k, kc, kc, kv_lens=torch.tensor([0]))
    assert torch.all(out == 0) and torch.isneginf(lse).all()
    o2, l2 = attention_decode_ref(q, k, k, kc, kc)
    m, ml = merge_attention_ref(out, lse, o2, l2)
    assert torch.equal(m, o2) and torch.equal(ml, l2)
    m, ml = merge_attention_ref(out, lse, out, lse)
    assert torch.all(m == 0) and torch.isneginf(ml).all()


@pytest.mark.parametrize("split", [1, 6, 12])
def test_merge_of_two_parts_equals_attention_over_both(split):
    """LSE merge (natural log) of attention over keys [0, split) and [split, S) = dense attention over
    all S keys (no causal mask: every query sees both parts)."""
    torch.manual_seed(split)
    B, H, n, S, D = 2, 2, 3, 13, 64
    kc, vc = get_codec("q8_0", D), get_codec("turbo4", D)
    k, v = kc.encode(torch.randn(B, H, S, D)), vc.encode(torch.randn(B, H, S, D))
    q = torch.randn(B, H, n, D)
    sl = [(slice(None), slice(None), slice(0, split)), (slice(None), slice(None), slice(split, S))]
    parts = [attention_decode_ref(q, k.index(i), v.index(i), kc, vc, causal=False) for i in sl]
    out, lse = merge_attention_ref(*parts[0], *parts[1])
    o2, l2 = dense_attention(q, spec_decode(k, "q8_0", D), spec_decode(v, "turbo4", D),
                             torch.full((B,), S), causal=False)
    assert _close(out, o2) and _close(lse, l2)


@pytest.mark.parametrize("kn,vn", [("q8_0", "turbo3"), ("turbo4", "turbo3"), ("f16", "q4_0"),
                                   ("turbo2", "turbo8")])
def test_cascade_reference_equals_concatenation(kn, vn):
    torch.manual_seed(1)
    N, Hkv, g, n, P, S, D = 3, 2, 4, 1, 17, 6, 64
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, S, D)), vc.encode(torch.randn(N, Hkv, S, D))
    lens = torch.tensor([6, 0, 3], dtype=torch.int32)
    q = torch.randn(N, Hkv * g, n, D)
    out, lse = cascade_attention_ref(q, pk, pv, sk, sv, lens, kc, vc)
    kd = torch.cat([spec_decode(pk, kn, D).expand(N, -1, -1, -1), spec_decode(sk, kn, D)], 2)
    vd = torch.cat([spec_decode(pv, vn, D).expand(N, -1, -1, -1), spec_decode(sv, vn, D)], 2)
    o2, l2 = dense_attention(q, kd, vd, lens + P, True)
    assert _close(out, o2) and _close(lse, l2)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_quantize_dequantize_ref(name):
    """dequantize_ref decodes the DESIGN §3 formats (spec decoder), in true space and, for turbo
    types, in the storage domain (rotated=True; other types: the same values)."""
    c = get_codec(name, 128)
    x = torch.randn(2, 2, 3, 128)
    p = quantize_ref(x, c)
    rotated_spec = spec_decode(p, name, 128, rotated=c.rotated)
    torch.testing.assert_close(dequantize_ref(p, c, torch.float32).double(), spec_decode(p, name, 128),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dequantize_ref(p, c, torch.float32, rotated=True).double(), rotated_spec,
                               atol=1e-5, rtol=1e-5)
    assert dequantize_ref(p, c).dtype == torch.float16


@pytest.mark.parametrize("name", ["turbo4", "q8_0"])
def test_quantize_ref_innerq_scales_before_encoding(name):
    """quantize_ref(x, innerq=s) stores x*s: decoded, it is x*s within the codec's error, and
    dividing by s gives back x (DESIGN §3 InnerQ)."""
    c = get_codec(name, 128)
    x = torch.randn(2, 2, 50, 128)
    s = torch.linspace(0.5, 2.0, 128).repeat(2, 1)
    y = spec_decode(quantize_ref(x, c, innerq=s), name, 128)
    xs = x.double() * s[None, :, None, :].double()
    rel = float(((y - xs) ** 2).sum() / (xs ** 2).sum())
    assert rel < {"turbo4": 0.012, "q8_0": 1e-4}[name]
    assert float(((y - x.double()) ** 2).sum() / (x.double() ** 2).sum()) > 0.1  # the scaling is there
