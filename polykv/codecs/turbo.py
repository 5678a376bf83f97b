"""TurboQuant (turbo8/4/3/2): per-group fixed-sign Hadamard rotation, Lloyd-Max codebook,
corrected norm.

Per group of G coordinates (G = 128, or head_dim when head_dim < 128):
    y = R x                                (rotation.py; orthogonal)
    u = y / ||x|| * sqrt(G)                (coordinates ~ N(0, 1))
    i = argmin_j |u - c_j|                 (Lloyd-Max codebook of the coordinate distribution)
    n = ||x|| / ||c_i||                    (corrected norm, fp16: the decoded vector keeps ||x||)
Decoding in the rotated domain is c_i * n; true-space decoding applies R^T.
"""

from __future__ import annotations

import functools
import os

import torch

from .base import Codec, CodecError, Packed
from .lloyd_max import lloyd_max_codebook
from .packing import LITTLE_ENDIAN, pack_indices, packed_bytes, unpack_indices
from .rotation import rotate, unrotate

MAX_GROUP = 128
MIN_GROUP = 32


def turbo_group_size(head_dim: int) -> int:
    """G = 128 for head_dim >= 128 (head_dim a multiple of 128); head_dim itself when it is a power
    of two in [32, 128). Anything else raises CodecError naming the supported sizes."""
    if head_dim >= MAX_GROUP and head_dim % MAX_GROUP == 0:
        return MAX_GROUP
    if MIN_GROUP <= head_dim < MAX_GROUP and head_dim & (head_dim - 1) == 0:
        return head_dim
    raise CodecError(
        f"turbo codecs need head_dim to be 32 or 64, or a multiple of 128 (e.g. 128, 256, 512); "
        f"got {head_dim}")


@functools.lru_cache(maxsize=None)
def turbo_codebook(bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids float32 [2**bits], decision boundaries float32 [2**bits - 1]) for N(0,1)-like
    coordinates of a random unit vector in R^group scaled by sqrt(group)."""
    cent = _cached_centroids(bits, group)
    return cent, 0.5 * (cent[1:] + cent[:-1])


def _cached_centroids(bits: int, group: int) -> torch.Tensor:
    """Solve once per machine: the 8-bit solve takes seconds, so the result is kept on disk."""
    import numpy as np

    from ..paths import cache_dir

    path = cache_dir("codebooks") / f"sphere_g{group}_b{bits}_v1.npy"
    try:
        c = np.load(path)
        if c.shape == (1 << bits,):
            return torch.tensor(c, dtype=torch.float32)
    except (OSError, ValueError):
        pass
    c, _ = lloyd_max_codebook(bits, "sphere", group)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, c)
    os.replace(tmp, path)
    return torch.tensor(c, dtype=torch.float32)


_PAIRS: dict = {}


def pair_table(bits: int, group: int, device: str) -> torch.Tensor:
    """int64 [2**(8 + bits)] on `device`: entry a | b << 8 holds centroids a and b of
    `turbo_codebook(bits, group)` as two float32 (a first in memory), for decoding two indices per
    gather. One per (bits, group, device), shared by every codec of that size: a constant of the
    format like the codebook, held by no cache."""
    key = (bits, group, device)
    t = _PAIRS.get(key)
    if t is None:
        cent = turbo_codebook(bits, group)[0]
        k = 1 << bits
        both = torch.zeros(1 << (8 + bits), 2, dtype=torch.float32)
        a, b = torch.meshgrid(torch.arange(k), torch.arange(k), indexing="ij")
        both[(a | b << 8).reshape(-1)] = torch.stack([cent[a], cent[b]], -1).reshape(-1, 2)
        t = _PAIRS[key] = both.view(torch.int64).reshape(-1).to(device)
    return t


class TurboCodec(Codec):
    rotated = True

    def __init__(self, head_dim: int, bits: int):
        self.bits = bits
        self.name = f"turbo{bits}"
        super().__init__(head_dim)
        self.group = turbo_group_size(head_dim)
        self.block = self.group
        self.n_groups = head_dim // self.group
        self._group_bytes = packed_bytes(self.group, bits)
        cent, bounds = turbo_codebook(bits, self.group)
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {"cpu": (cent, bounds)}

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(centroids [2**bits], boundaries [2**bits-1]) float32 on `device`."""
        key = str(torch.device(device))
        if key not in self._tables:
            c, b = self._tables["cpu"]
            self._tables[key] = (c.to(device), b.to(device))
        return self._tables[key]

    @property
    def centroids(self) -> torch.Tensor:
        return self._tables["cpu"][0]

    @property
    def code_bytes(self) -> int:
        return self.n_groups * self._group_bytes

    def _encode(self, x: torch.Tensor) -> Packed:
        lead = x.shape[:-1]
        g = self.group
        xf = x.float()
        y = rotate(xf, g).reshape(*lead, self.n_groups, g)
        norm = xf.reshape(*lead, self.n_groups, g).norm(dim=-1)
        cent, bounds = self.tables(x.device)
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        u = y * (g ** 0.5 / safe)[..., None]
        idx = torch.bucketize(u, bounds)
        cnorm = cent[idx].norm(dim=-1)
        corrected = torch.where(norm > 0, norm / cnorm, torch.zeros_like(norm)).to(torch.float16)
        codes = pack_indices(idx.to(torch.uint8), self.bits)  # [..., n_groups, group_bytes]
        return Packed(codes.reshape(*lead, self.code_bytes), corrected)

    def indices(self, p: Packed) -> torch.Tensor:
        """Unpacked codebook indices, uint8 [..., n_groups, G]."""
        codes = p.codes.reshape(*p.codes.shape[:-1], self.n_groups, self._group_bytes)
        return unpack_indices(codes, self.bits, self.group)

    def decode_rotated(self, p: Packed) -> torch.Tensor:
        idx = self.indices(p)  # uint8 [..., n_groups, G]
        if LITTLE_ENDIAN and self.bits <= 4 and idx.is_contiguous():
            # two centroids per gather: the index pair (a, b) of values 2i, 2i + 1 read as one
            # int16 a | b << 8 (little-endian) selects both floats at once (half the gathers of a
            # centroid lookup per value; the same floats)
            pairs = pair_table(self.bits, self.group, str(p.codes.device))
            y = torch.index_select(pairs, 0, idx.view(torch.int16).reshape(-1).to(torch.int32))
            y = y.view(torch.float32).reshape(idx.shape)
        else:
            y = self.tables(p.codes.device)[0][idx.long()]
        y = y * p.scales.float()[..., None]
        return y.reshape(*p.codes.shape[:-1], self.head_dim)

    def decode(self, p: Packed) -> torch.Tensor:
        return unrotate(self.decode_rotated(p), self.group)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Map true-space vectors [..., head_dim] to the storage domain (float32)."""
        return rotate(x, self.group)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Map storage-domain vectors [..., head_dim] back to true space (float32)."""
        return unrotate(y, self.group)
