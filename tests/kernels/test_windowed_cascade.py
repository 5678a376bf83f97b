"""The cascade of a sliding-window layer on the kernels (dispatch.cascade_attention with window=,
issue G) against cascade_attention_ref, through the Triton interpreter on CPU (small shapes):
windows that reach back into the shared prefix or stay in the suffix, a prefix that is itself only
a window of the document (prefix_start > 0), a gap between prefix and suffix, several queries per
agent, paged suffixes. polykv/bench/gpu_suite.py checks the same at full size on the GPU."""

import pytest
import torch

from polykv.codecs import get_codec
from polykv.kernels import (cascade_attention, cascade_attention_ref, gather_pages,
                            triton_available)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.fixture(autouse=True)
def _interpreter(interpreter):
    """Every test of this module through the interpreter (conftest.interpreter)."""


def _close(out, lse, o2, l2):
    fin = torch.isfinite(l2)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - l2[fin]).abs().max().item() < 1e-2
    err = float((out.double() - o2.double()).norm() / o2.double().norm().clamp_min(1e-30))
    assert err <= 1e-2, err


@pytest.mark.parametrize("kn,vn,D,group,n_q,window,P,prefix_start,gap,lens", [
    # agents whose windows reach into the prefix by different amounts, one past it entirely
    ("q8_0", "turbo3", 128, 4, 1, 40, 150, 0, 0, [1, 17, 39, 45]),
    # the prefix is the document's last rows only (prefix_start > 0), turbo keys (rotated q)
    ("turbo4", "turbo3", 64, 2, 1, 33, 70, 500, 0, [1, 32, 5, 20]),
    # several queries per agent: each row's window starts one row later; a suffix shorter than its
    # queries (the first rows sit inside the prefix: causal there too)
    ("q8_0", "q4_0", 64, 4, 3, 24, 90, 0, 0, [1, 10, 30, 25]),
    # the suffix starts after a gap (prefix_end beyond the prefix's last row); head_dim 256
    ("f16", "turbo3", 256, 1, 2, 64, 100, 0, 7, [2, 40, 66, 9]),
])
def test_windowed_cascade_matches_reference(kn, vn, D, group, n_q, window, P, prefix_start, gap,
                                            lens):
    torch.manual_seed(D + window)
    N, Hkv, S = len(lens), 2, max(lens) + 3
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, S, D)), vc.encode(torch.randn(N, Hkv, S, D))
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(N, Hkv * group, n_q, D, dtype=torch.float16)
    innerq = torch.rand(Hkv, D) + 0.5 if kc.rotated else None
    kw = dict(window=window, prefix_start=prefix_start, prefix_end=prefix_start + P + gap,
              k_innerq=innerq)
    out, lse = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc, **kw)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc, **kw)
    _close(out, lse, o2, l2)
    # the window matters here: without it the same call gives other values
    o3, _ = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc, k_innerq=innerq)
    assert (o3.float() - o2.float()).abs().max() > 1e-2


def test_windowed_cascade_over_several_splits():
    """Splits of 64 keys (split_len): windows that start inside, at and before a split, 16 query
    rows per KV head (4 heads x n_q 4)."""
    torch.manual_seed(9)
    N, Hkv, group, n_q, D, P, window = 4, 2, 4, 4, 128, 300, 100
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, 200, D)), vc.encode(torch.randn(N, Hkv, 200, D))
    sl = torch.tensor([4, 37, 99, 200], dtype=torch.int32)
    q = torch.randn(N, Hkv * group, n_q, D, dtype=torch.float16)
    out, lse = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc, window=window, split_len=64)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc, window=window)
    _close(out, lse, o2, l2)


def test_windowed_cascade_reads_a_paged_suffix():
    torch.manual_seed(5)
    N, Hkv, group, D, P, page, window = 3, 2, 4, 128, 120, 32, 40
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    pool_k, pool_v = (c.encode(torch.randn(1, Hkv, 6 * page, D)) for c in (kc, vc))
    table = torch.tensor([[4, 1, 5], [0, 2, 2], [3, 3, 3]], dtype=torch.int32)
    sl = torch.tensor([2 * page + 3, 9, 0], dtype=torch.int32)
    q = torch.randn(N, Hkv * group, 1, D, dtype=torch.float16)
    out, lse = cascade_attention(q, pk, pv, pool_k, pool_v, sl, kc, vc, suffix_pages=table,
                                 page_size=page, window=window)
    dk, dv = gather_pages(pool_k, table, page), gather_pages(pool_v, table, page)
    o2, l2 = cascade_attention_ref(q, pk, pv, dk, dv, sl, kc, vc, window=window)
    _close(out, lse, o2, l2)


