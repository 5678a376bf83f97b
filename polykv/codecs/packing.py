"""Bit packing of small unsigned indices into bytes (planar layout).

Layout, for a row of n values (n % 8 == 0) and `bits` in {1, 2, 4, 8}: with P = 8 // bits values per
byte and n / P bytes, byte j holds values j, j + n/P, j + 2n/P, ... at bit offsets 0, bits, 2*bits,
... — value i sits in byte i % (n/P) at bit offset bits * (i // (n/P)). So the r-th bit field of all
bytes is the contiguous run of values [r*n/P, (r+1)*n/P): a kernel loads the bytes as one contiguous
tile and gets each run by one shift and mask (no per-value byte gathers). Three-bit indices are split
into two planes so that no value straddles a byte: the low two bits of all n values (n/4 bytes, 2-bit
planar layout: byte j holds values j + r*n/4 at bits 2r) followed by the high bit of all n values
(n/8 bytes, 1-bit planar layout: byte j holds values j + r*n/8 at bit r) — 3 bits per value exactly.
turbo packs each group of G values as one row; q4_0 packs the whole head_dim row (byte j: value j in
the low nibble, value j + head_dim/2 in the high nibble).

The same layout lets torch unpack 8 bytes per operation: on a little-endian host a row of bytes read
as int64 words has byte j in lane j % 8 of word j // 8, so (word >> r*bits) & (the bits-wide mask in
every lane) is the r-th field of 8 bytes at once, already in value order (`_unpack_pow2`; the CPU
decode of a turbo3 row 3.7x faster than per byte, docs/BENCHMARKS.md 5.16).
"""

from __future__ import annotations

import sys

import torch


#: The host reads multi-byte words little-endian: byte views of the packed rows (int64 words here,
#: int16 index pairs in `turbo.decode_rotated`) put byte j in lane j.
LITTLE_ENDIAN = sys.byteorder == "little"
#: `bits`-wide all-ones in each byte of a 64-bit word: the fields of 8 bytes masked at once.
_LANE_MASK = {b: int.from_bytes(bytes([(1 << b) - 1]) * 8, "little") for b in (1, 2, 4)}


def _pack_pow2(idx: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    n = idx.shape[-1]
    v = idx.to(torch.int32).reshape(*idx.shape[:-1], per_byte, n // per_byte)
    shifts = torch.arange(per_byte, device=idx.device, dtype=torch.int32) * bits
    return (v << shifts[:, None]).sum(-2).to(torch.uint8)


def _unpack_pow2(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per_byte = 8 // bits
    words = _words(packed)
    if words is not None:  # 8 bytes per op: byte j's r-th field is lane j of (word >> r * bits) & mask
        # the shifts made per call, never cached: a call captured into a CUDA graph makes them
        # at replay (a tensor cached at capture time would hold what the capture never wrote)
        shifts = torch.arange(0, 8, bits, dtype=torch.int64, device=packed.device)
        v = (words[..., None, :] >> shifts[:, None]) & _LANE_MASK[bits]
        return v.view(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :n]
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    v = (packed.to(torch.int32)[..., None, :] >> shifts[:, None]) & ((1 << bits) - 1)
    return v.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :n].to(torch.uint8)


def _words(packed: torch.Tensor) -> torch.Tensor | None:
    """packed uint8 [..., nb] viewed as int64 [..., nb / 8] (little-endian hosts: byte j of a row is
    byte j % 8 of word j // 8), or None where no such view exists (nb not a multiple of 8, a last
    dim that is not contiguous or not 8-byte aligned): those rows take the per-byte path (the same
    values, CPU decode ~4x slower)."""
    if not LITTLE_ENDIAN or packed.dtype != torch.uint8 or packed.shape[-1] % 8 or not packed.numel():
        return None
    try:
        return packed.view(torch.int64)
    except RuntimeError:
        return None


def packed_bytes(n: int, bits: int) -> int:
    """Bytes holding n indices of `bits` bits (n a multiple of 8)."""
    return n * bits // 8


def pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 indices [..., n] (values < 2**bits, n % 8 == 0) into uint8 [..., n*bits/8]."""
    n = idx.shape[-1]
    if n % 8:
        raise ValueError(f"row length must be a multiple of 8 to pack, got {n}")
    if bits == 8:
        return idx.to(torch.uint8).contiguous()
    if bits in (1, 2, 4):
        return _pack_pow2(idx, bits)
    if bits == 3:
        lo = _pack_pow2(idx & 3, 2)
        hi = _pack_pow2(idx >> 2, 1)
        return torch.cat([lo, hi], -1)
    raise ValueError(f"unsupported bit width {bits}")


def unpack_indices(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_indices: uint8 [..., n*bits/8] -> uint8 indices [..., n]."""
    if bits == 8:
        return packed
    if bits in (1, 2, 4):
        return _unpack_pow2(packed, bits, n)
    if bits == 3:
        lo = _unpack_pow2(packed[..., : n // 4], 2, n)
        hi = _unpack_pow2(packed[..., n // 4:], 1, n)
        return lo | (hi << 2)
    raise ValueError(f"unsupported bit width {bits}")
