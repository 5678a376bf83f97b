"""Triton kernels vs reference.py on the same packed data, through the Triton interpreter on CPU
(POLYKV_TRITON_ON_CPU=1; small shapes). On a CUDA machine polykv/bench/gpu_suite.py does the same
at full size."""

import pytest
import torch

from polykv.codecs import CODEC_NAMES, Packed, get_codec
from polykv.kernels.triton_codec import phase_ok
from polykv.kernels import (attention_decode, attention_decode_ref, cascade_attention,
                            cascade_attention_ref, dequantize, dequantize_ref, gather_pages,
                            merge_attention,
                            merge_attention_ref, quantize_into, quantize_ref, triton_available)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.fixture(autouse=True)
def _interpreter(interpreter):
    """Every test of this module through the interpreter (conftest.interpreter)."""


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def lse_ok(a, b):
    fin = torch.isfinite(b)
    return torch.equal(fin, torch.isfinite(a)) and (a[fin] - b[fin]).abs().max().item() < 1e-2


DECODE_CASES = [
    # kn, vn, D, group, n_q, S, lens
    ("q8_0", "turbo3", 128, 4, 1, 77, [77, 30]),
    ("turbo4", "turbo3", 128, 8, 1, 50, [50, 1]),
    ("turbo3", "turbo3", 64, 1, 2, 33, [33, 17]),
    ("f16", "q4_0", 256, 4, 1, 19, [19, 5]),
    ("q4_0", "turbo2", 64, 4, 3, 41, [40, 41]),
    ("turbo8", "q8_0", 256, 1, 1, 23, [23, 23]),
    ("turbo2", "turbo8", 64, 8, 1, 29, [29, 3]),
    ("bf16", "turbo4", 64, 4, 2, 21, [21, 9]),
    ("q8_0", "f16", 512, 2, 1, 9, [9, 4]),
]


@pytest.mark.parametrize("impl", ["tile", "phase"])
@pytest.mark.parametrize("kn,vn,D,group,n_q,S,lens", DECODE_CASES)
def test_decode_matches_reference(kn, vn, D, group, n_q, S, lens, impl):
    torch.manual_seed(D + S)
    B, Hkv = 2, 2
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    if impl == "phase" and not (phase_ok(kc) and phase_ok(vc)):
        pytest.skip("a phase narrower than 16 dims (turbo3 at group 64): tile kernel only")
    k = kc.encode(torch.randn(B, Hkv, S, D))
    v = vc.encode(torch.randn(B, Hkv, S, D))
    q = torch.randn(B, Hkv * group, n_q, D, dtype=torch.float16)
    kv = torch.tensor(lens, dtype=torch.int32)
    out, lse = attention_decode(q, k, v, kc, vc, kv_lens=kv, impl=impl)
    o2, l2 = attention_decode_ref(q, k, v, kc, vc, kv_lens=kv)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel(out, o2) <= 1e-2 and lse_ok(lse, l2)


def test_decode_window_innerq_noncausal_and_empty():
    torch.manual_seed(3)
    B, Hkv, g, n, S, D = 2, 2, 4, 2, 37, 128
    kc, vc = get_codec("turbo4", D), get_codec("turbo3", D)
    s = torch.rand(Hkv, D) * 1.5 + 0.5
    k = quantize_ref(torch.randn(B, Hkv, S, D), kc, innerq=s)
    v = vc.encode(torch.randn(B, Hkv, S, D))
    q = torch.randn(B, Hkv * g, n, D)
    kv = torch.tensor([37, 0], dtype=torch.int32)  # second sequence: no visible key
    for kw in (dict(window=5), dict(causal=False)):
        out, lse = attention_decode(q, k, v, kc, vc, kv_lens=kv, k_innerq=s, **kw)
        o2, l2 = attention_decode_ref(q, k, v, kc, vc, kv_lens=kv, k_innerq=s, **kw)
        assert rel(out, o2) <= 1e-2 and lse_ok(lse, l2)
        assert torch.all(out[1] == 0) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("kn,vn,D,group,lens", [
    ("q8_0", "turbo3", 128, 4, [5, 0, 3]),
    ("turbo4", "turbo3", 64, 8, [0, 0, 0]),
    ("f16", "q4_0", 256, 1, [6, 2, 1]),
    ("q8_0", "turbo3", 256, 2, [4, 1, 6]),  # V rotated in two groups: block-diagonal unrotation
])
def test_cascade_matches_reference(kn, vn, D, group, lens):
    torch.manual_seed(D)
    N, Hkv, n, P, S = 3, 2, 1, 45, 6
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, S, D)), vc.encode(torch.randn(N, Hkv, S, D))
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(N, Hkv * group, n, D, dtype=torch.float16)
    out, lse = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc)
    assert rel(out, o2) <= 1e-2 and lse_ok(lse, l2)


