"""The agents' recent windows: each agent's last R suffix rows of every layer held at q8_0 (issue K).

`polykv.cache.ring.RecentRing` gives a KVCache its window; this module gives the same to the pool's
agents (`AgentCache(recent=R)`, `SharedKVPool(recent=...)` / a preset's `recent`). Semantics, on
suffix positions (suffix row j sits at absolute position doc_len + j):

* A query at suffix position p reads its rows (p - R, p] ∩ [0, p] from the window (q8_0, true
  space: keys neither InnerQ-scaled nor rotated) and every other row — the whole shared prefix and
  its suffix rows [0, p - R] — in the pool's codecs, exactly as without a window. The window is per
  query, not per forward: a forward of n_q columns (a prompt, a multi-token feed, a speculative
  verify step) reads what n_q one-token steps would read, so speculation stays lossless under
  greedy and feeding tokens one by one or together gives the same attention inputs.
* Suffix rows only: the shared prefix is one copy read by every agent in one pass, which cannot
  exclude rows per agent, so the document's tail is never in a window — an agent whose suffix is
  shorter than R has a window of just its suffix rows.
* Sliding-window layers (window W): R_l = min(R, W - 1) (a window never reaches past what the
  layer sees), as KVCache does.

Storage, per layer: K and V q8_0 rows [Hkv, slots * C + 1] (the last row is scratch, for padded
writes), C = R_l + spare; the layers of one shape hold theirs as views of one tensor per kind
(`AgentRings._stack`: moving a slot is one copy per kind). Position p of the agent in slot s lives at row s * C + p % C. Every
suffix row is written to the pool's pages as before and also here (write-once, the newest C kept).
`spare` (the most drafts queued in the batch: `AgentBatch.expect_drafts` / `feed_drafts`) keeps
the rows a rollback of rejected drafts needs: after a cut of m <= spare + 1 rows the window is
exact; a larger cut (`AgentCache.truncate` by hand) refills the missing positions from the pages
(decoded from the pool's codec, then q8_0: those rows read at about the codec's precision until
they leave the window, as KVCache's crop does).

One forward, per layer (`AgentRings.write`, all on the device, no host value: the same code runs
in a captured step): the new rows (real columns: write row != scratch) are encoded once to q8_0;
the window segment of the forward is the R - 1 + n_q positions [L - n_q - R + 1, L) of each agent
(L: its length after the forward) — the ring's rows before the write, the new columns where real —
and the newest min(C, new) rows are stored — on the kernels in one launch with the rows' page write
(`dispatch.ring_step(pages=)`; a feed that wraps the ring, R - 1 + n_q > C, reads before it stores:
`wraps=True`; a split step's joining agents get their segments apart too, `wide=`). Attention then
reads that segment causally with window
R (`kv_start` hides positions < 0); the rest is the cascade with suffix lengths L - R (query j sits
at p_j - R there: it sees suffix rows <= p_j - R), merged by LSE (`AgentCache.attend`).
"""

from __future__ import annotations

import torch

from ..cache.accounting import storage_bytes
from ..cache.ring import RING_TYPE
from ..codecs import Packed, get_codec


