"""K and V of a step written in one launch (`dispatch.quantize_kv_into`, issue F): the same bytes as
two `quantize_into` launches — the same tile code — through the Triton interpreter on CPU, for the
codec pairs the caches hold, InnerQ keys, fp16 / fp32 rows, positions per row and a destination
shared by every sequence (batch stride 0: the pool's page pools). On the torch path (no kernels) it
is the two `quantize_into` calls."""

import pytest
import torch

from polykv.codecs import Packed, get_codec
from polykv.kernels import dispatch, quantize_into, triton_available
from polykv.kernels import triton_quantize as tq

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.fixture(autouse=True)
def _interpreter(interpreter):
    """Every test of this module through the interpreter (conftest.interpreter)."""


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels `triton_quantize` launches."""
    names, real = [], tq.cached_launch

    def spy(fn, grid, *args, **kw):
        names.append(fn.__name__ if hasattr(fn, "__name__") else fn.fn.__name__)
        return real(fn, grid, *args, **kw)

    monkeypatch.setattr(tq, "cached_launch", spy)
    return names


def _same(a: Packed, b: Packed) -> None:
    assert torch.equal(a.codes, b.codes)
    assert (a.scales is None) == (b.scales is None)
    if a.scales is not None:
        assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("kn,vn,D,T,innerq,dtype", [
    ("q8_0", "turbo3", 128, 1, False, torch.float32),  # the default pair, a decode step
    ("q8_0", "turbo3", 64, 5, False, torch.float16),  # a verify step, fp16 rows (one-dot rotation)
    ("turbo4", "turbo3", 128, 16, True, torch.float32),  # InnerQ keys, the largest paired step
    ("f16", "q4_0", 64, 3, False, torch.float32),
    ("q8_0", "q8_0", 64, 2, False, torch.float16),  # a recent ring's pair
    ("turbo3", "turbo2", 256, 1, True, torch.float16),
])
def test_pair_writes_the_bytes_of_two_launches(kn, vn, D, T, innerq, dtype, launches):
    torch.manual_seed(D + T)
    B, H, S = 3, 2, 40
    kc, vc = get_codec(kn, D), get_codec(vn, D)
    k, v = (torch.randn(B, H, T, D) * 2).to(dtype), (torch.randn(B, H, T, D) * 2).to(dtype)
    k[0, 0, 0] = 0.0  # an all-zero row (zero scale / norm)
    s = torch.rand(H, D) + 0.5 if innerq else None
    pos = torch.stack([torch.randperm(S)[:T] for _ in range(B)])  # rows anywhere, per sequence
    want_k, want_v = kc.empty((B, H, S)), vc.empty((B, H, S))
    quantize_into(want_k, k, kc, pos, innerq=s)
    quantize_into(want_v, v, vc, pos)
    launches.clear()
    got_k, got_v = kc.empty((B, H, S)), vc.empty((B, H, S))
    dispatch.quantize_kv_into(got_k, k, kc, got_v, v, vc, pos, innerq=s)
    assert launches == ["_quantize_pair_kernel"]
    _same(got_k, want_k)
    _same(got_v, want_v)


def test_pair_into_a_shared_page_pool():
    """The pool's suffix pages: one [Hkv, rows] pool seen by every sequence (batch stride 0), each
    sequence's rows at its own pool rows."""
    torch.manual_seed(3)
    G, H, D, rows = 4, 2, 64, 30
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    k, v = torch.randn(G, H, 1, D), torch.randn(G, H, 1, D)
    pos = torch.tensor([[7], [21], [0], [29]])

    def shared(p: Packed) -> Packed:
        return Packed(p.codes[None].expand(G, *p.codes.shape), p.scales[None].expand(G, *p.scales.shape))

    want_k, want_v = kc.empty((H, rows)), vc.empty((H, rows))
    quantize_into(shared(want_k), k, kc, pos)
    quantize_into(shared(want_v), v, vc, pos)
    got_k, got_v = kc.empty((H, rows)), vc.empty((H, rows))
    dispatch.quantize_kv_into(shared(got_k), k, kc, shared(got_v), v, vc, pos)
    _same(got_k, want_k)
    _same(got_v, want_v)
    assert torch.all(got_k.codes[:, 1:7] == 0)  # rows no sequence wrote stay untouched


def test_longer_writes_take_two_launches(launches):
    """More than PAIR_MAX_ROWS rows per sequence (a prompt, a document chunk): K and V apart, with
    their own row tiles."""
    kc, vc = get_codec("q8_0", 64), get_codec("turbo3", 64)
    T = tq.PAIR_MAX_ROWS + 1
    k, v = torch.randn(1, 2, T, 64), torch.randn(1, 2, T, 64)
    got_k, got_v = kc.empty((1, 2, T)), vc.empty((1, 2, T))
    dispatch.quantize_kv_into(got_k, k, kc, got_v, v, vc, 0)
    assert launches == ["_quantize_kernel", "_quantize_kernel"]
    want_k, want_v = kc.empty((1, 2, T)), vc.empty((1, 2, T))
    quantize_into(want_k, k, kc, 0)
    quantize_into(want_v, v, vc, 0)
    _same(got_k, want_k)
    _same(got_v, want_v)
