"""Bit packing of small unsigned indices into bytes.

Layout (little-endian inside each byte, consecutive values): for `bits` in {1, 2, 4, 8}, value i of a
row goes to byte i * bits // 8 at bit offset (i * bits) % 8. Three-bit indices are split into two
planes so that no value straddles a byte: the low two bits of all G values (G/4 bytes, 2-bit layout)
followed by the high bit of all G values (G/8 bytes, 1-bit layout) — 3 bits per value exactly, and a
kernel can unpack any value with two byte loads and shifts.
"""

from __future__ import annotations

import torch


def _pack_pow2(idx: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    n = idx.shape[-1]
    v = idx.to(torch.int32).reshape(*idx.shape[:-1], n // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=idx.device, dtype=torch.int32) * bits
    return (v << shifts).sum(-1).to(torch.uint8)


def _unpack_pow2(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    v = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return v.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :n].to(torch.uint8)


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