class _RingLayer:
    """K and V q8_0 rows of one layer (see module doc)."""

    def __init__(self, recent: int, head_dim: int, kv_heads: int, slots: int, spare: int, device):
        self.recent = int(recent)
        self.codec = get_codec(RING_TYPE, head_dim)
        self.kv_heads = kv_heads
        self.device = device
        self.capacity = self.recent + int(spare)
        self.slots = int(slots)
        lead = (kv_heads, self.slots * self.capacity + 1)
        self.k, self.v = self.codec.empty(lead, device), self.codec.empty(lead, device)

    @property
    def scratch_row(self) -> int:
        return self.slots * self.capacity

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in (self.k, self.v) for t in (p.codes, p.scales) if t is not None]

    def relayout(self, slots: int, spare: int, lens: torch.Tensor) -> None:
        """Reallocate for `slots` slots of R + spare rows, keeping every slot's held positions
        (the last min(old C, new C, length) of each; lens: host int64 lengths per old slot)."""
        old_c, new_c = self.capacity, self.recent + int(spare)
        lead = (self.kv_heads, int(slots) * new_c + 1)
        k, v = self.codec.empty(lead, self.device), self.codec.empty(lead, self.device)
        src, dst = [], []
        for s, n in enumerate(lens.tolist()[: self.slots]):
            for p in range(max(0, int(n) - min(old_c, new_c)), int(n)):
                src.append(s * old_c + p % old_c)
                dst.append(s * new_c + p % new_c)
        if src:
            si, di = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
            for new, old in ((k, self.k), (v, self.v)):
                for a, b in ((new.codes, old.codes), (new.scales, old.scales)):
                    if a is not None:
                        a[:, di] = b[:, si]
        self.k, self.v, self.capacity, self.slots = k, v, new_c, int(slots)

    def scatter(self, rows: torch.Tensor, k: Packed, v: Packed) -> None:
        """Store k, v Packed leading [G, Hkv, T] at rows int64 [G, T] (duplicates only at scratch)."""
        flat = rows.reshape(-1)
        for dst, src in ((self.k, k), (self.v, v)):
            for a, b in ((dst.codes, src.codes), (dst.scales, src.scales)):
                if a is not None:
                    a[:, flat] = b.permute(1, 0, 2, 3).reshape(self.kv_heads, flat.numel(), -1).to(a.dtype)

    def set_tensors(self, ts: list[torch.Tensor]) -> None:
        """Take the tensors of `tensors()`' order (views of `AgentRings`' stacks)."""
        it = iter(ts)
        self.k, self.v = (Packed(next(it), None if p.scales is None else next(it)) for p in (self.k, self.v))