def _segment(lens: list[int], R: int, n_q: int, Hkv: int, D: int):
    """A recent window's segment for agents of suffix lengths `lens` (polykv.pool.ring's layout:
    R - 1 + n_q q8_0 rows ending at each agent's last position) and the lengths of their older
    rows, max(0, L - R)."""
    from polykv.kernels.reference import RecentSegment

    rc = get_codec("q8_0", D)
    w = R - 1 + n_q
    L = torch.tensor(lens, dtype=torch.int32)
    seg = RecentSegment(rc.encode(torch.randn(len(lens), Hkv, w, D)),
                        rc.encode(torch.randn(len(lens), Hkv, w, D)), rc, R,
                        (w - L).clamp(0, w).to(torch.int32))
    return seg, (L - R).clamp_min(0)


@pytest.mark.parametrize("kn,vn,D,group,n_q,window,R,P,gap,lens", [
    # windows into the prefix by different amounts; agents shorter than R (the segment starts
    # later) and shorter than R - 1 + n_q; turbo keys (rotated q, InnerQ)
    ("turbo4", "turbo3", 64, 2, 1, 24, 6, 90, 0, [1, 4, 6, 7, 30]),
    ("q8_0", "turbo3", 128, 4, 3, 20, 5, 70, 0, [3, 5, 6, 9, 40]),
    # a gap between prefix and suffix
    ("q8_0", "q4_0", 64, 4, 2, 33, 7, 100, 5, [2, 8, 20]),
])
def test_windowed_cascade_with_a_recent_segment_matches_reference(kn, vn, D, group, n_q, window,
                                                                   R, P, gap, lens):
    """A sliding layer's cascade with a recent window's segment (`recent=`, the pool's layers with
    rings): the prefix seen from the real lengths, the older suffix rows within window - R, the
    segment as a third pass of the one combine — the reference's values."""
    torch.manual_seed(D + R)
    N, Hkv = len(lens), 2
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    S = max(lens) + 2
    sk, sv = kc.encode(torch.randn(N, Hkv, S, D)), vc.encode(torch.randn(N, Hkv, S, D))
    seg, older = _segment(lens, R, n_q, Hkv, D)
    q = torch.randn(N, Hkv * group, n_q, D, dtype=torch.float16)
    innerq = torch.rand(Hkv, D) + 0.5 if kc.rotated else None
    kw = dict(window=window, prefix_end=P + gap, k_innerq=innerq, recent=seg)
    out, lse = cascade_attention(q, pk, pv, sk, sv, older, kc, vc, **kw)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, older, kc, vc, **kw)
    _close(out, lse, o2, l2)
    # the prefix is placed by the real lengths: placed by the older rows' lengths it differs
    o3, _ = cascade_attention_ref(q, pk, pv, sk, sv, older, kc, vc,
                                  **{**kw, "recent": seg._replace(kv_start=torch.zeros_like(seg.kv_start))})
    assert (o3.float() - o2.float()).abs().max() > 1e-2


@pytest.mark.parametrize("kn,window", [("q8_0", 20), ("q8_0", None), ("turbo4", 20), ("turbo4", None)])
def test_a_recent_segment_reads_the_prepared_query_rows(kn, window, monkeypatch):
    """A verify step's q (n_q > 1, strided as the model's projection leaves it) is copied into
    query rows once per cascade: where K leaves q plain (q8_0), the recent segment's pass reads
    those rows; turbo keys rotate q, so the segment gets plain rows of its own."""
    from polykv.kernels import dispatch

    torch.manual_seed(3)
    N, Hkv, D, n_q, R, P = 3, 2, 64, 2, 5, 70
    kc, vc = get_codec(kn, D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, 12, D)), vc.encode(torch.randn(N, Hkv, 12, D))
    seg, older = _segment([3, 9, 12], R, n_q, Hkv, D)
    q = torch.randn(N, n_q, Hkv * 2, D, dtype=torch.float16).transpose(1, 2)  # [N, Hq, n_q, D], strided
    innerq = torch.rand(Hkv, D) + 0.5 if kc.rotated else None
    preps, prep = [], dispatch._prep_q

    def counted(*a, **k):
        preps.append(a[1])
        return prep(*a, **k)

    monkeypatch.setattr(dispatch, "_prep_q", counted)
    kw = dict(window=window, k_innerq=innerq, recent=seg)
    out, lse = cascade_attention(q, pk, pv, sk, sv, older, kc, vc, **kw)
    assert len(preps) == (2 if kc.rotated else 1)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, older, kc, vc, **kw)
    _close(out, lse, o2, l2)


