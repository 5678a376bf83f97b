"""Codec interface and the packed-tensor container shared by every KV format."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Packed:
    """Compressed rows of one codec.

    codes:  the packed payload, [..., code_bytes] (uint8 / int8) or, for raw types, the values
            themselves [..., head_dim] (float16 / bfloat16).
    scales: per-block fp16 scale (q8_0/q4_0) or corrected norm (turbo), [..., n_blocks]; None for
            raw types.
    """

    codes: torch.Tensor
    scales: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        """Leading shape (everything but the packed last dim)."""
        return self.codes.shape[:-1]

    def nbytes(self) -> int:
        """Bytes of the payload tensors (numel x element size)."""
        n = self.codes.numel() * self.codes.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def index(self, idx) -> "Packed":
        """Apply the same indexing to codes and scales (leading dims only)."""
        return Packed(self.codes[idx], None if self.scales is None else self.scales[idx])

    @staticmethod
    def cat(parts: "list[Packed]", dim: int = 2) -> "Packed":
        """The parts' rows joined along leading dim `dim` (a copy)."""
        scales = None if parts[0].scales is None else torch.cat([p.scales for p in parts], dim)
        return Packed(torch.cat([p.codes for p in parts], dim), scales)

    def to(self, device) -> "Packed":
        return Packed(self.codes.to(device), None if self.scales is None else self.scales.to(device))


class CodecError(ValueError):
    """Invalid input for a codec (wrong dtype, shape, non-finite values, unsupported head_dim)."""


class Codec:
    """One KV storage format bound to one head_dim.

    encode:         float [..., head_dim] -> Packed
    decode:         Packed -> float32 [..., head_dim] in the original (true) space
    decode_rotated: Packed -> float32 [..., head_dim] in the storage domain (turbo: centroid x norm,
                    no inverse rotation; other types: same as decode)
    """

    name: str = ""
    rotated: bool = False  # True when the storage domain is the rotated one (turbo types)
    block: int = 0  # values per scale block (0 for raw types)

    def __init__(self, head_dim: int):
        self.head_dim = int(head_dim)

    # --- sizes -------------------------------------------------------------------------------
    @property
    def code_bytes(self) -> int:
        """Bytes of `codes` per row (raw types: head_dim * 2)."""
        raise NotImplementedError

    @property
    def n_scales(self) -> int:
        """fp16 scales per row (0 for raw types)."""
        return self.head_dim // self.block if self.block else 0

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.uint8

    def bits_per_value(self, packed: Packed | None = None) -> float:
        """Stored bits per value, measured from packed tensors (a fresh encode when None)."""
        if packed is None:
            packed = self.encode(torch.randn(4, self.head_dim))
        values = packed.codes.numel() // packed.codes.shape[-1] * self.head_dim
        return packed.nbytes() * 8 / values

    # --- storage -----------------------------------------------------------------------------
    def empty(self, leading: tuple[int, ...], device=None) -> Packed:
        """Zero-filled storage for rows of shape leading + (head_dim,)."""
        codes = torch.zeros(*leading, self.code_bytes, dtype=self.code_dtype, device=device)
        scales = (torch.zeros(*leading, self.n_scales, dtype=torch.float16, device=device)
                  if self.n_scales else None)
        return Packed(codes, scales)

    # --- validation --------------------------------------------------------------------------
    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise CodecError(f"{self.name}: expected a floating tensor (float16/bfloat16/float32), "
                             f"got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.head_dim:
            raise CodecError(f"{self.name}: expected last dim {self.head_dim}, got shape "
                             f"{tuple(x.shape)}")
        if x.numel() == 0:
            raise CodecError(f"{self.name}: empty tensor {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise CodecError(f"{self.name}: input has non-finite values (nan/inf)")

    # --- codec -------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, check: bool = True) -> Packed:
        if check:
            self.check_input(x)
        return self._encode(x)

    def _encode(self, x: torch.Tensor) -> Packed:
        raise NotImplementedError

    def decode(self, p: Packed) -> torch.Tensor:
        raise NotImplementedError

    def decode_rotated(self, p: Packed) -> torch.Tensor:
        return self.decode(p)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, head_dim={self.head_dim})"
