"""HeadGroupedLayer: a layer whose KV heads are stored at different types equals, head by head, a
CompressedLayer of that head's type holding that head alone (the codecs encode each head's rows on
their own), through writes, trims, truncation, batch selection and compaction; bytes are the groups'."""

from __future__ import annotations

import pytest
import torch

from polykv.cache import CompressedLayer, HeadGroupedLayer, head_groups

D, B = 64, 2
TYPES = [("turbo3", "turbo2"), ("q8_0", "turbo3"), ("turbo3", "turbo2"), ("turbo4", "q8_0")]


def _rows(s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, len(TYPES), s, D, generator=g), torch.randn(B, len(TYPES), s, D, generator=g))


def _scales() -> torch.Tensor:
    return 0.5 + torch.rand(len(TYPES), D, generator=torch.Generator().manual_seed(9))


def _per_head(scales=None) -> list[CompressedLayer]:
    """One single-head CompressedLayer per head, at its type (InnerQ scales for turbo K only)."""
    out = []
    for h, (k, v) in enumerate(TYPES):
        s = scales[h:h + 1] if scales is not None and k.startswith("turbo") else None
        out.append(CompressedLayer.for_types(k, v, D, B, 1, key_scales=s))
    return out


def _both(layer: HeadGroupedLayer, singles: list[CompressedLayer], fn) -> None:
    fn(layer, slice(None))
    for h, s in enumerate(singles):
        fn(s, slice(h, h + 1))


def _assert_same(layer: HeadGroupedLayer, singles: list[CompressedLayer]) -> None:
    k, v = layer.dense()
    assert k.shape == (layer.batch, len(TYPES), layer.length, D)
    for h, s in enumerate(singles):
        assert s.length == layer.length
        sk, sv = s.dense()
        torch.testing.assert_close(k[:, h:h + 1], sk, rtol=0, atol=0)
        torch.testing.assert_close(v[:, h:h + 1], sv, rtol=0, atol=0)


def test_groups_in_order_of_first_head():
    assert head_groups(TYPES) == [(("turbo3", "turbo2"), [0, 2]), (("q8_0", "turbo3"), [1]),
                                  (("turbo4", "q8_0"), [3])]


@pytest.mark.parametrize("innerq", [False, True])
def test_each_head_is_its_own_type(innerq):
    scales = _scales() if innerq else None
    layer = HeadGroupedLayer(TYPES, D, B, key_scales=scales)
    singles = _per_head(scales)
    for i, s in enumerate((5, 1, 7)):
        k, v = _rows(s, i)
        _both(layer, singles, lambda st, h: st.append(k[:, h], v[:, h]))
        _assert_same(layer, singles)
    # a head whose K is not turbo ignores the scales; a turbo head is scaled (not the unscaled layer)
    plain = HeadGroupedLayer(TYPES, D, B)
    for i, s in enumerate((5, 1, 7)):
        plain.append(*_rows(s, i))
    diff = (layer.dense()[0] - plain.dense()[0]).abs().amax(dim=(0, 2, 3))
    assert bool((diff[[1]] == 0).all())
    if innerq:
        assert bool((diff[[0, 2, 3]] > 0).all())
    # every row of the heads differs from the true rows by its own codec's error only: q8_0 K << turbo3 K
    k_true = torch.cat([_rows(s, i)[0] for i, s in enumerate((5, 1, 7))], 2)
    err = (layer.dense()[0] - k_true).pow(2).mean(dim=(0, 2, 3))
    assert float(err[1]) < 0.05 * float(err[0])


def test_trim_truncate_select_compact():
    layer, singles = HeadGroupedLayer(TYPES, D, B), _per_head()
    k, v = _rows(20, 1)
    _both(layer, singles, lambda st, h: st.append(k[:, h], v[:, h]))
    _both(layer, singles, lambda st, h: st.trim(9))
    _assert_same(layer, singles)
    _both(layer, singles, lambda st, h: st.truncate(6))
    _assert_same(layer, singles)
    idx = torch.tensor([1, 1, 0])
    _both(layer, singles, lambda st, h: st.select_batch(idx))
    assert layer.batch == 3
    _assert_same(layer, singles)
    k2, v2 = _rows(3, 2)
    k2, v2 = torch.cat([k2, k2[:1]]), torch.cat([v2, v2[:1]])
    _both(layer, singles, lambda st, h: st.append(k2[:, h], v2[:, h]))
    _both(layer, singles, lambda st, h: st.compact())
    _assert_same(layer, singles)
    assert layer.capacity == layer.length == 9
    a, b = layer.decode_rows(2, 7)
    torch.testing.assert_close(a, layer.dense()[0][:, :, 2:7], rtol=0, atol=0)
    torch.testing.assert_close(b, layer.dense()[1][:, :, 2:7], rtol=0, atol=0)


def test_bytes_are_the_groups():
    layer, singles = HeadGroupedLayer(TYPES, D, B), _per_head()
    k, v = _rows(10, 3)
    _both(layer, singles, lambda st, h: st.append(k[:, h], v[:, h]))
    _both(layer, singles, lambda st, h: st.compact())
    assert layer.nbytes() == sum(s.nbytes() for s in singles) > 0
    assert layer.used_nbytes() == sum(s.used_nbytes() for s in singles)
    # bits: each head at its codec's stored bits (q8_0 8.5, turbo3 3.25, turbo2 2.25, turbo4 4.25 at D = 64)
    bits = layer.used_nbytes() * 8 / (2 * B * len(TYPES) * 10 * D)
    assert bits == pytest.approx((3.25 + 2.25) * 2 / 8 + (8.5 + 3.25) / 8 + (4.25 + 8.5) / 8)


def test_rotated_read_refused_and_shapes_checked():
    layer = HeadGroupedLayer(TYPES, D, B)
    layer.append(*_rows(3, 0))
    with pytest.raises(ValueError, match="true space"):
        layer.decode_rows(0, 3, rotated=(True, False))
    with pytest.raises(ValueError, match="expected K/V"):
        layer.append(*(x[:, :2] for x in _rows(3, 0)))
    with pytest.raises(ValueError, match="key_scales"):
        HeadGroupedLayer(TYPES, D, B, key_scales=torch.ones(2, D))
