"""transformers Cache subclasses used by the pool (imported lazily: this module imports transformers).

* `AgentCache`    — N agents over one shared document. The prefix is the document's compressed layers
  (batch 1, shared, read-only); each agent's suffix lives in fixed-size pages of a per-layer
  page pool (`polykv.cache.pages`: one page table for all layers) with per-agent valid lengths
  (`lens`). Attention is the
  cascade (prefix read once per layer per forward for all agents) merged with each agent's own suffix
  by LSE. transformers' attention mask is ignored: the cache knows every agent's length.
  A host-tier document (`polykv.pool.residency.HostLayer`) is read in chunks through a
  `PrefixStreamer` (`streamed_cascade_attention`): one copy per chunk per layer per forward, shared
  by every agent of the forward.
* `recent=R` (issue K): each agent's last R suffix rows of every layer are also held at q8_0 and
  read from there (`polykv.pool.ring`, whose docstring states the semantics): per query, the window
  (p - R, p] of its own suffix; the shared prefix and the older suffix rows in the pool's codecs.

It implements the polykv attention protocol (`polykv.hf.attention`): `update` marks the cache
active and returns the new rows; `attend(module, query, ...)` returns [B, q_len, Hq, D].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from ..cache.accounting import storage_bytes
from ..cache.layer import CompressedLayer
from ..cache.pages import PagedRows, PageTable
from ..codecs import Packed
from ..hf.attention import activate
from ..kernels import dispatch
from ..kernels.reference import RecentSegment
from .attention import PrefixStreamer, cascade_attention, streamed_cascade_attention
from .residency import HostLayer


def dummy_mask(batch: int, q_len: int, device) -> torch.Tensor:
    """A 4D placeholder mask: transformers returns 4D masks as-is (no [B, q, kv] mask is built);
    the pool's caches ignore it."""
    return torch.ones(batch, 1, q_len, 1, dtype=torch.bool, device=device)


PAGE_SIZE = 64
"""Suffix rows per page: small enough that short agent suffixes waste little, a multiple of the
kernels' row tile (they read one page per tile)."""


@dataclass
class Group:
    """One forward of the agents in `slots` (row g = agent in slots[g]), n_q query columns each,
    left-padded. Host fields drive bookkeeping; device fields are what the kernels read (a captured
    decode step keeps static device tensors here and refills them in place)."""

    sel: slice | torch.Tensor  # the slots (page-table rows), a slice when contiguous
    n_q: int
    rows: torch.Tensor  # int64 [G, n_q] pool rows to write (device; padded columns -> scratch)
    lens: torch.Tensor  # int32 [G] suffix lengths after this forward (device)
    seq: int  # suffix rows the torch path reads per agent (>= every length)
    slots: torch.Tensor | None = None  # int64 [G] (host)
    new: torch.Tensor | None = None  # int64 [G] lengths after this forward (host)
    # a split step (`AgentCache.attend`): every agent attends at its last `narrow` columns only,
    # the agents `wide` (int64 [J], rows of this group, on the device) at all n_q; None: all at n_q.
    # wide_pos int64 [G]: row g's place in `wide`, -1 if none (the ring step writes their segments)
    wide: torch.Tensor | None = None
    wide_pos: torch.Tensor | None = None
    narrow: int = 0
    # device tensors the recent windows derive from the fields above, made by the first layer that
    # needs them and shared by the rest of this forward (polykv.pool.ring: fewer kernels per layer)
    memo: dict = field(default_factory=dict)