@pytest.mark.parametrize("P,want_tile", [
    (64, 32),   # one split of one 64-key tile at 64-row tiles: 32-row tiles instead
    (256, 32),  # two splits of two key tiles: 32-row tiles (one split of four)
    (512, 64),  # splits of four key tiles: the 64-row tile stays
])
def test_cascade_prefix_row_tile_halves_for_short_splits(monkeypatch, P, want_tile):
    """head_dim 64, more than 32 query rows per KV head (the tile kernel's prefix pass): where the
    planned splits would hold one or two key tiles the pass takes 32-row tiles (BENCHMARKS §5.18);
    the values stay the reference's either way."""
    from polykv.kernels import triton_decode as td

    tiles = []
    real = td.cached_launch

    def record(fn, grid, *args, **kw):
        if fn is td._decode_kernel and kw.get("CAUSAL") is False:  # the prefix pass
            tiles.append(kw["BLOCK_M"])
        return real(fn, grid, *args, **kw)

    monkeypatch.setattr(td, "cached_launch", record)
    torch.manual_seed(P)
    N, Hkv, group, n_q, D = 6, 2, 3, 2, 64  # 36 query rows per KV head
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, 8, D)), vc.encode(torch.randn(N, Hkv, 8, D))
    sl = torch.tensor([3, 8, 5, 1, 7, 2], dtype=torch.int32)
    q = torch.randn(N, Hkv * group, n_q, D, dtype=torch.float16)
    out, lse = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc)
    assert rel(out, o2) <= 1e-2 and lse_ok(lse, l2)
    assert tiles == [want_tile]


@pytest.mark.parametrize("n_q,window", [(1, None), (3, None), (3, 40), (2, 40)])
def test_cascade_output_is_token_major_at_several_query_columns(n_q, window):
    """Several query columns per agent (a verify step): the cascade's out [N, Hq, n_q, D] is a view
    of token-major storage ([N, n_q, Hq, D], what the model reshapes), full and windowed layers;
    one column: contiguous as before. Values = the reference either way."""
    torch.manual_seed(n_q * 7 + (window or 0))
    N, Hkv, group, D, P = 6, 2, 3, 64, 120
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, 12, D)), vc.encode(torch.randn(N, Hkv, 12, D))
    sl = torch.tensor([3, 12, 5, 1, 7, 2], dtype=torch.int32)
    q = torch.randn(N, n_q, Hkv * group, D, dtype=torch.float16).transpose(1, 2)
    out, lse = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc, window=window)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc, window=window)
    assert rel(out, o2) <= 1e-2 and lse_ok(lse, l2)
    assert out.shape == (N, Hkv * group, n_q, D) and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("impl", ["tile", "phase"])
def test_decode_parts_reads_blocked_query_rows_as_the_contiguous_rows(impl):
    """qp [B, Hkv, NB, MB, D] with the blocks apart (a permuted view, as the cascade's prefix pass
    passes every agent's rows): the same partials, bit for bit, as the rows made contiguous — read
    in place by the tile kernel, copied for the phase kernel."""
    from polykv.kernels import dispatch

    td = dispatch._k()[0]  # the kernel modules as dispatch loads them (interpreter patched)

    torch.manual_seed(11)
    N, Hkv, MB, D, P = 5, 2, 3, 64, 200
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    k, v = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    rows = torch.randn(N, Hkv, MB, D, dtype=torch.float16)  # each agent's rows, agents outermost
    blocked = rows.permute(1, 0, 2, 3).unsqueeze(0)  # [1, Hkv, N, MB, D], not contiguous
    assert td._row_blocks(blocked) == (MB * D, MB, Hkv * MB * D)
    lens = torch.tensor([P], dtype=torch.int32)
    kw = dict(causal=False, window=None, sm_scale=0.125, impl=impl, max_split=64)
    got = td.decode_parts(blocked, MB, k, v, kc, vc, lens, **kw)
    want = td.decode_parts(blocked.reshape(1, Hkv, N * MB, D).contiguous(), MB, k, v, kc, vc, lens, **kw)
    assert got.n_splits == want.n_splits > 1
    assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse)


