"""The pool's cascade entry (`polykv.pool.attention.cascade_attention`) on CPU: paged suffixes (read
through the page table, `suffix_rows` per agent), sliding windows and InnerQ, against an independent
dense softmax over each agent's prefix + suffix; and it runs the one reference there."""

import pytest
import torch

from polykv.codecs import get_codec
from polykv.kernels import reference
from polykv.kernels.reference import quantize_ref
from polykv.pool import attention
from polykv.pool.attention import cascade_attention
from tests.kernels.test_reference_cascade import dense_cascade

PAGE = 4


def paged_case(kn, vn, D, Hkv, g, n_q, P, lens, table, *, innerq=False, seed=0):
    """Prefix [1, Hkv, P]; suffix rows of agent n: row j in pool row table[n][j // PAGE] * PAGE +
    j % PAGE of a page pool [1, Hkv, 8 * PAGE]. Returns the packed inputs and the true-space dense
    K/V the independent computation reads (each agent's rows laid out by hand)."""
    torch.manual_seed(seed)
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    s = torch.rand(Hkv, D) + 0.5 if innerq else None
    pk = quantize_ref(torch.randn(1, Hkv, P, D), kc, s)
    pv = vc.encode(torch.randn(1, Hkv, P, D))
    rows = 8 * PAGE
    pool_k = quantize_ref(torch.randn(1, Hkv, rows, D), kc, s)
    pool_v = vc.encode(torch.randn(1, Hkv, rows, D))
    unscale = 1 if s is None else s[:, None, :]
    dk, dv = kc.decode(pool_k)[0] / unscale, vc.decode(pool_v)[0]  # [Hkv, rows, D]
    S = max(lens)
    ks, vs = torch.zeros(len(lens), Hkv, S, D), torch.zeros(len(lens), Hkv, S, D)
    for n, L in enumerate(lens):
        for j in range(L):
            r = table[n][j // PAGE] * PAGE + j % PAGE
            ks[n, :, j], vs[n, :, j] = dk[:, r], dv[:, r]
    dense = (kc.decode(pk) / (1 if s is None else s[None, :, None, :]), vc.decode(pv), ks, vs)
    q = torch.randn(len(lens), Hkv * g, n_q, D)
    sl = torch.tensor(lens, dtype=torch.int32)
    return q, (pk, pv, pool_k, pool_v), dense, sl, torch.tensor(table, dtype=torch.int32), kc, vc, s


@pytest.mark.parametrize("kn,vn,D,g,n_q,P,lens,table,win,innerq", [
    # full layer; agents of 0, 1, 5 and 9 rows over shuffled pages (suffix_rows 9 < 3 pages)
    ("q8_0", "turbo3", 64, 3, 1, 37, [0, 1, 5, 9],
     [[0, 0, 0], [6, 0, 0], [2, 5, 0], [7, 1, 3]], None, False),
    ("turbo4", "q4_0", 128, 2, 3, 23, [3, 9, 6], [[4, 0, 0], [1, 6, 2], [3, 7, 0]], None, True),
    # Gemma-style sliding layer: the last W-1 = 7 rows of a 20-token document sit at 13..19
    ("turbo4", "turbo3", 64, 4, 1, 7, [1, 6, 11], [[5, 0, 0], [2, 0, 0], [0, 3, 6]], (8, 13, 20),
     True),
    ("f16", "turbo2", 64, 2, 2, 3, [2, 10, 5], [[1, 0, 0], [0, 4, 7], [6, 2, 0]], (4, 9, 12),
     False),
])
def test_pool_cascade_equals_dense(kn, vn, D, g, n_q, P, lens, table, win, innerq):
    Hkv = 2
    q, (pk, pv, pool_k, pool_v), dense, sl, tab, kc, vc, s = paged_case(
        kn, vn, D, Hkv, g, n_q, P, lens, table, innerq=innerq, seed=P)
    kw = {} if win is None else dict(window=win[0], prefix_start=win[1], prefix_end=win[2])
    out, lse = cascade_attention(q, pk, pv, pool_k, pool_v, sl, kc, vc, k_innerq=s,
                                 suffix_pages=tab, page_size=PAGE, suffix_rows=max(lens), **kw)
    o2, l2 = dense_cascade(q, *dense, sl, **kw)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    for n, L in enumerate(lens):
        for j in range(n_q):
            if L - n_q + j >= -1:  # earlier positions are left padding
                torch.testing.assert_close(out[n, :, j].double(), o2[n, :, j], atol=2e-5,
                                           rtol=2e-5)
                torch.testing.assert_close(lse[n, :, j].double(), l2[n, :, j], atol=2e-5,
                                           rtol=2e-5)


@pytest.mark.parametrize("win", [None, (8, 13, 20)])
def test_pool_cascade_on_cpu_is_the_reference(monkeypatch, win):
    """On CPU (full and sliding layers) the pool calls reference.cascade_attention_ref, bit for bit,
    with the agents' rows gathered densely."""
    q, (pk, pv, pool_k, pool_v), _, sl, tab, kc, vc, s = paged_case(
        "turbo4", "turbo3", 64, 2, 2, 1, 7, [1, 6, 11], [[5, 0, 0], [2, 0, 0], [0, 3, 6]],
        innerq=True)
    kw = {} if win is None else dict(window=win[0], prefix_start=win[1], prefix_end=win[2])
    calls = []

    def spy(*a, **k):
        calls.append(k)
        return reference.cascade_attention_ref(*a, **k)

    monkeypatch.setattr(attention, "cascade_attention_ref", spy)
    out, lse = cascade_attention(q, pk, pv, pool_k, pool_v, sl, kc, vc, k_innerq=s,
                                 suffix_pages=tab, page_size=PAGE, suffix_rows=11, **kw)
    assert len(calls) == 1 and calls[0].get("window") == kw.get("window")
    from polykv.kernels.dispatch import gather_pages

    sk, sv = (gather_pages(p, tab, PAGE).index((slice(None), slice(None), slice(0, 11)))
              for p in (pool_k, pool_v))
    o2, l2 = reference.cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc, k_innerq=s, **kw)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_pool_sliding_layer_takes_the_kernels(monkeypatch):
    """A sliding-window layer (the document's last rows, paged suffixes) goes to the kernels'
    windowed cascade where they run (the interpreter here), not to the reference; whole and
    streamed in chunks (later chunks: lengths that place the queries, no suffix row) it gives the
    reference's values."""
    from polykv.kernels import dispatch
    from polykv.pool.attention import streamed_cascade_attention

    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")
    monkeypatch.delenv("POLYKV_FORCE_REFERENCE", raising=False)
    torch.manual_seed(3)
    N, Hkv, g, D, page, W, P, start = 3, 2, 4, 128, 32, 48, 47, 153  # rows 153..199 of a 200-token doc
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    pool_k, pool_v = (c.encode(torch.randn(1, Hkv, 4 * page, D)) for c in (kc, vc))
    tab = torch.tensor([[3, 1], [0, 2], [2, 2]], dtype=torch.int32)
    sl = torch.tensor([40, 1, 20], dtype=torch.int32)
    q = torch.randn(N, Hkv * g, 1, D, dtype=torch.float16)
    kw = dict(window=W, prefix_start=start, prefix_end=start + P, suffix_pages=tab, page_size=page)
    calls = []
    monkeypatch.setattr(attention, "cascade_attention_ref", lambda *a, **k: calls.append(1))
    kernel_calls = []
    real = dispatch._windowed_cascade
    monkeypatch.setattr(dispatch, "_windowed_cascade",
                        lambda *a, **k: kernel_calls.append(1) or real(*a, **k))
    out, lse = cascade_attention(q, pk, pv, pool_k, pool_v, sl, kc, vc, suffix_rows=40, **kw)
    assert not calls and kernel_calls
    sk, sv = (dispatch.gather_pages(p, tab, page) for p in (pool_k, pool_v))
    ref_kw = dict(window=W, prefix_start=start, prefix_end=start + P)
    o2, l2 = reference.cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc, **ref_kw)
    assert _rel(out, o2) < 1e-2 and (lse - l2).abs().max() < 1e-2
    cut = lambda p, a, b: p.index((slice(None), slice(None), slice(a, b)))  # noqa: E731
    chunks = [(cut(pk, r, r + 16), cut(pv, r, r + 16), r) for r in range(0, P, 16)]
    got, got_lse = streamed_cascade_attention(q, chunks, pool_k, pool_v, sl, kc, vc,
                                              prefix_end=start + P, window=W, prefix_start=start,
                                              suffix_pages=tab, page_size=page, suffix_rows=40)
    assert _rel(got, o2) < 1e-2 and (got_lse - l2).abs().max() < 1e-2
