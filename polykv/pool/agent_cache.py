"""transformers Cache subclasses used by the pool (imported lazily: this module imports transformers).

* `AgentCache`    — N agents over one shared document. The prefix is the document's compressed layers
  (batch 1, shared, read-only); each agent's suffix lives in per-layer packed storage of leading shape
  [batch_capacity, kv_heads, seq_capacity] with per-agent valid lengths (`lens`). Attention is the
  cascade (prefix read once per layer per forward for all agents) merged with each agent's own suffix
  by LSE. transformers' attention mask is ignored: the cache knows every agent's length.

It implements the polykv attention protocol (`polykv.hf.attention`): `update` marks the cache
active and returns the new rows; `attend(module, query, ...)` returns [B, q_len, Hq, D].
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..cache.layer import CompressedLayer
from ..hf.attention import activate
from .attention import cascade_attention


def dummy_mask(batch: int, q_len: int, device) -> torch.Tensor:
    """A 4D placeholder mask: transformers returns 4D masks as-is (no [B, q, kv] mask is built);
    the pool's caches ignore it."""
    return torch.ones(batch, 1, q_len, 1, dtype=torch.bool, device=device)


class AgentCache(Cache):
    """Per-agent private suffix storage over one shared compressed prefix (see module doc).

    doc_layers: the document's CompressedLayers (batch 1, compacted; shared, never written)
    prefix_start: per layer, absolute position of prefix row 0; doc_len: P (suffix row 0 sits at P)
    windows: per layer sliding window or None
    """

    def __init__(self, doc_layers: list[CompressedLayer], prefix_start: list[int], doc_len: int,
                 windows: list[int | None], batch_capacity: int = 4, seq_capacity: int = 0,
                 backend: str = "auto"):
        super().__init__(layers=[])
        self.doc_layers = doc_layers
        self.prefix_start = prefix_start
        self.doc_len = int(doc_len)
        self.windows = windows
        self.backend = backend
        self.store = [CompressedLayer(d.k_codec, d.v_codec, 0, d.kv_heads, d.device, d.key_scales)
                      for d in doc_layers]
        self.device = doc_layers[0].device
        self.lens = torch.zeros(0, dtype=torch.long)
        self.batch_capacity = 0
        self.seq_capacity = 0
        self.reserve(max(1, batch_capacity), seq_capacity)
        self._group = None

    # --- storage -----------------------------------------------------------------------------
    def reserve(self, batch_capacity: int, seq_capacity: int) -> None:
        """Grow storage to at least [batch_capacity, kv_heads, seq_capacity] per layer (exact sizes;
        callers decide the growth policy). Existing rows are kept."""
        b = max(self.batch_capacity, int(batch_capacity))
        s = max(self.seq_capacity, int(seq_capacity))
        if b == self.batch_capacity and s == self.seq_capacity:
            return
        for st in self.store:
            k_new = st.k_codec.empty((b, st.kv_heads, s), st.device)
            v_new = st.v_codec.empty((b, st.kv_heads, s), st.device)
            if st.k is not None and self.batch_capacity and self.seq_capacity:
                ob, os_ = self.batch_capacity, self.seq_capacity
                for dst, src in ((k_new, st.k), (v_new, st.v)):
                    dst.codes[:ob, :, :os_] = src.codes
                    if dst.scales is not None:
                        dst.scales[:ob, :, :os_] = src.scales
            st.k, st.v = k_new, v_new
            st.batch = b
            st.length = s  # rows beyond an agent's `lens` entry are masked, never read as valid
        lens = torch.zeros(b, dtype=torch.long)
        lens[: self.lens.numel()] = self.lens
        self.lens = lens
        self.batch_capacity, self.seq_capacity = b, s

    def move_slot(self, src: int, dst: int) -> None:
        """Copy agent slot `src` (its valid rows) into slot `dst` (swap-remove compaction)."""
        n = int(self.lens[src])
        for st in self.store:
            for p in (st.k, st.v):
                p.codes[dst, :, :n] = p.codes[src, :, :n]
                if p.scales is not None:
                    p.scales[dst, :, :n] = p.scales[src, :, :n]
        self.lens[dst] = n
        self.lens[src] = 0

    def clear_slot(self, slot: int) -> None:
        self.lens[slot] = 0

    def nbytes(self) -> int:
        """Measured bytes of all suffix storage (allocated capacity included)."""
        from ..cache.accounting import storage_bytes

        ts = []
        for st in self.store:
            if st.k is not None:
                ts += [st.k.codes, st.k.scales, st.v.codes, st.v.scales]
        return storage_bytes(ts)

    def tensors(self) -> list[torch.Tensor]:
        ts = []
        for st in self.store:
            if st.k is not None:
                ts += [st.k.codes, st.k.scales, st.v.codes, st.v.scales]
        return [t for t in ts if t is not None]

    # --- one forward -------------------------------------------------------------------------
    def begin(self, slots: list[int], counts: list[int], n_q: int) -> None:
        """Prepare a forward of len(slots) agents (row g = agent in slots[g]) with n_q query columns,
        left-padded: agent g's counts[g] real tokens are its last columns."""
        slots_t = torch.tensor(slots, dtype=torch.long)
        counts_t = torch.tensor(counts, dtype=torch.long)
        base = self.lens[slots_t]
        new = base + counts_t
        need = int(new.max()) if len(slots) else 0
        if need > self.seq_capacity:
            self.reserve(self.batch_capacity, max(need, 2 * self.seq_capacity, 16))
        g_idx = torch.repeat_interleave(torch.arange(len(slots)), counts_t)
        offs = torch.cat([torch.arange(int(c)) for c in counts]) if len(slots) else torch.zeros(0, dtype=torch.long)
        j_idx = n_q - counts_t[g_idx] + offs
        contiguous = slots == list(range(slots[0], slots[0] + len(slots))) if slots else True
        self._group = dict(slots=slots_t, new=new, n_q=n_q, g_idx=g_idx, j_idx=j_idx,
                           w_slot=slots_t[g_idx], w_pos=base[g_idx] + offs,
                           sel=(slice(slots[0], slots[0] + len(slots)) if contiguous else slots_t),
                           smax=need)

    def commit(self) -> None:
        g = self._group
        self.lens[g["slots"]] = g["new"]
        self._group = None

    def abort(self) -> None:
        self._group = None

    def positions(self) -> torch.Tensor:
        """position_ids [G, n_q] of the current group: doc_len + suffix index (pads clamped)."""
        g = self._group
        n_q = g["n_q"]
        qpos = g["new"][:, None] - n_q + torch.arange(n_q)[None, :]
        return (self.doc_len + qpos).clamp_min(0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.doc_len + (int(self.lens.max()) if self.lens.numel() else 0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        activate(self)
        g = self._group
        st = self.store[layer_idx]
        if g["g_idx"].numel():
            k = key_states[g["g_idx"], :, g["j_idx"], :]  # [M, Hkv, D]
            v = value_states[g["g_idx"], :, g["j_idx"], :]
            if st.key_scales is not None:
                k = k * st.key_scales.to(k.dtype)[None]
            pk = st.k_codec.encode(k, check=False)
            pv = st.v_codec.encode(v, check=False)
            for dst, src in ((st.k, pk), (st.v, pv)):
                dst.codes[g["w_slot"], :, g["w_pos"]] = src.codes
                if dst.scales is not None:
                    dst.scales[g["w_slot"], :, g["w_pos"]] = src.scales
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        li = module.layer_idx
        g = self._group
        doc = self.doc_layers[li]
        st = self.store[li]
        sel = (g["sel"], slice(None), slice(0, g["smax"]))
        out, _ = cascade_attention(
            query, doc.keys(), doc.values(), st.k.index(sel), st.v.index(sel), g["new"],
            doc.k_codec, doc.v_codec, sm_scale=scaling, k_innerq=doc.key_scales,
            window=self.windows[li], prefix_start=self.prefix_start[li], prefix_end=self.doc_len,
            backend=self.backend)
        return out.transpose(1, 2)
