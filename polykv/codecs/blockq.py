"""llama.cpp-style block quantization along head_dim: q8_0 and q4_0 (32 values per fp16 scale)."""

from __future__ import annotations

import torch

from .base import Codec, CodecError, Packed
from .packing import pack_indices, unpack_indices

QBLOCK = 32


class _BlockCodec(Codec):
    block = QBLOCK

    def __init__(self, head_dim: int):
        super().__init__(head_dim)
        if head_dim % QBLOCK:
            raise CodecError(f"{self.name}: head_dim must be a multiple of {QBLOCK}, got {head_dim}")

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().reshape(*x.shape[:-1], self.head_dim // QBLOCK, QBLOCK)


class Q8_0(_BlockCodec):
    """q8_0: scale d = amax/127 (fp16), q = round(x/d) as int8. 8.5 bits/value."""

    name = "q8_0"

    @property
    def code_bytes(self) -> int:
        return self.head_dim

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8

    def _encode(self, x: torch.Tensor) -> Packed:
        b = self._blocks(x)
        d16 = (b.abs().amax(-1) / 127.0).to(torch.float16)
        d = d16.float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(b * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        return Packed(q.reshape(*x.shape[:-1], self.head_dim), d16)

    def decode(self, p: Packed) -> torch.Tensor:
        q = p.codes.float().reshape(*p.codes.shape[:-1], -1, QBLOCK)
        return (q * p.scales.float()[..., None]).reshape(p.codes.shape)


class Q4_0(_BlockCodec):
    """q4_0 (llama.cpp): d = m / -8 where m is the block's value of largest magnitude (sign kept),
    q = clamp(floor(x/d + 8.5), 0, 15); value = (q - 8) * d. Two 4-bit codes per byte. 4.5 bits/value."""

    name = "q4_0"

    @property
    def code_bytes(self) -> int:
        return self.head_dim // 2

    def _encode(self, x: torch.Tensor) -> Packed:
        b = self._blocks(x)
        pos = b.abs().argmax(-1, keepdim=True)
        m = torch.gather(b, -1, pos).squeeze(-1)
        d16 = (m / -8.0).to(torch.float16)
        d = d16.float()
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.floor(b * inv[..., None] + 8.5).clamp_(0, 15).to(torch.uint8)
        return Packed(pack_indices(q.reshape(*x.shape[:-1], self.head_dim), 4), d16)

    def decode(self, p: Packed) -> torch.Tensor:
        q = unpack_indices(p.codes, 4, self.head_dim).float() - 8.0
        q = q.reshape(*q.shape[:-1], -1, QBLOCK)
        return (q * p.scales.float()[..., None]).reshape(*p.codes.shape[:-1], self.head_dim)