def test_cascade_prefix_pass_reads_the_agents_query_rows_in_place(monkeypatch):
    """The tile kernel's prefix pass of a cascade (head_dim 64: no warp-specialised pass) gets the
    agents' query rows as a view of q — no copy per call — and the values stay the reference's."""
    from polykv.kernels import triton_decode as td

    queries = []
    real = td.cached_launch

    def record(fn, grid, *args, **kw):
        if fn is td._decode_kernel and kw.get("CAUSAL") is False:  # the prefix pass
            queries.append(args[0])
        return real(fn, grid, *args, **kw)

    monkeypatch.setattr(td, "cached_launch", record)
    torch.manual_seed(4)
    N, Hkv, group, D, P = 7, 2, 3, 64, 300
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(N, Hkv, 8, D)), vc.encode(torch.randn(N, Hkv, 8, D))
    sl = torch.tensor([3, 8, 5, 1, 7, 2, 0], dtype=torch.int32)
    q = torch.randn(N, Hkv * group, 1, D, dtype=torch.float16)
    out, lse = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc)
    o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc)
    assert rel(out, o2) <= 1e-2 and lse_ok(lse, l2)
    assert len(queries) == 1 and queries[0].data_ptr() == q.data_ptr()


@pytest.mark.parametrize("kn,vn,D,agents,P,chunk", [
    ("q8_0", "turbo3", 128, 3, 1000, 512),   # 3 chunks, the last one short
    ("turbo4", "turbo3", 64, 9, 700, 256),   # rows per KV head > 16: the tile kernel
    ("f16", "q4_0", 128, 1, 300, 512),       # one chunk
])
def test_cascade_over_prefix_chunks_is_bit_identical(kn, vn, D, agents, P, chunk):
    """The host tier's streamed prefix: the same prefix given as chunks of `chunk` rows gives the
    values of the whole prefix exactly, not up to rounding (splits capped at the chunk rows, as
    PREFIX_CHUNK_ALIGN caps them for the pool's 16k chunks; more splits than the interpreter's
    program target would plan)."""
    torch.manual_seed(P)
    Hkv, group, S = 2, 4, 6
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    sk, sv = kc.encode(torch.randn(agents, Hkv, S, D)), vc.encode(torch.randn(agents, Hkv, S, D))
    sl = torch.randint(0, S + 1, (agents,), dtype=torch.int32)
    q = torch.randn(agents, Hkv * group, 1, D, dtype=torch.float16)
    cut = (slice(None), slice(None))
    chunks = [(pk.index(cut + (slice(r, r + chunk),)), pv.index(cut + (slice(r, r + chunk),)), r)
              for r in range(0, P, chunk)]
    out, lse = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc, prefix_max_split=chunk // 4)
    got, got_lse = cascade_attention(q, None, None, sk, sv, sl, kc, vc, prefix_max_split=chunk // 4,
                                     prefix_chunks=iter(chunks), prefix_rows=P)
    assert torch.equal(got, out) and torch.equal(got_lse, lse)


def test_cascade_chunk_inside_a_split_is_refused():
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    pk, pv = kc.encode(torch.randn(1, 2, 1000, 128)), vc.encode(torch.randn(1, 2, 1000, 128))
    sk, sv = kc.encode(torch.randn(1, 2, 4, 128)), vc.encode(torch.randn(1, 2, 4, 128))
    cut = (slice(None), slice(None))
    chunks = [(pk.index(cut + (slice(r, r + 100),)), pv.index(cut + (slice(r, r + 100),)), r)
              for r in range(0, 1000, 100)]
    q = torch.randn(1, 8, 1, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="inside a split"):
        cascade_attention(q, None, None, sk, sv, torch.tensor([4], dtype=torch.int32), kc, vc,
                          prefix_chunks=chunks, prefix_rows=1000, prefix_max_split=128)


