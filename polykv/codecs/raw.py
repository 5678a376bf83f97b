"""Uncompressed storage (f16 / bf16): the reference tier."""

from __future__ import annotations

import torch

from .base import Codec, Packed


class RawCodec(Codec):
    def __init__(self, head_dim: int, dtype: torch.dtype, name: str):
        super().__init__(head_dim)
        self.dtype = dtype
        self.name = name

    @property
    def code_bytes(self) -> int:
        return self.head_dim * 2

    @property
    def n_scales(self) -> int:
        return 0

    @property
    def code_dtype(self) -> torch.dtype:
        return self.dtype

    def empty(self, leading, device=None) -> Packed:
        return Packed(torch.zeros(*leading, self.head_dim, dtype=self.dtype, device=device), None)

    def bits_per_value(self, packed: Packed | None = None) -> float:
        if packed is None:
            packed = self.encode(torch.randn(4, self.head_dim))
        return packed.nbytes() * 8 / packed.codes.numel()

    def _encode(self, x: torch.Tensor) -> Packed:
        return Packed(x.to(self.dtype).contiguous(), None)

    def decode(self, p: Packed) -> torch.Tensor:
        return p.codes.float()
