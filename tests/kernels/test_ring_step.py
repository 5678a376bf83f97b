"""A recent window's step in one launch (`triton_ring`, `dispatch.ring_step`) through the Triton
interpreter against `reference.ring_step_ref`, bit for bit: the ring after the store and the
segment, for decode and verify steps, padded columns (written to the scratch row, not to the
segment), agents shorter than the window, fp16 and float32 rows, strided k."""

import pytest
import torch

from polykv.codecs import Packed, get_codec
from polykv.kernels import triton_available
from polykv.kernels.reference import ring_step_ref
from polykv.pool.ring import AgentRings

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.fixture(autouse=True)
def _interpreter(interpreter):
    """Every test of this module through the interpreter (conftest.interpreter)."""


def _page_rows(real: torch.Tensor) -> torch.Tensor:
    """Page rows whose padding columns (not real) sit at the pages' scratch row -1."""
    return torch.where(real, torch.zeros_like(real, dtype=torch.int64), -1)


def _ring(g, H: int, rows: int, D: int) -> Packed:
    codes = torch.randint(-127, 128, (H, rows, D), generator=g, dtype=torch.int8)
    return Packed(codes, (torch.rand(H, rows, D // 32, generator=g) + 0.1).half())


def _clone(p: Packed) -> Packed:
    return Packed(p.codes.clone(), p.scales.clone())


@pytest.mark.parametrize("n_q,R,spare,dtype", [(1, 8, 0, torch.float16), (3, 4, 2, torch.float32),
                                               (1, 1, 0, torch.float16), (4, 5, 3, torch.float16)])
def test_ring_step_matches_reference(n_q, R, spare, dtype):
    from polykv.kernels import dispatch

    g = torch.Generator().manual_seed(n_q * 10 + R)
    G, H, D, C = 4, 2, 64, R + spare
    scratch = G * C
    slots = torch.tensor([2, 0, 3, 1])
    lens = torch.tensor([n_q + 9, n_q, n_q + 2 * C + 1, n_q + 1])  # one agent shorter than R
    real = torch.ones(G, n_q, dtype=torch.bool)
    real[3, : n_q - 1] = False  # a left-padded agent (its first columns are not written)
    if n_q == 1:
        real[1] = False  # a padding row of the bucket
    seg_rows, rows, *_ = AgentRings._indices(slots, lens, _page_rows(real), -1, n_q, R, C, scratch, "cpu")
    k = (torch.randn(G, H, n_q, 2 * D, generator=g) * 3).to(dtype)[..., :D]  # strided rows
    v = (torch.randn(G, H, n_q, D, generator=g) * 3).to(dtype)
    ring_k, ring_v = _ring(g, H, scratch + 1, D), _ring(g, H, scratch + 1, D)
    want_k, want_v = _clone(ring_k), _clone(ring_v)
    codec = get_codec("q8_0", D)
    seg_want = [codec.empty((G, H, R - 1 + n_q)) for _ in range(2)]
    ring_step_ref(want_k, want_v, k, v, rows, seg_rows, real, *seg_want)

    seg_k, seg_v = dispatch.ring_step(ring_k, ring_v, k, v, rows, seg_rows, real)
    for got, want in ((seg_k, seg_want[0]), (seg_v, seg_want[1]), (ring_k, want_k), (ring_v, want_v)):
        # the scratch row holds whichever padded column landed last: not compared
        keep = slice(None) if got.codes.dim() == 4 else slice(0, scratch)
        assert torch.equal(got.codes[:, keep], want.codes[:, keep])
        assert torch.equal(got.scales[:, keep], want.scales[:, keep])


@pytest.mark.parametrize("kn,vn,innerq,n_q,spare", [("q8_0", "turbo3", False, 1, 0),
                                                    ("turbo4", "turbo3", True, 3, 2),
                                                    ("q8_0", "q4_0", False, 17, 16)])
def test_ring_step_writes_the_pages_in_its_launch(kn, vn, innerq, n_q, spare, monkeypatch):
    """With pages (the agents' page pools as a `dispatch.KVTarget`) the ring step also writes the
    rows there: the bytes of `quantize_kv_into`, in the ring step's one launch up to
    PAIR_MAX_ROWS rows per agent (past it the pages take their own launch)."""
    from polykv.kernels import dispatch, triton_quantize, triton_ring

    names, real_launch = [], triton_ring.cached_launch

    def spy(fn, grid, *args, **kw):
        names.append(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
        return real_launch(fn, grid, *args, **kw)

    monkeypatch.setattr(triton_ring, "cached_launch", spy)
    monkeypatch.setattr(triton_quantize, "cached_launch", spy)
    g = torch.Generator().manual_seed(n_q)
    G, H, D, R = 3, 2, 64, 2
    C = R + spare
    scratch = G * C
    lens = torch.tensor([n_q + 5, n_q, n_q + 1])
    real = torch.ones(G, n_q, dtype=torch.bool)
    real[2, 0] = n_q == 1  # a left-padded agent where there are several columns
    seg_rows, rows, *_ = AgentRings._indices(torch.tensor([1, 0, 2]), lens, _page_rows(real), -1, n_q, R,
                                                   C, scratch, "cpu")
    k, v = (torch.randn(G, H, n_q, D, generator=g) * 3 for _ in range(2))
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    s = torch.rand(H, D, generator=g) + 0.5 if innerq else None
    page_rows = torch.randperm(64, generator=g)[: G * n_q].reshape(G, n_q)

    def target():
        pk, pv = kc.empty((H, 64)), vc.empty((H, 64))
        shared = lambda p: Packed(p.codes[None].expand(G, *p.codes.shape),  # noqa: E731
                                  p.scales[None].expand(G, *p.scales.shape))
        return pk, pv, dispatch.KVTarget(shared(pk), kc, shared(pv), vc, page_rows, s)

    ring = [_ring(g, H, scratch + 1, D) for _ in range(2)]
    want_ring = [_clone(p) for p in ring]
    want_pk, want_pv, want_pages = target()
    want_seg = dispatch.ring_step(*want_ring, k, v, rows, seg_rows, real)
    want_pages.write(k, v)
    names.clear()
    got_pk, got_pv, pages = target()
    got_seg = dispatch.ring_step(*ring, k, v, rows, seg_rows, real, pages=pages)
    assert names == (["_ring_step_kernel"] if n_q <= triton_quantize.PAIR_MAX_ROWS
                     else ["_ring_step_kernel", "_quantize_kernel", "_quantize_kernel"])
    for got, want in ((got_pk, want_pk), (got_pv, want_pv), *zip(got_seg, want_seg)):
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    for got, want in zip(ring, want_ring):
        assert torch.equal(got.codes[:, :scratch], want.codes[:, :scratch])
        assert torch.equal(got.scales[:, :scratch], want.scales[:, :scratch])


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_a_long_feed_keeps_the_history(path):
    """A prompt joining (n_q > C - R + 1: the ring wraps within the step): the segment is the
    encoding of positions L - W .. L - 1 — its first R - 1 rows read from the ring before the
    step's stores overwrite them — and the ring then holds the last C positions. Against the
    history itself, on the reference and on the kernel (the interpreter), also where agents sit in
    other slots and one column is padding."""
    from polykv.kernels import dispatch
    from polykv.kernels.reference import quantize_ref

    g = torch.Generator().manual_seed(11)
    G, H, D, R, C, n_q, T0 = 3, 2, 64, 4, 6, 12, 9
    codec = get_codec("q8_0", D)
    slots, scratch = torch.tensor([2, 0, 1]), 3 * C
    x = torch.randn(G, H, T0 + n_q, D, generator=g) * 3  # every agent's rows, position by position
    enc = quantize_ref(x, codec)  # [G, H, T, *]
    ring_k, ring_v = _ring(g, H, scratch + 1, D), _ring(g, H, scratch + 1, D)
    for a in range(G):  # the ring before the step: the last C positions of the history
        for p in range(T0 - C, T0):
            for ring in (ring_k, ring_v):
                ring.codes[:, int(slots[a]) * C + p % C] = enc.codes[a, :, p]
                ring.scales[:, int(slots[a]) * C + p % C] = enc.scales[a, :, p]
    real = torch.ones(G, n_q, dtype=torch.bool)
    real[2, 0] = False  # agent 2 feeds n_q - 1 rows: left-padded by one column
    lens = torch.tensor([T0 + n_q, T0 + n_q, T0 + n_q - 1])
    seg_rows, rows, kv_start, *_ = AgentRings._indices(slots, lens, _page_rows(real), -1, n_q, R, C, scratch, "cpu")
    new = x[:, :, T0:].clone()
    new[2, :, 1:] = x[2, :, T0: T0 + n_q - 1]  # agent 2's rows, right-aligned after its padding
    if path == "reference":
        seg_k, seg_v = (codec.empty((G, H, R - 1 + n_q)) for _ in range(2))
        ring_step_ref(ring_k, ring_v, new, new, rows, seg_rows, real, seg_k, seg_v)
    else:
        seg_k, seg_v = dispatch.ring_step(ring_k, ring_v, new, new, rows, seg_rows, real, wraps=True)
    W = R - 1 + n_q
    for a in range(G):
        L = int(lens[a])
        for i in range(W):
            p = L - W + i
            if a == 2 and i == W - n_q:
                continue  # the padding column's row: not a key (kv_start / the mask skip it)
            for seg in (seg_k, seg_v):
                assert torch.equal(seg.codes[a, :, i], enc.codes[a, :, p]), (path, a, i)
                assert torch.equal(seg.scales[a, :, i], enc.scales[a, :, p]), (path, a, i)
        for p in range(L - C, L):
            for ring in (ring_k, ring_v):
                assert torch.equal(ring.codes[:, int(slots[a]) * C + p % C], enc.codes[a, :, p]), (path, a, p)


@pytest.mark.parametrize("n_q,R,C,wraps", [(8, 4, 6, True), (3, 4, 6, False)])
def test_ring_step_writes_the_wide_segments(n_q, R, C, wraps):
    """A split step's joining agents (`dispatch.ring_step(wide=(idx, pos))`): the kernel's launch
    also writes their segments, [J, Hkv, W] — the step's own segment rows of agents idx, bit for
    bit (as the torch path's gather), the ring and the segment as without them; a long feed that
    wraps the ring included."""
    from polykv.kernels import dispatch

    g = torch.Generator().manual_seed(n_q + C)
    G, H, D = 4, 2, 64
    scratch = G * C
    slots = torch.tensor([1, 3, 0, 2])
    lens = torch.tensor([n_q + 2, n_q + 7, n_q, n_q + 1])
    real = torch.ones(G, n_q, dtype=torch.bool)
    real[0, 0] = False  # a left-padded agent among the wide ones
    seg_rows, rows, *_ = AgentRings._indices(slots, lens, _page_rows(real), -1, n_q, R, C, scratch, "cpu")
    k, v = (torch.randn(G, H, n_q, D, generator=g) * 3 for _ in range(2))
    idx = torch.tensor([3, 0])
    pos = torch.full((G,), -1, dtype=torch.long)
    pos[idx] = torch.arange(2)
    ring = [_ring(g, H, scratch + 1, D) for _ in range(2)]
    plain = [_clone(p) for p in ring]
    want = dispatch.ring_step(*plain, k, v, rows, seg_rows, real, wraps=wraps)
    got = dispatch.ring_step(*ring, k, v, rows, seg_rows, real, wraps=wraps, wide=(idx, pos))
    for a, b in zip(got[:2], want):  # the step's own segment: as without wide agents
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    for wide, seg in zip(got[2:], want):
        assert wide.codes.shape[0] == 2
        assert torch.equal(wide.codes, seg.codes[idx]) and torch.equal(wide.scales, seg.scales[idx])
    for a, b in zip(ring, plain):
        assert torch.equal(a.codes[:, :scratch], b.codes[:, :scratch])
