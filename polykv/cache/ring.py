"""The recent window of one attention layer: the last `size` rows held at q8_0 beside the layer's codec.

Issue K, docs/quality.md ("Anchors: a recent-token window at q8_0, simulated" measured it; "Anchors:
the recent window as storage" is this module). Write-once: every new row goes into the layer's main
storage in its own codec (as without a ring) and into slot `position mod size` here; attention reads
main rows [0, L - size) in the layer's codec and these rows for [L - size, L) — the main copy of a
row is simply not read while its position is in the window.

    ring = RecentRing(32, head_dim=64, batch=1, kv_heads=3, device="cpu")
    ring.write(k, v, first=L)          # k, v [B, H, T, D] at positions L .. L+T-1 (the last `size` kept)
    k_p, v_p = ring.rows(start, stop)  # Packed [B, H, stop-start], position order (a gathered copy)
    k_p, v_p, first = ring.ordered(end)  # the `size` slots in position order, row i = position first+i

Rows are stored in true space (keys neither InnerQ-scaled nor rotated): the fused kernels read them as
q8_0 with a true-space query; the materialize path maps them into the domain it attends in
(`PolyKVLayer.attention_domain`). A slot's position is never stored: callers know the layer's length,
so the window [max(0, L - size), L) is implied. Writes go through the quantize-on-write kernel on CUDA
(`dispatch.quantize_into`; the codec's encode elsewhere), so the ring's q8_0 rows are the codec's
bytes on either path.
"""

from __future__ import annotations

import torch

from ..codecs import Packed, get_codec
from .accounting import storage_bytes

RING_TYPE = "q8_0"


class RecentRing:
    """K and V rows, leading shape [batch, kv_heads, size], codec `RING_TYPE` (see module doc)."""

    def __init__(self, size: int, head_dim: int, batch: int, kv_heads: int, device=None,
                 type: str = RING_TYPE):
        if size < 1:
            raise ValueError(f"a recent ring holds at least one row, got size {size}")
        self.size = int(size)
        self.codec = get_codec(type, head_dim)
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.k = self.codec.empty((batch, kv_heads, self.size), self.device)
        self.v = self.codec.empty((batch, kv_heads, self.size), self.device)

    # --- writes ------------------------------------------------------------------------------
    def write(self, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
        """Rows k, v [B, H, T, D] (true space) at positions first .. first+T-1: the last
        min(T, size) of them go to their slots (earlier ones would be overwritten anyway)."""
        t = k.shape[2]
        m = min(t, self.size)
        if m == 0:
            return
        if m < t:
            k, v, first = k[:, :, t - m:], v[:, :, t - m:], first + t - m
        slots = torch.arange(first, first + m, device=self.device) % self.size
        self._put(k, v, slots[None, :].expand(k.shape[0], m))

    def write_at(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Rows k, v [B, H, T, D] at positions int64 [B, T] on the device (the captured decode
        step: no host value needed; T <= size)."""
        self._put(k, v, positions % self.size)

    def _put(self, k, v, slots: torch.Tensor) -> None:
        from ..kernels import dispatch

        dispatch.quantize_kv_into(self.k, k, self.codec, self.v, v, self.codec, slots)

    # --- reads -------------------------------------------------------------------------------
    def rows(self, start: int, stop: int) -> tuple[Packed, Packed]:
        """Rows of positions [start, stop) in position order (a gathered copy), Packed leading
        [B, H, stop - start]. The positions must be in the window (stop - start <= size)."""
        n = int(stop) - int(start)
        if n < 0 or n > self.size:
            raise ValueError(f"positions [{start}, {stop}) do not fit a ring of {self.size} rows")
        idx = torch.arange(int(start), int(stop), device=self.device) % self.size
        sl = (slice(None), slice(None), idx)
        return self.k.index(sl), self.v.index(sl)

    def decode(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """True-space float32 (k, v) [B, H, stop - start, D] of positions [start, stop)."""
        pk, pv = self.rows(start, stop)
        return self.codec.decode(pk), self.codec.decode(pv)

    def ordered(self, end) -> tuple[Packed, Packed, torch.Tensor | int]:
        """All `size` slots in position order for a window ending at `end` (exclusive): row i holds
        position end - size + i (rows at negative positions were never written). `end`: an int, or
        an int tensor [B] on the device (captured steps: gathered without a host sync). Returns
        (k, v, first) with first = end - size (same type as end)."""
        first = end - self.size
        ar = torch.arange(self.size, device=self.device)
        if isinstance(end, torch.Tensor):
            idx = (first.to(torch.int64)[:, None] + ar[None, :]) % self.size  # [B, size]
            bi = torch.arange(self.batch, device=self.device)[:, None]

            def take(x):
                return None if x is None else x[bi, :, idx].permute(0, 2, 1, 3).contiguous()

            return Packed(take(self.k.codes), take(self.k.scales)), \
                Packed(take(self.v.codes), take(self.v.scales)), first
        idx = (first + ar) % self.size
        sl = (slice(None), slice(None), idx)
        return self.k.index(sl), self.v.index(sl), first

    # --- batch / accounting ------------------------------------------------------------------
    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / subset the batch rows, as `CompressedLayer.select_batch`."""
        index = index.to(self.device)
        self.k, self.v = self.k.index(index), self.v.index(index)
        self.batch = int(index.numel())

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in (self.k, self.v) for t in (p.codes, p.scales) if t is not None]

    def nbytes(self) -> int:
        """Measured bytes of the ring's storage (all `size` slots)."""
        return storage_bytes(self.tensors())

    def used_nbytes(self, rows: int) -> int:
        """Payload bytes of `rows` (<= size) written slots."""
        rows = max(0, min(int(rows), self.size))
        return (self.k.nbytes() + self.v.nbytes()) * rows // self.size


__all__ = ["RING_TYPE", "RecentRing"]
