"""CompressedLayer.decode_rows / truncate / used_nbytes (methods KVCache relies on)."""

import pytest
import torch

from polykv.cache import CompressedLayer
from polykv.codecs import get_codec


def test_decode_rows_matches_dense_and_rotated_domain():
    torch.manual_seed(0)
    s = torch.linspace(0.5, 2.0, 64).repeat(2, 1)
    layer = CompressedLayer.for_types("turbo4", "turbo3", 64, batch=2, kv_heads=2, key_scales=s)
    k, v = torch.randn(2, 2, 10, 64), torch.randn(2, 2, 10, 64)
    layer.append(k, v)
    dk, dv = layer.dense()
    rk, rv = layer.decode_rows(3, 8)
    assert torch.allclose(rk, dk[:, :, 3:8]) and torch.allclose(rv, dv[:, :, 3:8])
    # rotated domain: keys stay scaled, rotate(true) == storage domain
    ok, ov = layer.decode_rows(0, 10, rotated=(True, True))
    kc, vc = get_codec("turbo4", 64), get_codec("turbo3", 64)
    assert torch.allclose(kc.unrotate(ok) / s[None, :, None, :], dk, atol=1e-5)
    assert torch.allclose(vc.unrotate(ov), dv, atol=1e-5)
    e = layer.decode_rows(5, 5)
    assert e[0].shape == (2, 2, 0, 64)


def test_truncate_and_used_bytes():
    layer = CompressedLayer.for_types("q8_0", "q8_0", 64, batch=1, kv_heads=3)
    assert layer.used_nbytes() == 0
    layer.append(torch.randn(1, 3, 10, 64), torch.randn(1, 3, 10, 64))
    per_row = 2 * 3 * (64 + 2 * 2)  # K and V: 64 int8 + 2 fp16 scales per head
    assert layer.used_nbytes() == 10 * per_row
    assert layer.nbytes() >= layer.used_nbytes()
    layer.truncate(4)
    assert layer.length == 4 and layer.used_nbytes() == 4 * per_row


def test_growth_keeps_held_bytes_near_the_payload():
    """Decode-style growth (one row at a time after a prompt): held bytes stay within 12.5 % plus one
    64-row granule of the payload at every step (doubling would hold up to 2x), rows kept."""
    layer = CompressedLayer.for_types("q8_0", "turbo3", 64, batch=1, kv_heads=2)
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 1300, 64), torch.randn(1, 2, 1300, 64)
    layer.append(k[:, :, :700], v[:, :, :700])
    per_row = layer.used_nbytes() // 700
    grows = 0
    for t in range(700, 1300):
        cap = layer.capacity
        layer.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        grows += layer.capacity != cap
        assert layer.nbytes() <= 1.125 * layer.used_nbytes() + 64 * per_row, (t, layer.capacity)
    assert grows <= 8  # amortised: a copy every ~capacity/8 rows, not every row
    dk, _ = layer.dense(torch.float32)
    assert torch.allclose(dk, get_codec("q8_0", 64).decode(get_codec("q8_0", 64).encode(k)), atol=1e-6)


def test_trim_gives_back_storage_a_long_chunk_grew():
    """A sliding-window layer trimmed after a long chunk holds its window plus one row, not the
    chunk's length; rows kept, and one-row decode appends then fit without regrowing."""
    torch.manual_seed(0)
    layer = CompressedLayer.for_types("q8_0", "turbo3", 64, batch=1, kv_heads=2)
    k, v = torch.randn(1, 2, 1500, 64), torch.randn(1, 2, 1500, 64)
    layer.append(k, v)
    assert layer.capacity >= 1500
    dk, dv = layer.dense()
    layer.trim(511)
    assert layer.length == 511 and layer.capacity == 511 + 1
    tk, tv = layer.dense()
    assert torch.equal(tk, dk[:, :, -511:]) and torch.equal(tv, dv[:, :, -511:])
    held = layer.nbytes()
    for _ in range(3):  # decode: one row in, trim back to the window
        layer.append(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
        layer.trim(511)
    assert layer.nbytes() == held
    small = CompressedLayer.for_types("q8_0", "q8_0", 64, batch=1, kv_heads=2)
    small.append(torch.randn(1, 2, 900, 64), torch.randn(1, 2, 900, 64))
    cap = small.capacity
    small.trim(511)  # within twice the window's room: left as it is
    assert small.capacity == cap


def _grown(layer, k, v, spans):
    for a, b in spans:
        layer.append(k[:, :, a:b], v[:, :, a:b])
    return layer


@pytest.mark.parametrize("spans", [[(0, 1434)], [(0, 512), (512, 1024), (1024, 1434)], [(0, 7)]],
                         ids=["one-write", "chunked", "short"])
def test_prefill_holds_exactly_its_rows(spans):
    """A prompt (one write, or chunks each longer than a growth step) leaves storage of exactly its
    rows (no 64-row round-up: 1,472 rows held for 1,434); the next one-row decode append grows by the
    usual step onto 64-aligned storage."""
    torch.manual_seed(0)
    n = spans[-1][1]
    k, v = torch.randn(1, 2, n + 1, 64), torch.randn(1, 2, n + 1, 64)
    layer = _grown(CompressedLayer.for_types("q8_0", "turbo3", 64, batch=1, kv_heads=2), k, v, spans)
    assert layer.length == layer.capacity == n
    assert layer.nbytes() == layer.used_nbytes()
    layer.append(k[:, :, n:], v[:, :, n:])
    assert layer.length == n + 1 and layer.capacity % 64 == 0
    assert layer.capacity - layer.length < max(64, n // 8) + 64


def test_exact_prefill_then_decode_is_bit_identical_to_slack_storage():
    """Exact-to-the-row storage changes capacity only: after a prefill and decode appends across
    several growth steps, the stored codes and decoded rows equal those of a layer that reserved
    ample room up front."""
    torch.manual_seed(2)
    s = torch.linspace(0.5, 2.0, 64).repeat(2, 1)
    k, v = torch.randn(1, 2, 1700, 64), torch.randn(1, 2, 1700, 64)
    spans = [(0, 1434)] + [(t, t + 1) for t in range(1434, 1700)]
    exact = CompressedLayer.for_types("turbo4", "turbo3", 64, batch=1, kv_heads=2, key_scales=s)
    slack = CompressedLayer.for_types("turbo4", "turbo3", 64, batch=1, kv_heads=2, key_scales=s)
    slack.reserve(2048, exact=True)
    _grown(exact, k, v, spans[:1])
    assert exact.capacity == 1434 and slack.capacity == 2048
    _grown(exact, k, v, spans[1:])
    _grown(slack, k, v, spans)
    assert exact.capacity < slack.capacity == 2048
    for a, b in ((exact.keys(), slack.keys()), (exact.values(), slack.values())):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    for a, b in zip(exact.dense(), slack.dense()):
        assert torch.equal(a, b)
