"""Residency tiers of a pool document's compressed layers, and the moves between them.

Tiers (`tier_of`)
    "gpu"      a list of `CompressedLayer` on the pool's device (batch 1, compacted): attention reads
               the prefix in place.
    "host"     a list of `HostLayer`: each layer's packed rows cut into chunks of `chunk_rows` rows,
               each chunk ONE contiguous uint8 buffer in host memory, pinned (`pin_memory`) when the
               pool's device is CUDA, so that a chunk reaches the device in one non-blocking copy
               (`polykv.pool.attention.PrefixStreamer`). On a CPU pool it is a separate copy on the
               same memory (a separate budget; moves are real copies).
    "evicted"  no layers (token ids only): re-prefilled on use.

Byte layout of one host chunk of R rows (`HostChunk`), segments in this order, each starting at a
multiple of `_ALIGN` bytes:
    k.codes   k_codec.code_dtype [1, Hkv, R, k_codec.code_bytes / itemsize]
    k.scales  float16 [1, Hkv, R, k_codec.n_scales]        (absent for raw types)
    v.codes   v_codec.code_dtype [1, Hkv, R, v_codec.code_bytes / itemsize]
    v.scales  float16 [1, Hkv, R, v_codec.n_scales]        (absent for raw types)
The Packed views of a chunk are the same whether they read the host buffer or a device copy of it.

Moves copy the packed rows bit for bit: a document read from either tier gives the cascade the same
packed data (the streamed path differs only by where it merges partial results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.accounting import storage_bytes
from ..cache.layer import CompressedLayer
from ..codecs import Codec, Packed

_ALIGN = 64  # segment alignment in a chunk buffer (bytes): every dtype view is aligned


@dataclass(frozen=True)
class _Segment:
    offset: int  # bytes from the start of the chunk buffer
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.offset: self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _segments(kc: Codec, vc: Codec, kv_heads: int, rows: int) -> tuple[list[_Segment | None], int]:
    """[k.codes, k.scales, v.codes, v.scales] segments (None for absent scales), total bytes."""
    segs, off = [], 0
    for c in (kc, vc):
        width = c.code_bytes // torch.tensor([], dtype=c.code_dtype).element_size()
        for dtype, last in ((c.code_dtype, width), (torch.float16, c.n_scales)):
            if not last:
                segs.append(None)
                continue
            s = _Segment(off, dtype, (1, kv_heads, rows, last))
            segs.append(s)
            off += -(-s.nbytes // _ALIGN) * _ALIGN
    return segs, off


@dataclass
class HostChunk:
    """Rows [row0, row0 + rows) of one layer in one contiguous uint8 buffer `data` [nbytes]."""

    row0: int
    rows: int
    data: torch.Tensor
    segs: list

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def packed(self, buf: torch.Tensor | None = None) -> tuple[Packed, Packed]:
        """(k, v) Packed views, leading [1, Hkv, rows], of `buf` (a device copy of `data`, at least
        nbytes long) or of the host buffer itself."""
        b = self.data if buf is None else buf
        kc, ks, vc, vs = (None if s is None else s.view(b) for s in self.segs)
        return Packed(kc, ks), Packed(vc, vs)


class HostLayer:
    """A document layer in the host tier (see module doc). Same read surface as a compacted
    `CompressedLayer` where the pool needs it: k_codec, v_codec, head_dim, kv_heads, batch (1),
    key_scales (InnerQ float32 [Hkv, D], kept on the pool's device: the cascade reads it there),
    length, keys() / values() (whole-layer Packed on the CPU, built on demand: persistence),
    tensors(). `chunks` is what attention streams."""

    def __init__(self, k_codec: Codec, v_codec: Codec, kv_heads: int, length: int,
                 key_scales: torch.Tensor | None, chunks: list[HostChunk]):
        self.k_codec, self.v_codec = k_codec, v_codec
        self.head_dim = k_codec.head_dim
        self.batch, self.kv_heads = 1, kv_heads
        self.length = int(length)
        self.key_scales = key_scales
        self.chunks = chunks
        self.device = torch.device("cpu")

    def _whole(self, i: int) -> Packed:
        parts = [c.packed()[i] for c in self.chunks]
        codec = self.k_codec if i == 0 else self.v_codec
        if not parts:
            return codec.empty((1, self.kv_heads, 0))
        return Packed.cat(parts)

    def keys(self) -> Packed:
        """Packed keys, leading [1, Hkv, length] (a CPU copy)."""
        return self._whole(0)

    def values(self) -> Packed:
        return self._whole(1)

    def tensors(self) -> list[torch.Tensor]:
        return [c.data for c in self.chunks]

    def max_chunk_bytes(self) -> int:
        return max((c.nbytes for c in self.chunks), default=0)


def tier_of(layers) -> str:
    """"gpu", "host" or "evicted" for a document's `layers` (see module doc)."""
    if layers is None:
        return "evicted"
    return "host" if layers and isinstance(layers[0], HostLayer) else "gpu"


def layer_tensors(layer) -> list[torch.Tensor]:
    """The tensors holding one layer's packed rows (either tier), for `storage_bytes`."""
    if isinstance(layer, HostLayer):
        return layer.tensors()
    out = []
    for p in (layer.k, layer.v):
        if p is not None:
            out += [p.codes] + ([p.scales] if p.scales is not None else [])
    return out


def _chunk_starts(length: int, chunk_rows: int) -> list[tuple[int, int]]:
    return [(a, min(length, a + chunk_rows)) for a in range(0, length, chunk_rows)]


def host_nbytes(layers: list[CompressedLayer], chunk_rows: int) -> int:
    """Bytes `to_host(layers, chunk_rows)` allocates (to decide a demotion before copying)."""
    total = 0
    for l in layers:
        for a, b in _chunk_starts(l.length, chunk_rows):
            total += _segments(l.k_codec, l.v_codec, l.kv_heads, b - a)[1]
    return total


def gpu_nbytes(layers: list[HostLayer]) -> int:
    """Bytes `to_device(layers, ...)` allocates: each layer's rows, compacted."""
    total = 0
    for l in layers:
        for c in (l.k_codec, l.v_codec):
            total += c.empty((1, l.kv_heads, 1)).nbytes() * l.length
    return total


def to_host(layers: list[CompressedLayer], chunk_rows: int, pin: bool) -> list[HostLayer]:
    """Copy a GPU-tier document's layers into host chunks of `chunk_rows` rows (pinned if `pin`).
    The source layers are left untouched (the caller drops them)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    out = []
    for l in layers:
        chunks = []
        k, v = l.keys(), l.values()
        for a, b in _chunk_starts(l.length, chunk_rows):
            segs, n = _segments(l.k_codec, l.v_codec, l.kv_heads, b - a)
            data = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
            chunk = HostChunk(a, b - a, data, segs)
            for dst, src in zip(chunk.packed(), (k, v)):
                sl = (slice(None), slice(None), slice(a, b))
                dst.codes.copy_(src.codes[sl])
                if dst.scales is not None:
                    dst.scales.copy_(src.scales[sl])
            chunks.append(chunk)
        out.append(HostLayer(l.k_codec, l.v_codec, l.kv_heads, l.length, l.key_scales, chunks))
    return out


def to_device(layers: list[HostLayer], device) -> list[CompressedLayer]:
    """Copy a host-tier document's layers back into compacted `CompressedLayer`s on `device`."""
    device = torch.device(device)
    out = []
    for l in layers:
        layer = CompressedLayer(l.k_codec, l.v_codec, 1, l.kv_heads, device, None)
        layer.key_scales = l.key_scales
        lead = (1, l.kv_heads, l.length)
        layer.k, layer.v = l.k_codec.empty(lead, device), l.v_codec.empty(lead, device)
        for c in l.chunks:
            sl = (slice(None), slice(None), slice(c.row0, c.row0 + c.rows))
            for dst, src in zip((layer.k, layer.v), c.packed()):
                dst.codes[sl].copy_(src.codes, non_blocking=True)
                if src.scales is not None:
                    dst.scales[sl].copy_(src.scales, non_blocking=True)
        layer.length = l.length
        out.append(layer)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the host chunks may be freed next
    return out


def document_bytes(layers) -> int:
    """Measured bytes of a document's layers (either tier; 0 when evicted)."""
    return storage_bytes([t for l in layers or [] for t in layer_tensors(l)])