class AgentCache(Cache):
    """Per-agent private suffix storage over one shared compressed prefix (see module doc).

    doc_layers: the document's CompressedLayers (batch 1, compacted; shared, never written), or its
        HostLayers (host tier: streamed to `device` in chunks)
    prefix_start: per layer, absolute position of prefix row 0; doc_len: P (suffix row 0 sits at P)
    windows: per layer sliding window or None
    batch_capacity / seq_capacity: slots and pages to allocate up front (batch_capacity *
        ceil(seq_capacity / PAGE_SIZE) pages; more are added on demand).
    device: where suffixes live and attention runs (default: the document layers' device; the pool
        passes its device, which host-tier layers are not on).
    recent: R, each agent's recent window (`polykv.pool.ring`; 0: none, the path without windows)
    """

    def __init__(self, doc_layers: list[CompressedLayer], prefix_start: list[int], doc_len: int,
                 windows: list[int | None], batch_capacity: int = 4, seq_capacity: int = 0,
                 backend: str = "auto", page_size: int = PAGE_SIZE, device=None, recent: int = 0):
        super().__init__(layers=[])
        self.doc_layers = doc_layers
        self.prefix_start = prefix_start
        self.doc_len = int(doc_len)
        self.windows = windows
        self.backend = backend
        self.device = torch.device(device) if device is not None else doc_layers[0].device
        self.streamed = isinstance(doc_layers[0], HostLayer)
        self.streamer = (PrefixStreamer(self.device, max(l.max_chunk_bytes() for l in doc_layers))
                         if self.streamed else None)
        self.pages = PageTable(page_size, self.device)
        self.store = [PagedRows(d.k_codec, d.v_codec, d.kv_heads, page_size, self.device, d.key_scales)
                      for d in doc_layers]
        self.lens = torch.zeros(0, dtype=torch.long)  # host: valid suffix rows per slot
        self._nbytes: tuple[int, int] | None = None
        # recent windows (polykv.pool.ring): per layer R_l, a sliding layer's at most window - 1
        recent = int(recent)
        if recent < 0:
            raise ValueError(f"recent must be >= 0, got {recent}")
        self.recent = recent
        self.ring_recent = [min(recent, w - 1) if w is not None else recent for w in windows]
        self.rings = None
        if recent:
            from .ring import AgentRings

            self.rings = AgentRings(self.ring_recent, [d.head_dim for d in doc_layers],
                                    [d.kv_heads for d in doc_layers], 0, self.device)
        self._segments: dict[int, tuple] = {}  # layer -> this forward's window segment (update -> attend)
        self.reserve(max(1, batch_capacity), seq_capacity)
        self._group: Group | None = None

    # --- storage -----------------------------------------------------------------------------
    @property
    def batch_capacity(self) -> int:
        return self.pages.slots

    @property
    def storage_version(self) -> int:
        """Changes whenever a tensor the kernels read is reallocated (captured steps go stale)."""
        return self.pages.version + (self.rings.version if self.rings is not None else 0)

    def reserve(self, batch_capacity: int, seq_capacity: int = 0) -> None:
        """Room for at least batch_capacity slots, and free pages for batch_capacity *
        ceil(seq_capacity / page_size) rows beyond those in use (allocated now: no growth later)."""
        b = max(self.batch_capacity, int(batch_capacity))
        self.pages.reserve(b, self.pages.pages_for(seq_capacity))
        self.reserve_rows([seq_capacity] * b)
        if b > self.lens.numel():
            lens = torch.zeros(b, dtype=torch.long)
            lens[: self.lens.numel()] = self.lens
            self.lens = lens
        if self.rings is not None:
            self.rings.reserve(b, 0, self.lens)

    def reserve_ring_spare(self, drafts: int) -> None:
        """Windows keep `drafts` spare rows per agent, so that rolling back that many rejected
        drafts (+ the token before them) leaves them exact (`polykv.pool.ring`). No-op without."""
        if self.rings is not None and int(drafts) > self.rings.spare:
            self.rings.reserve(self.batch_capacity, int(drafts), self.lens)

    def reserve_rows(self, rows: list[int]) -> None:
        """Free pages for agents of rows[i] rows each, beyond the pages in use (allocated now, so
        those agents grow without reallocating the pools)."""
        want = self.pages.used_pages() + sum(self.pages.pages_for(r) for r in rows)
        if want > self.pages.n_pages:
            self.pages.add_pages(want - self.pages.n_pages)
        self.grow_storage()

    def growth_bytes(self, rows: list[int]) -> int:
        """Bytes the page pools may grow by before agents of rows[i] rows each — every agent of
        the cache, those it holds and those about to join — all fit: 0 while the pool's pages hold
        them, else up to the first doubling of the pool (as `PageTable.ensure` grows it page by
        page) that does, at every layer's measured bytes per page."""
        need = sum(self.pages.pages_for(r) for r in rows)
        n = self.pages.n_pages
        if need <= n:
            return 0
        grown = max(n, 1)
        while grown < need:
            grown *= 2
        return (grown - n) * sum(st.page_bytes() for st in self.store)

    def grow_storage(self) -> None:
        """Grow every layer's page pool to the page table's page count (after `pages.ensure`)."""
        if self.store[0].n_pages != self.pages.n_pages:
            for st in self.store:
                st.grow(self.pages.n_pages)

    def ensure_rows(self, slots: list[int], rows: list[int]) -> None:
        """Pages for rows[i] rows in slots[i] (a new page is taken from the free list; the pool
        grows only when none is free)."""
        for s, r in zip(slots, rows):
            self.pages.ensure(s, r)
        self.grow_storage()

    def move_slot(self, src: int, dst: int) -> None:
        """Agent slot `src` becomes slot `dst` (swap-remove compaction): its page-table row moves,
        no K/V row is copied; dst's pages are freed."""
        self.pages.move(src, dst)
        if self.rings is not None:
            self.rings.move(src, dst)  # C rows per layer copied (the window is not paged)
        self.lens[dst] = self.lens[src]
        self.lens[src] = 0

    def truncate(self, slot: int, rows: int) -> None:
        """Cut slot's suffix back to its first `rows` rows (speculative rollback). The rows beyond
        stay in their pages as garbage that no attention reads (every read stops at `lens`) and the
        next write to those positions overwrites; the pages stay with the slot (it grows into them
        again)."""
        rows = int(rows)
        if not 0 <= rows <= int(self.lens[slot]):
            raise ValueError(f"truncate: slot {slot} holds {int(self.lens[slot])} rows, cannot cut to {rows}")
        old = int(self.lens[slot])
        self.lens[slot] = rows
        self._refill_rings([slot], [old])

    def rollback(self, slots: list[int], rows: list[int]) -> None:
        """`truncate` of several slots at once: slot slots[i] loses its last rows[i] rows (one
        indexed update instead of a tensor read and write per agent)."""
        lens = self.lens.numpy()  # the host lengths, viewed (no tensor op per call: ~4x faster)
        new = lens[slots] - rows
        if min(rows) < 0 or (new < 0).any():
            raise ValueError(f"rollback: cannot cut {rows} rows from slots {slots} of lengths {lens[slots].tolist()}")
        old = lens[slots].tolist() if self.rings is not None else None
        lens[slots] = new
        if old is not None:
            self._refill_rings(list(slots), old)

    def _refill_rings(self, slots: list[int], old: list[int]) -> None:
        """After slots[i] was cut from old[i] rows to lens[slot]: positions its window needs that the
        cut rows overwrote (a cut deeper than the spare rows + 1) are written again from the pages
        (the pool's codec, decoded to true space, then q8_0; `polykv.pool.ring`)."""
        if self.rings is None:
            return
        lens, spare = self.lens.numpy(), self.rings.spare
        for slot, before in zip(slots, old):
            now = int(lens[slot])
            if before - now <= spare:
                # a cut into the spare rows (rejected drafts): every layer holds [before - R_l -
                # spare, before) ⊇ [now - R_l, now), nothing to refill — one test per slot, not
                # one per layer (30 layers x 32 agents were ~1 ms of a verify step's host time)
                continue
            for li, lay in enumerate(self.rings.layers):
                # held after the forward: [before - C, before); needed: [now - R, now)
                need = list(range(max(0, now - lay.recent), min(now, before - lay.capacity)))
                if need:
                    k, v = self._decode_suffix_rows(li, slot, need)
                    self.rings.refill(li, slot, need, k, v)

    def _decode_suffix_rows(self, li: int, slot: int, positions: list[int]):
        """True-space float32 k, v [Hkv, T, D] of `slot`'s suffix rows at `positions` (pages)."""
        st = self.store[li]
        rows = torch.tensor([self.pages.row(slot, p) for p in positions], device=self.device)
        k = st.k_codec.decode(Packed(st.k.codes[:, rows], None if st.k.scales is None else st.k.scales[:, rows])).float()
        v = st.v_codec.decode(Packed(st.v.codes[:, rows], None if st.v.scales is None else st.v.scales[:, rows])).float()
        if st.key_scales is not None:
            k = k / st.key_scales[:, None, :]
        return k, v

    def clear_slot(self, slot: int) -> None:
        """Empty a slot and free its pages."""
        self.pages.free(slot)
        self.lens[slot] = 0

    def reset(self) -> None:
        """Empty every slot for a new batch, keeping the storage (page pools, page table, stream
        buffers): what a freshly built cache of the same page count holds — all pages free, in the
        order a fresh table hands them out (slot 0 first takes page 0) — so the next batch's rows
        land where a fresh cache's would. `storage_version` is unchanged: captured steps stay valid.
        Rows left in the pages are garbage that no attention reads (every read stops at `lens`)."""
        pages = self.pages
        for s in range(pages.slots):
            pages.free(s)
        pages.free_pages.sort(reverse=True)  # pop() takes the lowest page first, as a fresh table
        self.lens.zero_()
        self._group = None
        if self.streamer is not None:
            self.streamer.chunks_read = self.streamer.bytes_read = 0

    def nbytes(self) -> int:
        """Measured bytes of all suffix storage (the page pools, free pages included); measured
        again only after storage changed."""
        if self._nbytes is None or self._nbytes[0] != self.storage_version:
            self._nbytes = (self.storage_version, storage_bytes(self.tensors()))
        return self._nbytes[1]

    def tensors(self) -> list[torch.Tensor]:
        """The suffix page pools of every layer, and the agents' recent windows."""
        ring = self.rings.tensors() if self.rings is not None else []
        return [t for st in self.store for t in st.tensors()] + ring

    def ring_tensors(self) -> list[torch.Tensor]:
        """The agents' recent windows alone (memory_report's kv_bytes_ring)."""
        return self.rings.tensors() if self.rings is not None else []

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Device buffers of the prefix streamer (host-tier documents on CUDA; else none)."""
        return self.streamer.tensors() if self.streamer is not None else []

    def scratch_row(self) -> int:
        return self.store[0].scratch_row

    # --- one forward -------------------------------------------------------------------------
    def begin(self, slots: list[int], counts: list[int], n_q: int) -> None:
        """Prepare a forward of len(slots) agents (row g = agent in slots[g]) with n_q query columns,
        left-padded: agent g's counts[g] real tokens are its last columns. Host work only, plus one
        host-to-device copy of the write rows and lengths (and of the page table when it changed)."""
        slots_t = torch.tensor(slots, dtype=torch.long)
        counts_t = torch.tensor(counts, dtype=torch.long)
        base = self.lens[slots_t]
        new = base + counts_t
        self.ensure_rows(slots, new.tolist())
        # column j of agent g holds suffix position new[g] - n_q + j; < base[g] means padding
        pos = new[:, None] - n_q + torch.arange(n_q)[None, :]
        pos = torch.where(pos < base[:, None], torch.full_like(pos, -1), pos)
        rows = self.pages.flat_rows(slots_t, pos, self.scratch_row())
        packed = torch.cat([rows.reshape(-1), new]).to(self.device, non_blocking=True)
        G = len(slots)
        contiguous = slots == list(range(slots[0], slots[0] + G)) if slots else True
        sel = slice(slots[0], slots[0] + G) if contiguous else slots_t.to(self.device)
        self._group = Group(sel=sel, n_q=n_q, rows=packed[: G * n_q].view(G, n_q),
                            lens=packed[G * n_q:].to(torch.int32),
                            seq=int(new.max()) if G else 0, slots=slots_t, new=new)

    def commit(self) -> None:
        g = self._group
        self.lens[g.slots] = g.new
        self._group = None
        self._segments.clear()

    def abort(self) -> None:
        self._group = None
        self._segments.clear()

    def positions(self) -> torch.Tensor:
        """position_ids [G, n_q] of the current group: doc_len + suffix index (pads clamped)."""
        g = self._group
        qpos = g.new[:, None] - g.n_q + torch.arange(g.n_q)[None, :]
        return (self.doc_len + qpos).clamp_min(0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.doc_len + (int(self.lens.max()) if self.lens.numel() else 0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        activate(self)
        g = self._group
        if g.rows.numel():
            store = self.store[layer_idx]
            if self.rings is None:
                store.write(key_states, value_states, g.rows)
            else:
                # the page write rides on the ring step's launch on the kernels
                on_kernels = dispatch.use_triton(key_states, store.k.codes)
                pages = store.target(key_states.shape[0], g.rows) if on_kernels else None
                if pages is None:
                    store.write(key_states, value_states, g.rows)
                self._segments[layer_idx] = self.rings.write(
                    layer_idx, key_states, value_states, g.sel, g.lens, g.rows, self.scratch_row(),
                    memo=g.memo, pages=pages, wide=None if g.wide is None else (g.wide, g.wide_pos))
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        li = module.layer_idx
        if self.streamed:
            return self._attend_streamed(li, query, scaling)
        g = self._group
        seg = self._segments.pop(li) if self.rings is not None else None
        if g.wide is None:
            return self._cascade(li, query, scaling, self._agents(li, seg, None), seg).transpose(1, 2)
        # a split step (prompts joining agents that decode): every agent's last `narrow` columns in
        # one cascade, the wide agents' every column in another, instead of every agent at the
        # prompt's width (~31 + P of 32 x P columns real: BENCHMARKS §8.16). Padded columns get
        # zeros: nothing reads what they compute (their K/V rows go to the scratch rows).
        B, Hq, n_q, D = query.shape
        shift = n_q - g.narrow
        out = query.new_zeros(B, n_q, Hq, D)  # token-major, as the cascade's own output
        narrow = None if seg is None else (*(p.index((slice(None), slice(None), slice(shift, None)))
                                             for p in seg[:2]), seg[2])
        out[:, shift:] = self._cascade(li, query[:, :, shift:], scaling, self._agents(li, narrow, shift),
                                       narrow).transpose(1, 2)
        wide = None if seg is None else (seg[3], seg[4], seg[2])  # written by the ring step
        got = self._cascade(li, query.index_select(0, g.wide), scaling, self._agents(li, wide, g.wide), wide)
        out.index_copy_(0, g.wide, got.transpose(1, 2))
        return out

    def _agents(self, li: int, seg, part) -> tuple:
        """What one cascade call of this forward reads per agent: (lens int32 [n], the lengths of
        the rows older than the window int32 [n] or None, page table int32 [n, pages], the window
        segment's kv_start int32 [n] or None) for part None (the group's agents), an int s (the
        same agents, their segment s rows shorter: a split step's narrow columns) or int64 [J]
        (the agents of those rows). Made once per forward (`Group.memo`) and segment layout."""
        g = self._group
        start = None if seg is None else seg[2]
        kind = None if part is None else "narrow" if isinstance(part, int) else "wide"
        key = ("agents", kind, id(start))
        got = g.memo.get(key)
        if got is None or got[0] is not start:
            lens = g.lens.to(device=self.device, dtype=torch.int32)
            # the older rows' lengths max(L - R, 0): made with the ring's indices (`AgentRings.write`)
            older = None if seg is None else g.memo[("older", self.ring_recent[li])]
            table = self.pages.device_table()[g.sel]
            if kind == "narrow" and start is not None:
                start = (start - part).clamp_min(0)  # the segment starts `part` rows later
            elif kind == "wide":
                lens, table = lens.index_select(0, part), table.index_select(0, part)
                if seg is not None:
                    older, start = older.index_select(0, part), start.index_select(0, part)
            got = g.memo[key] = (None if seg is None else seg[2], (lens, older, table, start))
        return got[1]

    def _cascade(self, li: int, query, scaling, agents: tuple, seg):
        """One cascade call of layer li for the query rows [n, Hq, n_q, D] of `agents` (`_agents`)
        with their window segment (k, v Packed [n, Hkv, R - 1 + n_q], kv_start, ...) or None: the
        shared prefix, the agents' suffix pages (the rows older than the window where there is
        one) and the segment, merged in the cascade's own combine. Returns [n, Hq, n_q, D]."""
        lens, older, table, start = agents
        doc = self.doc_layers[li]
        sk, sv = self.store[li].pool()
        recent = None
        if seg is not None:
            recent = RecentSegment(seg[0], seg[1], self.rings.layers[li].codec, self.ring_recent[li],
                                   start, lens)
        out, _ = cascade_attention(
            query, doc.keys(), doc.values(), sk, sv, lens if seg is None else older, doc.k_codec,
            doc.v_codec, sm_scale=scaling, k_innerq=doc.key_scales, window=self.windows[li],
            prefix_start=self.prefix_start[li], prefix_end=self.doc_len, backend=self.backend,
            suffix_pages=table, page_size=self.pages.page_size, suffix_rows=self._group.seq,
            recent=recent)
        return out

    def _attend_streamed(self, li: int, query, scaling):
        """Attention of a layer of a host-tier document: the prefix streamed in chunks
        (`streamed_cascade_attention`); with recent windows the segment, the streamed cascade and
        their merges apart. Returns [n, n_q, Hq, D]."""
        g = self._group
        doc = self.doc_layers[li]
        sk, sv = self.store[li].pool()
        common = dict(sm_scale=scaling, k_innerq=doc.key_scales, window=self.windows[li],
                      prefix_start=self.prefix_start[li], prefix_end=self.doc_len, backend=self.backend)
        P = self.pages.page_size
        table = self.pages.device_table()[g.sel]
        if self.rings is None:
            out, _ = streamed_cascade_attention(query, self.streamer.chunks(doc), sk, sv, g.lens,
                                                doc.k_codec, doc.v_codec, suffix_pages=table,
                                                page_size=P, suffix_rows=g.seq, **common)
            return out.transpose(1, 2)
        R, W = self.ring_recent[li], self.windows[li]
        seg_k, seg_v, seg_start = self._segments.pop(li)[:3]
        ring = self.rings.layers[li]
        lens = g.lens.to(device=query.device, dtype=torch.int32)
        main = g.memo[("older", R)]
        out_r, lse_r = dispatch.attention_decode(query, seg_k, seg_v, ring.codec, ring.codec, causal=True,
                                                 sm_scale=scaling, window=R, kv_start=seg_start)
        # full layers: one cascade over the suffix rows older than the window (lengths L - R);
        # sliding layers: the prefix pass alone (suffix_rows=0 reads no suffix row, the real
        # lengths place the queries), the older suffix rows below
        seq_lens, rows = (main, g.seq) if W is None else (lens, 0)
        out_m, lse_m = streamed_cascade_attention(query, self.streamer.chunks(doc), sk, sv, seq_lens,
                                                  doc.k_codec, doc.v_codec, **common, suffix_pages=table,
                                                  page_size=P, suffix_rows=rows)
        if W is not None:
            rows = max(1, int(g.seq))
            n_pages = -(-rows // P)
            dk, dv = (dispatch.gather_pages(p, table[:, :n_pages], P).index(
                (slice(None), slice(None), slice(0, rows))) for p in (sk, sv))
            out_s, lse_s = dispatch.attention_decode(query, dk, dv, doc.k_codec, doc.v_codec, kv_lens=main,
                                                     causal=True, sm_scale=scaling, window=W - R,
                                                     k_innerq=doc.key_scales)
            out_m, lse_m = dispatch.merge_attention(out_m, lse_m, out_s, lse_s)
        out, _ = dispatch.merge_attention(out_m, lse_m, out_r, lse_r)
        return out.to(query.dtype).transpose(1, 2)
