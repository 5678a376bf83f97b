"""The split combine (`triton_decode.combine_splits`) through the Triton interpreter against a
torch merge of the same partials: both kernels (one program per row; BLOCK_R rows per program with
the rotation on the tensor cores), the cascade's heads-major first pass, a second pass, rows with no
keys, split counts that do not fill a tile, storage domain and true space."""

import pytest
import torch

from polykv.codecs import get_codec
from polykv.codecs.rotation import rotation_matrix
from polykv.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.fixture(autouse=True)
def _interpreter(interpreter):
    """Every test of this module through the interpreter (conftest.interpreter)."""


def _parts(g, rows: int, n_splits: int, D: int):
    from polykv.kernels.triton_decode import SplitParts

    o = torch.randn(rows * n_splits * D, generator=g)
    lse = torch.randn(rows * n_splits, generator=g) * 3
    lse[torch.rand(rows * n_splits, generator=g) < 0.2] = float("-inf")  # splits with no keys
    return SplitParts(o, lse, n_splits)


def _merge_ref(parts, second, B, Hkv, M, D, heads_major: bool):
    """float64 out [B, Hkv, M, D] (storage domain), lse [B, Hkv, M]: every split of both passes
    weighted by exp(lse) — parts' rows in [Hkv, B, M] order with heads_major."""
    o = parts.o.double().view(-1, parts.n_splits, D)
    lse = parts.lse.double().view(-1, parts.n_splits)
    if heads_major:
        o = o.view(Hkv, B, M, -1, D).transpose(0, 1).reshape(B * Hkv * M, -1, D)
        lse = lse.view(Hkv, B, M, -1).transpose(0, 1).reshape(B * Hkv * M, -1)
    if second is not None:
        o = torch.cat([o, second.o.double().view(-1, second.n_splits, D)], 1)
        lse = torch.cat([lse, second.lse.double().view(-1, second.n_splits)], 1)
    m = lse.max(1).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m[:, None])
    tot = w.sum(1)
    out = (o * w[..., None]).sum(1) / torch.where(tot > 0, tot, torch.ones_like(tot))[:, None]
    ref_lse = torch.where(tot > 0, m + torch.log(tot), torch.full_like(m, float("-inf")))
    return out.view(B, Hkv, M, D), ref_lse.view(B, Hkv, M)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("D,B,Hkv,M,nsp,nss,heads_major", [
    (64, 3, 2, 4, 5, 2, True),      # 24 rows: one full and one partial row block
    (128, 5, 1, 4, 9, 0, True),     # no second pass; 9 splits: SC-tiles not filled
    (256, 2, 3, 2, 3, 1, False),    # two rotation groups per row; decode's own row order
])
@pytest.mark.parametrize("true_space", [False, True])
def test_combine_matches_merge(monkeypatch, block, D, B, Hkv, M, nsp, nss, heads_major,
                               true_space):
    from polykv.kernels import triton_decode as td

    monkeypatch.setattr(td, "COMBINE_BLOCK_MIN_ROWS", 1 if block else 1 << 30)
    g = torch.Generator().manual_seed(D + B + nsp)
    rows = B * Hkv * M
    parts = _parts(g, rows, nsp, D)
    parts.lse.view(-1, nsp)[1] = float("-inf")  # a row of the first pass with no keys
    second = _parts(g, rows, nss, D) if nss else None
    if second is None:
        parts.lse.view(-1, nsp)[-1] = float("-inf")  # a row with no keys at all
    vc = get_codec("turbo3", D)
    group = vc.group
    out_dtype = torch.float16 if true_space else None
    out, lse = td.combine_splits(parts, (B, Hkv, M, D), vc, out_dtype, second=second,
                                 heads_major=heads_major)
    want, want_lse = _merge_ref(parts, second, B, Hkv, M, D, heads_major)
    if true_space:  # back from V's storage domain: y = o @ M^T per rotation group
        rot = rotation_matrix(group, "cpu").double()
        want = (want.view(B, Hkv, M, D // group, group) @ rot.T).view(B, Hkv, M, D)
    assert out.dtype == (out_dtype or torch.float32) and out.shape == (B, Hkv, M, D)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-3 if true_space else 1e-5)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("D,heads_major,second", [(64, True, True), (128, False, False), (256, True, True)])
def test_combine_joins_a_true_space_pass(monkeypatch, block, D, heads_major, second):
    """A third pass already in true space (a recent window's segment) joins the merge after the
    unrotation: the merge of all three, each in true space, and the same lse."""
    from polykv.kernels import triton_decode as td

    monkeypatch.setattr(td, "COMBINE_BLOCK_MIN_ROWS", 1 if block else 1 << 30)
    g = torch.Generator().manual_seed(D)
    B, Hkv, M = 3, 2, 4
    rows = B * Hkv * M
    first, third = _parts(g, rows, 6, D), _parts(g, rows, 1, D)
    sec = _parts(g, rows, 3, D) if second else None
    third.lse.view(-1)[:3] = float("-inf")  # rows the window does not reach
    vc = get_codec("turbo3", D)
    out, lse = td.combine_splits(first, (B, Hkv, M, D), vc, torch.float32, second=sec, third=third,
                                 heads_major=heads_major)
    rot = rotation_matrix(vc.group, "cpu").double()
    # the storage-domain passes merged and unrotated, then merged with the third by lse
    o12, l12 = _merge_ref(first, sec, B, Hkv, M, D, heads_major)
    o12 = (o12.view(B, Hkv, M, D // vc.group, vc.group) @ rot.T).view(B, Hkv, M, D)
    o3 = third.o.double().view(B, Hkv, M, D)
    l3 = third.lse.double().view(B, Hkv, M)
    m = torch.maximum(l12, l3)
    w12, w3 = torch.exp(l12 - m), torch.exp(l3 - m)
    want = (o12 * w12[..., None] + o3 * w3[..., None]) / (w12 + w3)[..., None]
    torch.testing.assert_close(lse.double(), m + torch.log(w12 + w3), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="true-space"):
        td.combine_splits(first, (B, Hkv, M, D), vc, None, third=third)
