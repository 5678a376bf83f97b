"""Compressed K/V storage of one attention layer for a batch of sequences.

Rows are encoded on write (InnerQ-scaled first for turbo keys) into preallocated packed storage
sized to the row by a prompt and grown in steps of an eighth of its capacity by decode (`reserve`);
nothing dense is kept. Sliding-window layers keep only the newest `keep` tokens (`trim`).
"""

from __future__ import annotations

import torch

from ..codecs import Codec, Packed, get_codec
from .accounting import storage_bytes

_MIN_CAPACITY = 64


class CompressedLayer:
    """Packed K and V rows, leading shape [batch, kv_heads, capacity].

    k_codec / v_codec: codecs bound to this layer's head_dim.
    key_scales: InnerQ scales float32 [kv_heads, head_dim] applied to keys before encoding (turbo K
        only), or None.
    """

    def __init__(self, k_codec: Codec, v_codec: Codec, batch: int, kv_heads: int,
                 device: torch.device | str | None = None, key_scales: torch.Tensor | None = None):
        if k_codec.head_dim != v_codec.head_dim:
            raise ValueError(f"K and V head_dim differ: {k_codec.head_dim} vs {v_codec.head_dim}")
        self.k_codec, self.v_codec = k_codec, v_codec
        self.head_dim = k_codec.head_dim
        self.batch, self.kv_heads = batch, kv_heads
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.key_scales = None if key_scales is None else key_scales.to(self.device, torch.float32)
        self.length = 0
        self.k: Packed | None = None
        self.v: Packed | None = None

    @classmethod
    def for_types(cls, k: str, v: str, head_dim: int, batch: int, kv_heads: int, device=None,
                  key_scales=None) -> "CompressedLayer":
        return cls(get_codec(k, head_dim), get_codec(v, head_dim), batch, kv_heads, device,
                   key_scales)

    # --- capacity ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.codes.shape[2]

    def reserve(self, needed: int, exact: bool = False) -> None:
        """Grow storage to hold at least `needed` rows; rows are kept.

        - The first allocation (a prompt) and a write the usual step cannot hold (a later prefill
          chunk) take exactly `needed` rows: held bytes after a prefill are the payload (a SmolLM2
          KVCache held 1,472 rows for a 1,434-token prompt: 2.65x vs f16 held, 2.72x payload;
          docs/quality.md, 2026-12-02).
        - Other growth (decode) adds an eighth of the capacity (at least 64 rows), the new capacity
          rounded down to a multiple of 64 rows (not below `needed` rounded up): held bytes stay
          within 12.5 % + one 64-row granule of the payload while copies stay amortised (one copy
          of the rows per ~capacity/8 appended rows, vs doubling's up to 2x held), and decode runs
          on 64-aligned storage again after its first step (the fused decode reads turbo norms as
          int32 pairs only at an even capacity, `triton_decode._scale_layout`).
        - exact=True (`DecodeGraph`, before capture): `needed` rounded up to 64 rows, no step."""
        if needed <= self.capacity:
            return
        needed, c = int(needed), self.capacity
        step = max(_MIN_CAPACITY, _round_up(-(-c // 8)))
        if exact:
            cap = _round_up(needed)
        elif not c or needed > c + step:
            cap = needed
        else:
            cap = max(_round_up(needed), (c + step) // _MIN_CAPACITY * _MIN_CAPACITY)
        lead = (self.batch, self.kv_heads, cap)
        k_new = self.k_codec.empty(lead, self.device)
        v_new = self.v_codec.empty(lead, self.device)
        if self.length:
            _copy_rows(k_new, self.k, self.length)
            _copy_rows(v_new, self.v, self.length)
        self.k, self.v = k_new, v_new

    def compact(self) -> None:
        """Shrink storage to exactly `length` rows (e.g. after prefilling a shared prefix)."""
        if self.k is None or self.capacity == self.length:
            return
        self.k = _clone_rows(self.k, self.length)
        self.v = _clone_rows(self.v, self.length)

    # --- writes ------------------------------------------------------------------------------
    def scale_keys(self, k: torch.Tensor) -> torch.Tensor:
        if self.key_scales is None:
            return k
        return k * self.key_scales.to(k.dtype)[None, :, None, :]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode and append rows: k, v [batch, kv_heads, S, head_dim] (true space, unscaled)."""
        if k.shape != v.shape or k.dim() != 4 or k.shape[0] != self.batch or k.shape[1] != self.kv_heads:
            raise ValueError(f"expected K/V [{self.batch}, {self.kv_heads}, S, {self.head_dim}], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        s = k.shape[2]
        if s == 0:
            return
        self.reserve(self.length + s)
        from ..kernels import dispatch

        if dispatch.use_triton(k, self.k.codes):
            # Quantize-on-write kernel: encodes and writes in place, no packed temporaries.
            dispatch.quantize_kv_into(self.k, k, self.k_codec, self.v, v, self.v_codec, self.length,
                                      innerq=self.key_scales)
        else:
            sl = slice(self.length, self.length + s)
            _write_rows(self.k, self.k_codec.encode(self.scale_keys(k), check=False), sl)
            _write_rows(self.v, self.v_codec.encode(v, check=False), sl)
        self.length += s

    def write_at(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Encode k, v [batch, kv_heads, T, head_dim] and store row (b, t) at positions[b, t]
        (int64 [batch, T] on the storage device) without touching `length`: the static decode step
        (`polykv.hf.graphs`) writes here and advances `length` on the host. Rows must fit the
        reserved capacity."""
        from ..kernels import dispatch

        dispatch.quantize_kv_into(self.k, k, self.k_codec, self.v, v, self.v_codec, positions,
                                  innerq=self.key_scales)

    def trim(self, keep: int) -> None:
        """Keep only the newest `keep` rows (sliding-window layers). Storage a long chunk grew
        beyond twice `keep + 1` is given back, down to `keep + 1` rows — room for the next decode
        step's row, so one-token steps never regrow (a longer chunk regrows by the usual step): a
        Gemma-3 KVCache held every sliding layer at its prefill length, 1,472 rows for a 511-row
        window (docs/quality.md, 2026-12-02)."""
        if self.length <= keep:
            return
        start = self.length - keep
        room = keep + 1
        if self.capacity > 2 * room:  # the kept rows go straight into right-sized storage
            lead = (self.batch, self.kv_heads, room)
            kept = (slice(None), slice(None), slice(start, self.length))
            k_new, v_new = self.k_codec.empty(lead, self.device), self.v_codec.empty(lead, self.device)
            _write_rows(k_new, self.k.index(kept), slice(0, keep))
            _write_rows(v_new, self.v.index(kept), slice(0, keep))
            self.k, self.v = k_new, v_new
        else:
            for p in (self.k, self.v):
                p.codes[:, :, :keep] = p.codes[:, :, start:self.length].clone()
                if p.scales is not None:
                    p.scales[:, :, :keep] = p.scales[:, :, start:self.length].clone()
        self.length = keep

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / subset the batch rows (beam search, dropping finished sequences)."""
        self.k = self.k.index(index) if self.k is not None else None
        self.v = self.v.index(index) if self.v is not None else None
        self.batch = int(index.numel())

    # --- reads -------------------------------------------------------------------------------
    def keys(self) -> Packed:
        """Packed keys, leading [batch, kv_heads, length] (a view)."""
        return self.k.index((slice(None), slice(None), slice(0, self.length)))

    def values(self) -> Packed:
        return self.v.index((slice(None), slice(None), slice(0, self.length)))

    def dense(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded true-space (k, v), [batch, kv_heads, length, head_dim]; keys unscaled."""
        if self.length == 0:
            z = torch.zeros(self.batch, self.kv_heads, 0, self.head_dim, dtype=dtype, device=self.device)
            return z, z.clone()
        k = self.k_codec.decode(self.keys())
        if self.key_scales is not None:
            k = k / self.key_scales[None, :, None, :]
        return k.to(dtype), self.v_codec.decode(self.values()).to(dtype)

    def decode_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32,
                    rotated: tuple[bool, bool] = (False, False)) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows [start, stop) -> (k, v) [batch, kv_heads, stop-start, head_dim] in `dtype`.

        rotated=(k_rot, v_rot): return K (resp. V) in the codec's storage domain (turbo: centroid x
        norm, no inverse rotation; keys stay InnerQ-scaled) instead of true space. Ignored for
        codecs that are not rotated."""
        start, stop = max(0, int(start)), min(int(stop), self.length)
        n = max(0, stop - start)
        if n == 0 or self.k is None:
            z = torch.zeros(self.batch, self.kv_heads, 0, self.head_dim, dtype=dtype, device=self.device)
            return z, z.clone()
        sl = (slice(None), slice(None), slice(start, stop))
        pk, pv = self.k.index(sl), self.v.index(sl)
        if rotated[0] and self.k_codec.rotated:
            k = self.k_codec.decode_rotated(pk)
        else:
            k = self.k_codec.decode(pk)
            if self.key_scales is not None:
                k = k / self.key_scales[None, :, None, :]
        if rotated[1] and self.v_codec.rotated:
            v = self.v_codec.decode_rotated(pv)
        else:
            v = self.v_codec.decode(pv)
        return k.to(dtype), v.to(dtype)

    def truncate(self, length: int) -> None:
        """Drop the newest rows so that `length` rows remain (rollback / crop)."""
        self.length = max(0, min(int(length), self.length))

    def used_nbytes(self) -> int:
        """Payload bytes of the `length` stored rows (numel x element size; capacity slack excluded)."""
        if self.k is None or self.length == 0:
            return 0
        return self.keys().nbytes() + self.values().nbytes()

    def tensors(self) -> list[torch.Tensor]:
        """The packed storage tensors (none before the first write)."""
        if self.k is None:
            return []
        return [t for t in (self.k.codes, self.k.scales, self.v.codes, self.v.scales) if t is not None]

    def nbytes(self) -> int:
        """Measured bytes of the packed storage (allocated capacity included)."""
        return storage_bytes(self.tensors())


def _round_up(n: int) -> int:
    return -(-n // _MIN_CAPACITY) * _MIN_CAPACITY


def _write_rows(dst: Packed, src: Packed, sl: slice) -> None:
    dst.codes[:, :, sl] = src.codes
    if dst.scales is not None:
        dst.scales[:, :, sl] = src.scales


def _copy_rows(dst: Packed, src: Packed, n: int) -> None:
    _write_rows(dst, src.index((slice(None), slice(None), slice(0, n))), slice(0, n))


def _clone_rows(p: Packed, n: int) -> Packed:
    return Packed(p.codes[:, :, :n].clone(),
                  None if p.scales is None else p.scales[:, :, :n].clone())
