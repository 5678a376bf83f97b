"""PageTable / PagedRows: fixed-size pages, a free list, compaction by page-table moves."""

import pytest
import torch

from polykv.cache import PagedRows, PageTable
from polykv.codecs import get_codec
from polykv.kernels import gather_pages


def test_pages_allocate_free_reuse_and_move():
    t = PageTable(page_size=16, device="cpu")
    t.reserve(slots=3)
    t.add_pages(4)
    t.ensure(0, 20)  # 2 pages
    t.ensure(1, 1)  # 1 page
    assert t.counts == [2, 1, 0] and t.used_pages() == 3 and t.n_pages == 4
    owned = set(t.table[0, :2].tolist()) | {int(t.table[1, 0])}
    assert len(owned) == 3  # distinct pages
    t.ensure(0, 32)  # still 2 pages: no new one
    assert t.counts[0] == 2
    t.free(1)
    t.ensure(2, 32)  # 2 pages: slot 1's freed page and the last free one, no pool growth
    assert t.n_pages == 4 and t.counts[2] == 2
    assert set(t.table[2, :2].tolist()) | set(t.table[0, :2].tolist()) == {0, 1, 2, 3}
    t.move(2, 1)  # slot 2's pages become slot 1's: no row copied
    assert t.counts == [2, 2, 0]
    t.ensure(0, 64)  # 4 pages, none free: the pool grows (doubling)
    assert t.n_pages == 8 and t.used_pages() == 6
    rows = t.flat_rows(torch.tensor([0, 1]), torch.tensor([[17, -1], [0, 31]]), scratch=999)
    assert rows[0, 0] == int(t.table[0, 1]) * 16 + 1 and rows[0, 1] == 999
    assert rows[1, 1] == int(t.table[1, 1]) * 16 + 15


def test_page_size_must_fit_the_kernels():
    with pytest.raises(ValueError, match="multiple of 16"):
        PageTable(page_size=24, device="cpu")


def test_paged_rows_write_and_gather_round_trip():
    """Rows written through the page table read back in order through gather_pages, and the pool
    keeps them when it grows."""
    torch.manual_seed(0)
    kc, vc = get_codec("q8_0", 64), get_codec("turbo3", 64)
    t = PageTable(page_size=16, device="cpu")
    t.reserve(slots=2)
    st = PagedRows(kc, vc, kv_heads=2, page_size=16, device="cpu")
    k = torch.randn(2, 2, 20, 64)
    v = torch.randn(2, 2, 20, 64)
    for s in (0, 1):
        t.ensure(s, 20)
    st.grow(t.n_pages)
    pos = torch.arange(20)[None].expand(2, 20)
    st.write(k, v, t.flat_rows(torch.tensor([0, 1]), pos, st.scratch_row))
    t.ensure(1, 60)  # grows the pool: rows must survive
    st.grow(t.n_pages)
    pk, pv = st.pool()
    dk = gather_pages(pk, t.table[:, :2], 16)
    want = kc.encode(k)
    assert torch.equal(dk.codes[:, :, :20], want.codes) and torch.equal(dk.scales[:, :, :20], want.scales)
    assert torch.equal(gather_pages(pv, t.table[:, :2], 16).codes[:, :, :20], vc.encode(v).codes)