def test_windowed_cascade_with_only_a_recent_segment():
    """No older row in any window (a gap past the window, no suffix rows): the segment alone."""
    from polykv.kernels import attention_decode_ref

    torch.manual_seed(4)
    Hkv, D, window, R = 2, 64, 16, 4
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    # the prefix is read from a multiple of 64 rows below the earliest window: 64 rows and a gap
    # of a window leave no prefix tile to read
    pk, pv = kc.encode(torch.randn(1, Hkv, 64, D)), vc.encode(torch.randn(1, Hkv, 64, D))
    sk, sv = kc.empty((2, Hkv, 0), "cpu"), vc.empty((2, Hkv, 0), "cpu")
    seg, older = _segment([2, 4], R, 1, Hkv, D)
    q = torch.randn(2, Hkv * 2, 1, D, dtype=torch.float16)
    out, lse = cascade_attention(q, pk, pv, sk, sv, older, kc, vc, window=window,
                                 prefix_end=64 + window, recent=seg)
    o2, l2 = attention_decode_ref(q, seg.k, seg.v, seg.codec, seg.codec, causal=True, window=R,
                                  kv_start=seg.kv_start)
    _close(out, lse, o2, l2)


def test_windowed_cascade_refuses_prefix_chunks():
    kc, vc = get_codec("q8_0", 64), get_codec("turbo3", 64)
    pk, pv = kc.encode(torch.randn(1, 1, 64, 64)), vc.encode(torch.randn(1, 1, 64, 64))
    sk, sv = kc.encode(torch.randn(1, 1, 4, 64)), vc.encode(torch.randn(1, 1, 4, 64))
    q = torch.randn(1, 2, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="prefix_chunks"):
        cascade_attention(q, None, None, sk, sv, torch.tensor([4], dtype=torch.int32), kc, vc,
                          prefix_chunks=[(pk, pv, 0)], prefix_rows=64, window=16)


def test_combine_reads_more_splits_than_one_tile():
    """More splits than a combine tile holds (triton_decode.COMBINE_CHUNK): read chunk by chunk,
    the reference's values (a full-attention layer with one KV head plans up to 512 splits)."""
    from polykv.kernels import attention_decode, attention_decode_ref
    from polykv.kernels import triton_decode as td

    torch.manual_seed(2)
    S, D = td.COMBINE_CHUNK * 64 + 130, 128
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    k, v = kc.encode(torch.randn(1, 1, S, D)), vc.encode(torch.randn(1, 1, S, D))
    q = torch.randn(1, 4, 1, D, dtype=torch.float16)
    out, lse = attention_decode(q, k, v, kc, vc, split_len=64)  # (imports the kernels first)
    parts = td.decode_parts(q.reshape(1, 1, 4, D).float(), 1, k, v, kc, vc,
                            torch.tensor([S], dtype=torch.int32), causal=True, window=None,
                            sm_scale=D ** -0.5, split_len=64)
    assert parts.n_splits > td.COMBINE_CHUNK
    o2, l2 = attention_decode_ref(q, k, v, kc, vc)
    _close(out, lse, o2, l2)


def test_windowed_cascade_launches_only_its_first_pass_as_a_dependent(monkeypatch):
    """Under programmatic dependent launch (forced on here; the interpreter runs the launches
    without it) only the first split pass and the combine launch as dependents: the suffix and
    segment passes queued behind another pass wait for it (BENCHMARKS §5.17). The values stay
    the reference's."""
    from polykv.kernels import triton_decode as td

    launched = []

    def record(fn, grid, *args, plan=0, **consts):
        launched.append((fn, consts.pop("launch_pdl", False)))
        consts.pop("PDL", None)
        fn[grid](*args, **consts)

    monkeypatch.setattr(td, "pdl_ok", lambda dev: True)
    monkeypatch.setattr(td, "cached_launch", record)
    torch.manual_seed(5)
    D, Hkv, window, R, lens = 128, 2, 24, 6, [3, 9, 30]  # head_dim 128: the phase kernel
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, 90, D)), vc.encode(torch.randn(1, Hkv, 90, D))
    sk, sv = kc.encode(torch.randn(3, Hkv, 32, D)), vc.encode(torch.randn(3, Hkv, 32, D))
    seg, older = _segment(lens, R, 1, Hkv, D)
    q = torch.randn(3, Hkv * 4, 1, D, dtype=torch.float16)
    kw = dict(window=window, prefix_end=90, recent=seg)
    out, lse = cascade_attention(q, pk, pv, sk, sv, older, kc, vc, **kw)
    _close(out, lse, *cascade_attention_ref(q, pk, pv, sk, sv, older, kc, vc, **kw))
    passes = [(fn, pdl) for fn, pdl in launched if fn.__name__.endswith("decode_kernel")]
    assert passes == [(td._phase_decode_kernel, True), (td._phase_decode_kernel, False),
                      (td._phase_decode_kernel, False)]
    assert [pdl for fn, pdl in launched if fn.__name__.startswith("_combine")] == [True]
