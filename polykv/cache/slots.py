"""Packed K/V rows of many private sequences (agent suffixes) of one attention layer.

Layout, per codec tensor (codes and, where the codec has them, scales):

    [kv_heads, slots * seq_capacity + 1, last]     rows of slot s at s * seq_capacity + position

The rows of one slot are contiguous, so `view` hands the kernels a strided [slots, kv_heads,
seq_capacity] view with no copy, and any (slot, position) is one flat row index: writes of any set
of slots go through one quantize-on-write launch (`write`). The last row is a scratch row: padded
query columns write there, so a left-padded batch needs no host-side gather of its real rows.
"""

from __future__ import annotations

import torch

from ..codecs import Codec, Packed
from .accounting import storage_bytes


class SlotRows:
    """Private packed K/V rows of `slots` sequences of up to `seq_capacity` rows each.

    k_codec / v_codec: codecs bound to the layer's head_dim.
    key_scales: InnerQ scales float32 [kv_heads, head_dim] applied to keys before encoding, or None.
    """

    def __init__(self, k_codec: Codec, v_codec: Codec, kv_heads: int, device,
                 key_scales: torch.Tensor | None = None):
        self.k_codec, self.v_codec = k_codec, v_codec
        self.kv_heads = kv_heads
        self.device = torch.device(device)
        self.key_scales = None if key_scales is None else key_scales.to(self.device, torch.float32)
        self.slots = 0
        self.seq_capacity = 0
        self.k: Packed | None = None  # leading [kv_heads, slots * seq_capacity + 1]
        self.v: Packed | None = None

    @property
    def scratch_row(self) -> int:
        """Flat index of the scratch row (writes of padded columns land here)."""
        return self.slots * self.seq_capacity

    def reserve(self, slots: int, seq_capacity: int) -> None:
        """Grow to at least `slots` x `seq_capacity` rows, keeping every slot's rows."""
        slots, seq = max(self.slots, int(slots)), max(self.seq_capacity, int(seq_capacity))
        if slots == self.slots and seq == self.seq_capacity and self.k is not None:
            return
        lead = (self.kv_heads, slots * seq + 1)
        k_new = self.k_codec.empty(lead, self.device)
        v_new = self.v_codec.empty(lead, self.device)
        if self.k is not None and self.slots and self.seq_capacity:
            n, s = self.slots, self.seq_capacity
            for new, old in ((k_new, self.k), (v_new, self.v)):
                for dst, src in _pairs(new, old):
                    d = dst[:, : slots * seq].unflatten(1, (slots, seq))
                    d[:, :n, :s] = src[:, : n * s].unflatten(1, (n, s))
        self.k, self.v = k_new, v_new
        self.slots, self.seq_capacity = slots, seq

    def move(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` rows of slot `src` into slot `dst`."""
        a, b = src * self.seq_capacity, dst * self.seq_capacity
        for t in self.tensors():
            t[:, b: b + rows] = t[:, a: a + rows]

    def flat_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 [G, T] flat row indices of (slots[g], positions[g, t]); positions < 0 -> scratch."""
        rows = slots[:, None] * self.seq_capacity + positions
        return torch.where(positions < 0, torch.full_like(rows, self.scratch_row), rows)

    def write(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Encode k, v [G, kv_heads, T, head_dim] (true space; keys unscaled) and store row (g, t) at
        flat row rows[g, t] (int64 [G, T] on the storage device). One quantize-on-write launch per
        tensor on CUDA; the codec's encode elsewhere."""
        from ..kernels import dispatch

        if dispatch.use_triton(k, self.k.codes):
            G = k.shape[0]
            dispatch.quantize_into(_broadcast(self.k, G), k, self.k_codec, rows,
                                   innerq=self.key_scales)
            dispatch.quantize_into(_broadcast(self.v, G), v, self.v_codec, rows)
            return
        if self.key_scales is not None:
            k = k * self.key_scales.to(k.dtype)[None, :, None, :]
        idx = rows.reshape(-1)
        for p, codec, x in ((self.k, self.k_codec, k), (self.v, self.v_codec, v)):
            enc = codec.encode(x, check=False)  # [G, H, T, ...]
            for dst, src in _pairs(p, enc):
                dst[:, idx] = src.permute(1, 0, 2, 3).reshape(self.kv_heads, idx.numel(), -1).to(dst.dtype)

    def view(self, sel=slice(None), seq: int | None = None) -> tuple[Packed, Packed]:
        """Packed K, V views [len(sel), kv_heads, seq] (strided, no copy for a slice `sel`; an index
        tensor gathers) of the first `seq` rows (default seq_capacity) of the selected slots."""
        seq = self.seq_capacity if seq is None else int(seq)
        n, cap = self.slots, self.seq_capacity

        def part(t):
            return None if t is None else t[:, : n * cap].unflatten(1, (n, cap)).transpose(0, 1)[sel, :, :seq]

        return (Packed(part(self.k.codes), part(self.k.scales)),
                Packed(part(self.v.codes), part(self.v.scales)))

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in (self.k, self.v) if p is not None for t in (p.codes, p.scales)
                if t is not None]

    def nbytes(self) -> int:
        """Measured bytes of the storage (allocated capacity included)."""
        return storage_bytes(self.tensors())


def _pairs(a: Packed, b: Packed):
    """(a.codes, b.codes) and, when both have them, (a.scales, b.scales)."""
    yield a.codes, b.codes
    if a.scales is not None:
        yield a.scales, b.scales


def _broadcast(p: Packed, G: int) -> Packed:
    """[kv_heads, R, last] storage as a [G, kv_heads, R] destination with batch stride 0: the
    quantize kernel then writes row (g, h, t) at flat row positions[g, t] of head h."""
    return Packed(p.codes[None].expand(G, *p.codes.shape),
                  None if p.scales is None else p.scales[None].expand(G, *p.scales.shape))
