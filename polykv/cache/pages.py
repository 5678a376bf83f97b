"""Paged private K/V rows: agent suffixes in fixed-size pages with a page table (DESIGN §8).

    table = PageTable(page_size=64)             # one per cache: every layer has the same lengths
    store = PagedRows(k_codec, v_codec, ...)    # one per layer: the packed page pool
    table.ensure(slot, rows) -> pool may need to grow (store.grow(table.n_pages))
    rows = table.flat_rows(slots, positions)    # where to write
    table.move(src, dst) / table.free(slot)     # compaction and removal move table rows, not data

Storage per codec tensor of a layer: [kv_heads, n_pages * page_size + 1, last]; the last row is the
scratch row (padded writes). Row j of the sequence in slot s lives at pool row
table[s, j // page_size] * page_size + j % page_size. A sequence grows by taking a free page (no
copy); freed pages are reused. Only the pool itself grows by reallocation (doubling), which callers
avoid by reserving pages up front. The kernels read the pool through the page table
(`kernels.dispatch.cascade_attention(..., suffix_pages=, page_size=)`); `kernels.gather_pages` is
the dense reference view.
"""

from __future__ import annotations

import torch

from ..codecs import Codec, Packed
from .accounting import storage_bytes


class PageTable:
    """Host-side page allocator and page table of one cache, with a device mirror.

    table: int32 [slots, max_pages] (host); device_table(): the same on `device`, one static
    tensor (refreshed in place when the host table changed; reallocated — `version` bumps — only
    when slots or max_pages grow)."""

    def __init__(self, page_size: int, device):
        if page_size < 16 or page_size % 16:
            raise ValueError(f"page_size must be a positive multiple of 16, got {page_size}")
        self.page_size = int(page_size)
        self.device = torch.device(device)
        self.n_pages = 0
        self.free_pages: list[int] = []
        self.table = torch.zeros(0, 0, dtype=torch.int32)
        self.owned: list[list[int]] = []  # pages of each slot, in order (host lists: per-step
        # bookkeeping of a decode step stays in plain Python, no tensor ops)
        self._device_table: torch.Tensor | None = None
        self._dirty = True
        self.version = 0

    @property
    def slots(self) -> int:
        return len(self.owned)

    @property
    def counts(self) -> list[int]:
        """Pages held per slot."""
        return [len(p) for p in self.owned]

    def pages_for(self, rows: int) -> int:
        return -(-int(rows) // self.page_size)

    def reserve(self, slots: int, max_pages: int = 0) -> None:
        """Room in the table for `slots` slots of up to `max_pages` pages."""
        s, m = max(self.slots, int(slots)), max(self.table.shape[1], int(max_pages))
        if s == self.slots and m == self.table.shape[1]:
            return
        t = torch.zeros(s, m, dtype=torch.int32)
        t[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = t
        self.owned += [[] for _ in range(s - len(self.owned))]
        self._device_table = None
        self._dirty = True
        self.version += 1

    def add_pages(self, n: int) -> None:
        """Make n more physical pages available (the caller grows every layer's pool to n_pages)."""
        self.free_pages += list(range(self.n_pages + int(n) - 1, self.n_pages - 1, -1))
        self.n_pages += int(n)
        self.version += 1

    def ensure(self, slot: int, rows: int) -> None:
        """Give `slot` pages for `rows` rows; grows the pool (doubling) when no page is free —
        check `n_pages` afterwards and grow the layers' storage to it."""
        need = self.pages_for(rows)
        have = len(self.owned[slot])
        if need <= have:
            return
        if need > self.table.shape[1]:
            self.reserve(self.slots, max(need, 2 * self.table.shape[1]))
        missing = need - have - len(self.free_pages)
        if missing > 0:
            self.add_pages(max(missing, self.n_pages))
        for j in range(have, need):
            page = self.free_pages.pop()
            self.owned[slot].append(page)
            self.table[slot, j] = page
        self._dirty = True

    def free(self, slot: int) -> None:
        """Return the pages of `slot` to the free list."""
        self.free_pages += self.owned[slot]
        self.owned[slot] = []

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s pages become slot `dst`'s (dst's own pages are freed first): compaction
        without copying any row."""
        self.free(dst)
        n = len(self.owned[src])
        self.table[dst, :n] = self.table[src, :n]
        self.owned[dst], self.owned[src] = self.owned[src], []
        self._dirty = True

    def flat_rows(self, slots: torch.Tensor, positions: torch.Tensor, scratch: int) -> torch.Tensor:
        """int64 [G, T] pool rows of (slots[g], positions[g, t]) (pages must be ensured);
        positions < 0 -> `scratch`."""
        p = positions.clamp_min(0)
        page = self.table[slots[:, None], p // self.page_size].long()
        rows = page * self.page_size + p % self.page_size
        return torch.where(positions < 0, torch.full_like(rows, scratch), rows)

    def row(self, slot: int, position: int) -> int:
        """Pool row of one (slot, position) (pages must be ensured); plain Python."""
        return self.owned[slot][position // self.page_size] * self.page_size + position % self.page_size

    def device_table(self) -> torch.Tensor:
        """The table on the device, refreshed in place if the host table changed."""
        if self._device_table is None:
            self._device_table = self.table.to(self.device)
            self._dirty = False
        elif self._dirty:
            self._device_table.copy_(self.table)
            self._dirty = False
        return self._device_table

    def used_pages(self) -> int:
        return sum(len(p) for p in self.owned)


class PagedRows:
    """The packed page pool of one layer (see module doc)."""

    def __init__(self, k_codec: Codec, v_codec: Codec, kv_heads: int, page_size: int, device,
                 key_scales: torch.Tensor | None = None):
        self.k_codec, self.v_codec = k_codec, v_codec
        self.kv_heads, self.page_size = kv_heads, int(page_size)
        self.device = torch.device(device)
        self.key_scales = None if key_scales is None else key_scales.to(self.device, torch.float32)
        self.n_pages = 0
        self.k = self.k_codec.empty((kv_heads, 1), self.device)  # the scratch row alone
        self.v = self.v_codec.empty((kv_heads, 1), self.device)

    @property
    def scratch_row(self) -> int:
        return self.n_pages * self.page_size

    def grow(self, n_pages: int) -> None:
        """Reallocate the pool to n_pages pages, keeping every page's rows."""
        if n_pages <= self.n_pages:
            return
        rows = self.n_pages * self.page_size
        lead = (self.kv_heads, n_pages * self.page_size + 1)
        k_new, v_new = self.k_codec.empty(lead, self.device), self.v_codec.empty(lead, self.device)
        for new, old in ((k_new, self.k), (v_new, self.v)):
            new.codes[:, :rows] = old.codes[:, :rows]
            if new.scales is not None:
                new.scales[:, :rows] = old.scales[:, :rows]
        self.k, self.v, self.n_pages = k_new, v_new, n_pages

    def write(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Encode k, v [G, kv_heads, T, head_dim] (true space; keys unscaled) and store row (g, t) at
        pool row rows[g, t] (int64 [G, T] on the storage device): on CUDA quantize-on-write, K and V
        in one launch for a step's rows (`dispatch.quantize_kv_into`); the codec's encode elsewhere."""
        from ..kernels import dispatch

        if dispatch.use_triton(k, self.k.codes):
            self.target(k.shape[0], rows).write(k, v)
            return
        if self.key_scales is not None:
            k = k * self.key_scales.to(k.dtype)[None, :, None, :]
        idx = rows.reshape(-1)
        for p, codec, x in ((self.k, self.k_codec, k), (self.v, self.v_codec, v)):
            enc = codec.encode(x, check=False)  # [G, H, T, ...]
            for dst, src in ((p.codes, enc.codes), (p.scales, enc.scales)):
                if dst is not None:
                    dst[:, idx] = src.permute(1, 0, 2, 3).reshape(self.kv_heads, idx.numel(), -1).to(dst.dtype)

    def target(self, G: int, rows: torch.Tensor):
        """The pools as the destination of G sequences' rows, row (g, t) at pool row rows[g, t]
        (int64 [G, T]): a `dispatch.KVTarget` (keys stored with the InnerQ scales)."""
        from ..kernels.dispatch import KVTarget

        return KVTarget(_broadcast(self.k, G), self.k_codec, _broadcast(self.v, G), self.v_codec, rows,
                        self.key_scales)

    def pool(self) -> tuple[Packed, Packed]:
        """K, V page pools as Packed leading [1, kv_heads, rows] (what the kernels read)."""
        return (Packed(self.k.codes[None], None if self.k.scales is None else self.k.scales[None]),
                Packed(self.v.codes[None], None if self.v.scales is None else self.v.scales[None]))

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in (self.k, self.v) for t in (p.codes, p.scales) if t is not None]

    def nbytes(self) -> int:
        """Measured bytes of the pool (free pages and the scratch row included)."""
        return storage_bytes(self.tensors())

    def page_bytes(self) -> int:
        """Bytes one more page adds to the pool (its measured bytes per row × page_size)."""
        return self.nbytes() // (self.n_pages * self.page_size + 1) * self.page_size


def _broadcast(p: Packed, G: int) -> Packed:
    """[kv_heads, R, last] storage as a [G, kv_heads, R] destination with batch stride 0: the
    quantize kernel then writes row (g, h, t) at pool row positions[g, t] of head h."""
    return Packed(p.codes[None].expand(G, *p.codes.shape),
                  None if p.scales is None else p.scales[None].expand(G, *p.scales.shape))
