"""Fixed-sign Walsh-Hadamard rotation applied per group of G coordinates.

y = D(s2) . H_G / sqrt(G) . D(s1) . x, with s1, s2 fixed +-1 vectors drawn from ROTATION_SEED.
The rotation is orthogonal, so <R q, R k> = <q, k>: attention can run in the rotated domain.
"""

from __future__ import annotations

import functools

import torch

ROTATION_SEED = 20260101
"""Seed of the sign vectors: s1, s2 = the first two draws of torch.randint(0, 2, (G,)) * 2 - 1 from
torch.Generator().manual_seed(ROTATION_SEED + G)."""


def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix H_n (entries +-1), float64 [n, n]; n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
def _sign_vectors(group: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(ROTATION_SEED + group)
    s1 = torch.randint(0, 2, (group,), generator=gen, dtype=torch.int64) * 2 - 1
    s2 = torch.randint(0, 2, (group,), generator=gen, dtype=torch.int64) * 2 - 1
    return s1.double(), s2.double()


@functools.lru_cache(maxsize=None)
def _rotation_matrix_cpu(group: int) -> torch.Tensor:
    s1, s2 = _sign_vectors(group)
    h = hadamard(group) / group ** 0.5
    # Row-vector convention: y = x @ M with M = D(s1) H D(s2) equals D(s2) H D(s1) x (H symmetric).
    return (s1[:, None] * h * s2[None, :]).float()


_DEVICE_CACHE: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}


def rotation_matrix(group: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The per-group rotation as a matrix M [G, G] (row-vector convention: y = x @ M)."""
    key = (group, str(torch.device(device)), dtype)
    m = _DEVICE_CACHE.get(key)
    if m is None:
        m = _rotation_matrix_cpu(group).to(device=device, dtype=dtype)
        _DEVICE_CACHE[key] = m
    return m


def rotate(x: torch.Tensor, group: int) -> torch.Tensor:
    """Rotate every group of `group` consecutive coordinates of x [..., D] (D % group == 0).

    Computes in float32 and returns float32 [..., D]."""
    d = x.shape[-1]
    m = rotation_matrix(group, x.device)
    return (x.float().reshape(*x.shape[:-1], d // group, group) @ m).reshape(x.shape)


def unrotate(y: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of `rotate` (M is orthogonal, so the inverse is M^T). float32 [..., D]."""
    d = y.shape[-1]
    m = rotation_matrix(group, y.device)
    return (y.float().reshape(*y.shape[:-1], d // group, group) @ m.T).reshape(y.shape)
