"""transformers Cache subclasses used by the pool (imported lazily: this module imports transformers).

* `AgentCache`    — N agents over one shared document. The prefix is the document's compressed layers
  (batch 1, shared, read-only); each agent's suffix lives in per-layer packed slot storage
  (`polykv.cache.SlotRows`: one slot of seq_capacity rows per agent) with per-agent valid lengths
  (`lens`). Attention is the
  cascade (prefix read once per layer per forward for all agents) merged with each agent's own suffix
  by LSE. transformers' attention mask is ignored: the cache knows every agent's length.

It implements the polykv attention protocol (`polykv.hf.attention`): `update` marks the cache
active and returns the new rows; `attend(module, query, ...)` returns [B, q_len, Hq, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..cache.accounting import storage_bytes
from ..cache.layer import CompressedLayer
from ..cache.slots import SlotRows
from ..hf.attention import activate
from .attention import cascade_attention


def dummy_mask(batch: int, q_len: int, device) -> torch.Tensor:
    """A 4D placeholder mask: transformers returns 4D masks as-is (no [B, q, kv] mask is built);
    the pool's caches ignore it."""
    return torch.ones(batch, 1, q_len, 1, dtype=torch.bool, device=device)


@dataclass
class Group:
    """One forward of the agents in `slots` (row g = agent in slots[g]), n_q query columns each,
    left-padded. Host fields drive bookkeeping; device fields are what the kernels read (a captured
    decode step keeps static device tensors here and refills them in place)."""

    sel: slice | torch.Tensor  # the slots, as a slice when contiguous (a strided view, no gather)
    n_q: int
    rows: torch.Tensor  # int64 [G, n_q] flat write rows (device; padded columns -> scratch row)
    lens: torch.Tensor  # int32 [G] suffix lengths after this forward (device)
    seq: int  # suffix rows the attention reads per agent (>= every length)
    slots: torch.Tensor | None = None  # int64 [G] (host)
    new: torch.Tensor | None = None  # int64 [G] lengths after this forward (host)


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
        self.device = doc_layers[0].device
        self.store = [SlotRows(d.k_codec, d.v_codec, d.kv_heads, d.device, d.key_scales)
                      for d in doc_layers]
        self.lens = torch.zeros(0, dtype=torch.long)  # host: valid suffix rows per slot
        self.batch_capacity = 0
        self.seq_capacity = 0
        self.storage_version = 0  # bumped whenever storage is reallocated (captured steps go stale)
        self.reserve(max(1, batch_capacity), seq_capacity)
        self._group: Group | None = None

    # --- storage -----------------------------------------------------------------------------
    def reserve(self, batch_capacity: int, seq_capacity: int) -> None:
        """Grow storage to at least batch_capacity slots x seq_capacity rows per layer (exact sizes;
        callers decide the growth policy). Existing rows are kept."""
        b = max(self.batch_capacity, int(batch_capacity))
        s = max(self.seq_capacity, int(seq_capacity))
        if b == self.batch_capacity and s == self.seq_capacity:
            return
        for st in self.store:
            st.reserve(b, s)
        lens = torch.zeros(b, dtype=torch.long)
        lens[: self.lens.numel()] = self.lens
        self.lens = lens
        self.batch_capacity, self.seq_capacity = b, s
        self.storage_version += 1

    def ensure_rows(self, rows: int) -> None:
        """Room for `rows` suffix rows per slot (grows by doubling, at least 16)."""
        if rows > self.seq_capacity:
            self.reserve(self.batch_capacity, max(rows, 2 * self.seq_capacity, 16))

    def move_slot(self, src: int, dst: int) -> None:
        """Copy agent slot `src` (its valid rows) into slot `dst` (swap-remove compaction)."""
        n = int(self.lens[src])
        for st in self.store:
            st.move(src, dst, n)
        self.lens[dst] = n
        self.lens[src] = 0

    def clear_slot(self, slot: int) -> None:
        self.lens[slot] = 0

    def nbytes(self) -> int:
        """Measured bytes of all suffix storage (allocated capacity included)."""
        return storage_bytes(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for st in self.store for t in st.tensors()]

    # --- one forward -------------------------------------------------------------------------
    def begin(self, slots: list[int], counts: list[int], n_q: int) -> None:
        """Prepare a forward of len(slots) agents (row g = agent in slots[g]) with n_q query columns,
        left-padded: agent g's counts[g] real tokens are its last columns. Host work only, plus one
        host-to-device copy of the write rows and lengths."""
        slots_t = torch.tensor(slots, dtype=torch.long)
        counts_t = torch.tensor(counts, dtype=torch.long)
        base = self.lens[slots_t]
        new = base + counts_t
        need = int(new.max()) if len(slots) else 0
        self.ensure_rows(need)
        # column j of agent g holds suffix position new[g] - n_q + j; < base[g] means padding
        pos = new[:, None] - n_q + torch.arange(n_q)[None, :]
        pos = torch.where(pos < base[:, None], torch.full_like(pos, -1), pos)
        rows = self.store[0].flat_rows(slots_t, pos)
        packed = torch.cat([rows.reshape(-1), new]).to(self.device, non_blocking=True)
        G = len(slots)
        contiguous = slots == list(range(slots[0], slots[0] + G)) if slots else True
        sel = slice(slots[0], slots[0] + G) if contiguous else slots_t.to(self.device)
        self._group = Group(sel=sel, n_q=n_q, rows=packed[: G * n_q].view(G, n_q),
                            lens=packed[G * n_q:].to(torch.int32), seq=need, slots=slots_t,
                            new=new)

    def commit(self) -> None:
        g = self._group
        self.lens[g.slots] = g.new
        self._group = None

    def abort(self) -> None:
        self._group = None

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
            self.store[layer_idx].write(key_states, value_states, g.rows)
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        li = module.layer_idx
        g = self._group
        doc = self.doc_layers[li]
        sk, sv = self.store[li].view(g.sel, g.seq)
        out, _ = cascade_attention(
            query, doc.keys(), doc.values(), sk, sv, g.lens, doc.k_codec, doc.v_codec,
            sm_scale=scaling, k_innerq=doc.key_scales, window=self.windows[li],
            prefix_start=self.prefix_start[li], prefix_end=self.doc_len, backend=self.backend)
        return out.transpose(1, 2)