@pytest.mark.parametrize("kn,vn,D,page", [("q8_0", "turbo3", 128, 32), ("turbo4", "f16", 64, 64)])
def test_cascade_paged_suffix_matches_dense(kn, vn, D, page):
    """Suffixes read through a page table (shuffled pages, agents of different lengths, one agent
    spanning three pages, one with none used) equal the same rows laid out densely."""
    torch.manual_seed(page)
    N, Hkv, group, P = 3, 2, 4, 41
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    pk, pv = kc.encode(torch.randn(1, Hkv, P, D)), vc.encode(torch.randn(1, Hkv, P, D))
    n_pages = 8
    pool_k = kc.encode(torch.randn(1, Hkv, n_pages * page, D))
    pool_v = vc.encode(torch.randn(1, Hkv, n_pages * page, D))
    table = torch.tensor([[5, 2, 7], [0, 3, 3], [6, 1, 4]], dtype=torch.int32)
    sl = torch.tensor([2 * page + 5, page - 1, 0], dtype=torch.int32)
    q = torch.randn(N, Hkv * group, 1, D, dtype=torch.float16)
    out, lse = cascade_attention(q, pk, pv, pool_k, pool_v, sl, kc, vc, suffix_pages=table,
                                 page_size=page)
    dk, dv = gather_pages(pool_k, table, page), gather_pages(pool_v, table, page)
    assert dk.codes.shape == (N, Hkv, 3 * page, pool_k.codes.shape[-1])
    assert torch.equal(dk.codes[0, :, page:2 * page], pool_k.codes[0, :, 2 * page:3 * page])
    o2, l2 = cascade_attention_ref(q, pk, pv, dk, dv, sl, kc, vc)
    assert rel(out, o2) <= 1e-2 and lse_ok(lse, l2)


@pytest.mark.parametrize("kn,vn,n_q", [("q8_0", "turbo3", 1), ("turbo4", "q4_0", 3)])
def test_decode_left_padding_equals_unpadded_sequences(kn, vn, n_q):
    """kv_start: rows before it are left padding. Each padded sequence must give exactly what the
    same sequence gives alone, without its padding rows (the reference on the sliced rows)."""
    torch.manual_seed(n_q)
    B, Hkv, g, S, D = 3, 2, 4, 150, 64
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    k, v = kc.encode(torch.randn(B, Hkv, S, D)), vc.encode(torch.randn(B, Hkv, S, D))
    q = torch.randn(B, Hkv * g, n_q, D, dtype=torch.float16)
    start = torch.tensor([0, 37, 129], dtype=torch.int32)  # 129: inside the last row tile
    out, lse = attention_decode(q, k, v, kc, vc, kv_start=start)
    for b, s0 in enumerate(start.tolist()):
        sl = (slice(b, b + 1), slice(None), slice(s0, S))
        o2, l2 = attention_decode_ref(q[b:b + 1], k.index(sl), v.index(sl), kc, vc)
        assert rel(out[b:b + 1], o2) <= 1e-2 and lse_ok(lse[b:b + 1], l2)
    o3, l3 = attention_decode_ref(q, k, v, kc, vc, kv_start=start)  # the reference's own rule
    assert rel(out, o3) <= 1e-2 and lse_ok(lse, l3)


def test_merge_matches_reference():
    torch.manual_seed(0)
    oa, ob = torch.randn(2, 4, 3, 64), torch.randn(2, 4, 3, 64)
    la, lb = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    la[0, 0, 0] = float("-inf")
    la[1, 1, 1] = lb[1, 1, 1] = float("-inf")
    out, lse = merge_attention(oa, la, ob, lb)
    o2, l2 = merge_attention_ref(oa, la, ob, lb)
    assert torch.allclose(out, o2, atol=1e-5) and lse_ok(lse, l2)


def _rows(dst: Packed, starts, T) -> Packed:
    c = torch.stack([dst.codes[b, :, s:s + T] for b, s in enumerate(starts)])
    s_ = None if dst.scales is None else torch.stack([dst.scales[b, :, s:s + T]
                                                       for b, s in enumerate(starts)])
    return Packed(c, s_)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("D", [64, 256])
def test_quantize_into_matches_codec(name, D):
    torch.manual_seed(D)
    c = get_codec(name, D)
    x = torch.randn(2, 2, 5, D) * 3
    x[0, 0, 0] = 0.0  # an all-zero row (zero scale / norm)
    ref = c.encode(x)
    dst = c.empty((2, 2, 12))
    quantize_into(dst, x, c, torch.tensor([3, 7]))
    got = _rows(dst, [3, 7], 5)
    if name == "bf16":  # the interpreter casts fp32 -> bf16 by truncation: at most one ulp
        d = (got.codes.view(torch.int16).int() - ref.codes.view(torch.int16).int()).abs()
        assert d.max() <= 1
        return
    if c.rotated:
        # rotation / norm summed in another order: neighbouring index on a boundary tie at most
        gi, ri = c.indices(got).int(), c.indices(ref).int()
        assert (gi - ri).abs().max() <= 1 and (gi != ri).float().mean() <= 1e-3
        assert torch.allclose(got.scales.float(), ref.scales.float(), rtol=1e-3, atol=0)
    else:
        assert torch.equal(got.codes, ref.codes)
    if ref.scales is not None and not c.rotated:
        assert torch.equal(got.scales, ref.scales)
    # untouched rows stay zero
    assert torch.all(dst.codes[0, :, :3] == 0) and torch.all(dst.codes[1, :, :7] == 0)