class AgentRings:
    """The recent windows of an AgentCache's agents, one `_RingLayer` per layer (module doc).

    recent: per layer R_l (>= 1); head_dims / kv_heads: per layer; slots: agent slots."""

    def __init__(self, recent: list[int], head_dims: list[int], kv_heads: list[int], slots: int,
                 device, spare: int = 0):
        self.device = torch.device(device)
        self.spare = int(spare)
        self.layers = [_RingLayer(r, d, h, slots, self.spare, self.device)
                       for r, d, h in zip(recent, head_dims, kv_heads)]
        self.version = 0  # bumped by every reallocation (captured steps read these tensors)
        self._stack()

    def _stack(self) -> None:
        """Layers whose ring tensors have the same shapes (every layer of most models) hold them as
        views of one tensor per kind, [layers, Hkv, rows, *]: moving a slot (`move`) is then one
        copy per kind, not one per layer and kind — 120 eager copies for 30 layers, 1.6-6.9 ms of
        host time per agent leaving a batch on an H100 (BENCHMARKS §8.16)."""
        groups: dict[tuple, list[_RingLayer]] = {}
        for lay in self.layers:
            groups.setdefault(tuple((t.shape, t.dtype) for t in lay.tensors()), []).append(lay)
        self._groups = []
        for lays in groups.values():
            stacks = [torch.stack(ts) for ts in zip(*(lay.tensors() for lay in lays))]
            for i, lay in enumerate(lays):
                lay.set_tensors([st[i] for st in stacks])
            self._groups.append((lays[0].capacity, stacks))

    @property
    def slots(self) -> int:
        return self.layers[0].slots

    def reserve(self, slots: int, spare: int, lens: torch.Tensor) -> None:
        """At least `slots` slots and `spare` spare rows per slot (reallocates, keeping the rows)."""
        slots, spare = max(self.slots, int(slots)), max(self.spare, int(spare))
        if slots == self.slots and spare == self.spare:
            return
        for lay in self.layers:
            lay.relayout(slots, spare, lens)
        self._stack()
        self.spare = spare
        self.version += 1

    def move(self, src: int, dst: int) -> None:
        """Slot src's rows become slot dst's (C rows of every layer: `AgentCache.move_slot`), one
        copy per stacked tensor (`_stack`)."""
        for c, stacks in self._groups:
            for st in stacks:
                st[:, :, dst * c: (dst + 1) * c] = st[:, :, src * c: (src + 1) * c]

    def write(self, li: int, k: torch.Tensor, v: torch.Tensor, slots, lens: torch.Tensor,
              page_rows: torch.Tensor, page_scratch: int, memo: dict | None = None, pages=None,
              wide: tuple | None = None):
        """One forward's rows of layer li: k, v [G, Hkv, n_q, D] (true space, left-padded), slots
        (a slice of consecutive slots, or int64 [G]), lens int [G] (lengths after the forward),
        page_rows int64 [G, n_q] (the columns' page rows; page_scratch where the column is padding,
        not written). Stores the newest min(C, real columns) rows and returns the forward's window
        segment: (k, v) Packed leading [G, Hkv, R - 1 + n_q] (row i = position L - n_q - R + 1 + i,
        q8_0) and kv_start int32 [G] (rows at negative positions are not keys). memo: a dict shared
        by the layers of one forward (the same slots, lens and rows): the ring rows, positions and
        masks, which depend on those and on (R, C) only, are computed by the first layer; it also
        gets ("older", R): int32 [G] max(L - R, 0), the rows before each window (`AgentCache`).
        pages (`dispatch.KVTarget`): the rows' page write, done here too — in the ring step's
        launch on the kernels. wide (idx int64 [J], pos int64 [G]; `dispatch.ring_step`): the
        segments of agents idx too, as two more Packed [J, Hkv, W] (else None, None) after
        kv_start."""
        from ..kernels import dispatch

        lay = self.layers[li]
        n_q = k.shape[2]
        R, C = lay.recent, lay.capacity
        key = (n_q, R, C, lay.scratch_row)
        idx = None if memo is None else memo.get(key)
        if idx is None:
            idx = self._indices(slots, lens, page_rows, page_scratch, n_q, R, C, lay.scratch_row, k.device)
            if memo is not None:
                memo[key] = idx
                memo[("older", R)] = idx[-1]
        gather_rows, rows, kv_start, real, _ = idx
        # one launch on the kernels (`dispatch.ring_step`); wraps: a feed longer than the spare
        # rows (a prompt joining) stores rows its segment reads, which the step reads first
        segs = dispatch.ring_step(lay.k, lay.v, k, v, rows, gather_rows, real, pages=pages,
                                  wraps=R - 1 + n_q > C, wide=wide)
        return segs[0], segs[1], kv_start, *(segs[2:] or (None, None))

    @staticmethod
    def _indices(slots, lens: torch.Tensor, page_rows: torch.Tensor, page_scratch: int, n_q: int, R: int,
                 C: int, scratch_row: int, dev) -> tuple:
        """What `write` derives from the forward's slots, lengths and page rows for rings of R
        recent rows in C (`reference.ring_indices_ref`): (the window segment's ring rows int64
        [G, R - 1 + n_q], the rows to store int64 [G, n_q] (scratch where not kept), kv_start int32
        [G], the real columns bool [G, n_q], older int32 [G]). Device ops only (captured steps),
        few of them: in a captured step each is a kernel of its own (issue F), so what depends on
        (n_q, R, C) alone is made once (`_ring_constants`), and on the kernels the rest is one
        launch (`dispatch.ring_indices`)."""
        from ..kernels import dispatch

        off, newest = _ring_constants(n_q, R, C, dev)
        # segment row i at position L - W + i; column j (position L - n_q + j) kept where real and
        # among the newest C rows (no slot twice); on the kernels all of it in one launch
        slots = slots if isinstance(slots, slice) else slots.to(dev)
        return dispatch.ring_indices(slots, lens.to(dev), page_rows.to(dev), page_scratch, R, C, scratch_row,
                                     off, newest)

    def refill(self, li: int, slot: int, positions: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write true-space rows k, v [Hkv, T, D] at `positions` of `slot` (a rollback deeper than
        the spare rows: module doc)."""
        lay = self.layers[li]
        enc_k, enc_v = lay.codec.encode(k[None]), lay.codec.encode(v[None])
        rows = torch.tensor([[slot * lay.capacity + p % lay.capacity for p in positions]], device=self.device)
        lay.scatter(rows, enc_k, enc_v)

    def tensors(self) -> list[torch.Tensor]:
        return [t for lay in self.layers for t in lay.tensors()]

    def nbytes(self) -> int:
        return storage_bytes(self.tensors())


_CONSTANTS: dict = {}


def _ring_constants(n_q: int, R: int, C: int, dev) -> tuple:
    """(off int64 [W] = position - L of the segment's rows, W = R - 1 + n_q; newest bool [n_q]:
    the columns among the newest C rows, None when all are), kept per (n_q, R, C, device). Never
    kept when made inside a CUDA graph capture: their values would exist only in the graph's
    replays."""
    key = (n_q, R, C, str(dev))
    c = _CONSTANTS.get(key)
    if c is None:
        W = R - 1 + n_q
        c = (torch.arange(W, device=dev) - W, None if C >= n_q else torch.arange(n_q, device=dev) >= n_q - C)
        if not (torch.device(dev).type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _CONSTANTS[key] = c
    return c


__all__ = ["AgentRings"]
