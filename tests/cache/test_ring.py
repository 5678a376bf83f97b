"""RecentRing (polykv/cache/ring.py): slot = position mod size, position-order reads, wrap-around,
device-position writes, batch selection, bytes."""

from __future__ import annotations

import pytest
import torch

from polykv.cache import RecentRing
from polykv.codecs import get_codec

B, H, D = 2, 3, 64


def rows_for(positions, batch=B) -> torch.Tensor:
    """[batch, H, T, D] rows whose values identify (sequence, head, position): a mis-slotted read is
    off by far more than q8_0's error."""
    p = torch.as_tensor(positions, dtype=torch.float32)
    b = torch.arange(batch, dtype=torch.float32)[:, None, None, None]
    h = torch.arange(H, dtype=torch.float32)[None, :, None, None]
    d = torch.linspace(-1, 1, D)[None, None, None, :]
    return (1 + p[None, None, :, None]) * (1 + 0.1 * b + 0.01 * h) * (1 + d)


def q8(x: torch.Tensor) -> torch.Tensor:
    c = get_codec("q8_0", D)
    return c.decode(c.encode(x))


@pytest.mark.parametrize("size, chunks", [(5, [3, 1, 4, 7, 1, 2]), (8, [1] * 19), (4, [9, 2, 1])])
def test_write_then_read_positions_with_wrap_around(size, chunks):
    ring = RecentRing(size, D, B, H)
    end = 0
    for n in chunks:
        ring.write(rows_for(range(end, end + n)), -rows_for(range(end, end + n)), first=end)
        end += n
        held = min(end, size)
        k, v = ring.decode(end - held, end)
        want = q8(rows_for(range(end - held, end)))
        assert torch.equal(k, want) and torch.equal(v, -want)
        for p in range(end - held, end):  # the slot of position p is p mod size
            assert torch.equal(get_codec("q8_0", D).decode(ring.k.index((slice(None), slice(None), p % size))),
                               want[:, :, p - end + held])
    with pytest.raises(ValueError):
        ring.rows(0, size + 1)


@pytest.mark.parametrize("end", [3, 5, 11, 12])
def test_ordered_gives_position_order_for_int_and_device_ends(end):
    size = 5
    ring = RecentRing(size, D, B, H)
    ring.write(rows_for(range(end)), rows_for(range(end)), first=0)
    k, v, first = ring.ordered(end)
    assert first == end - size
    c = ring.codec
    got = c.decode(k)
    for i in range(size):
        if first + i >= 0:
            assert torch.equal(got[:, :, i], q8(rows_for([first + i]))[:, :, 0])
    kt, vt, ft = ring.ordered(torch.full((B,), end, dtype=torch.int32))
    assert ft.tolist() == [end - size] * B
    assert torch.equal(kt.codes, k.codes) and torch.equal(kt.scales, k.scales)
    assert torch.equal(vt.codes, v.codes)


def test_write_at_device_positions_equals_write():
    a, b = RecentRing(6, D, B, H), RecentRing(6, D, B, H)
    x = rows_for(range(20))
    a.write(x, x, first=0)
    b.write(x[:, :, :13], x[:, :, :13], first=0)
    for p in range(13, 20):  # the captured step: one row per sequence at a device position
        b.write_at(x[:, :, p:p + 1], x[:, :, p:p + 1], torch.full((B, 1), p, dtype=torch.int64))
    assert torch.equal(a.k.codes, b.k.codes) and torch.equal(a.v.scales, b.v.scales)


def test_select_batch_moves_each_sequence_rows():
    ring = RecentRing(4, D, B, H)
    x = rows_for(range(7))
    ring.write(x, x, first=0)
    before = ring.codec.decode(ring.k)
    ring.select_batch(torch.tensor([1, 1, 0]))
    assert ring.batch == 3
    after = ring.codec.decode(ring.k)
    assert torch.equal(after[0], before[1]) and torch.equal(after[1], before[1]) and torch.equal(after[2], before[0])


def test_bytes_are_the_q8_rows():
    ring = RecentRing(32, D, B, H)
    per_row = D + 2 * (D // 32)  # int8 codes + fp16 scale per 32 values
    assert ring.nbytes() == 2 * B * H * 32 * per_row
    assert ring.used_nbytes(10) == 2 * B * H * 10 * per_row
    assert ring.used_nbytes(99) == ring.nbytes()
    with pytest.raises(ValueError):
        RecentRing(0, D, B, H)