@pytest.mark.parametrize("name", ["turbo3", "turbo4", "turbo2", "q8_0"])
def test_quantize_into_fp16_rows_tiles_walked(name):
    # fp16 rows (turbo: the one-dot rotation) and more row tiles than programs, so programs walk
    # several tiles (turbo: 6 tiles of 128 rows per head, 4 programs per head in the interpreter)
    torch.manual_seed(1)
    c = get_codec(name, 128)
    x = (torch.randn(1, 4, 700, 128) * 2).to(torch.float16)
    dst = c.empty((1, 4, 710))
    quantize_into(dst, x, c, torch.tensor([4]))
    got, ref = _rows(dst, [4], 700), c.encode(x.float())
    if c.rotated:
        gi, ri = c.indices(got).int(), c.indices(ref).int()
        assert (gi - ri).abs().max() <= 1 and (gi != ri).float().mean() <= 1e-3
        assert torch.allclose(got.scales.float(), ref.scales.float(), rtol=1e-3, atol=0)
    else:
        assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
    assert torch.all(dst.codes[:, :, :4] == 0) and torch.all(dst.codes[:, :, 704:] == 0)


def test_quantize_into_halves_a_tile_the_device_cannot_hold(monkeypatch):
    """A build over the shared memory (OutOfResources, as turbo8 at head_dim 128 on the H200) is
    retried with half the row tile, the working tile remembered for the shape; an explicit block_t
    is the caller's choice and fails as it is."""
    from triton.runtime.errors import OutOfResources

    from polykv.kernels import triton_quantize as tq

    real, tried = tq._quantize_kernel, []

    class SmallSharedMemory:  # builds only up to 32-row tiles
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append(kw["BLOCK_T"])
                if kw["BLOCK_T"] > 32:
                    raise OutOfResources(1 << 18, 232448, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tq, "_quantize_kernel", SmallSharedMemory())
    monkeypatch.setattr(tq, "_TILE_CAP", {})
    c = get_codec("turbo3", 64)
    x = (torch.randn(1, 2, 150, 64) * 2).to(torch.float16)
    dst = c.empty((1, 2, 160))
    quantize_into(dst, x, c, torch.tensor([2]))
    assert tried == [256, 128, 64, 32]
    got, ref = _rows(dst, [2], 150), c.encode(x.float())
    gi, ri = c.indices(got).int(), c.indices(ref).int()
    assert (gi - ri).abs().max() <= 1 and (gi != ri).float().mean() <= 1e-3
    tried.clear()
    quantize_into(dst, x, c, torch.tensor([2]))
    assert tried == [32]  # remembered
    with pytest.raises(OutOfResources):
        quantize_into(dst, x, c, torch.tensor([2]), block_t=64)


def test_quantize_into_innerq_positions_2d():
    c = get_codec("turbo3", 128)
    s = torch.rand(2, 128) + 0.5
    x = torch.randn(1, 2, 3, 128)
    dst = c.empty((1, 2, 8))
    quantize_into(dst, x, c, torch.tensor([[6, 1, 4]]), innerq=s)
    ref = quantize_ref(x, c, innerq=s)
    got = Packed(dst.codes[:, :, [6, 1, 4]], dst.scales[:, :, [6, 1, 4]])
    assert (c.indices(got) != c.indices(ref)).float().mean() <= 1e-3


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_dequantize_matches_reference(name):
    torch.manual_seed(1)
    for D in (64, 256):
        c = get_codec(name, D)
        p = c.encode(torch.randn(3, 7, D))
        for dt in (torch.float16, torch.float32):
            got = dequantize(p, c, dt)
            assert got.shape == (3, 7, D) and got.dtype == dt
            assert rel(got, dequantize_ref(p, c, dt)) <= 1e-3
        if c.rotated:
            assert rel(dequantize(p, c, torch.float32, rotated=True),
                       c.decode_rotated(p)) <= 1e-6
