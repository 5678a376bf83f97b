"""Lloyd-Max scalar quantizer, solved numerically (no pasted tables).

TurboQuant quantizes each coordinate of a randomly rotated, norm-scaled vector. For a random unit
vector in R^G scaled by sqrt(G), one coordinate t has density proportional to
(1 - t^2/G)^((G-3)/2) on [-sqrt(G), sqrt(G)]; for large G this tends to N(0, 1). The optimal
(minimum-MSE) codebook for that density is what the turbo codecs use.

The solver integrates the density on a fine grid once (cumulative mass, first and second moments)
and evaluates cell integrals at arbitrary boundaries by interpolation, so Lloyd iterations move
continuously instead of sticking to grid points, and each iteration costs O(levels).
"""

from __future__ import annotations

import functools
import math

import numpy as np

_GRID_POINTS = 1 << 20


def _density(kind: str, dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Grid points and unnormalised density values of the coordinate distribution."""
    if kind == "gaussian":
        t = np.linspace(-12.0, 12.0, _GRID_POINTS)
        logp = -0.5 * t * t
    elif kind == "sphere":
        if dim is None or dim < 3:
            raise ValueError("sphere density needs dim >= 3")
        r = math.sqrt(dim)
        t = np.linspace(-r, r, _GRID_POINTS)
        with np.errstate(divide="ignore"):
            logp = 0.5 * (dim - 3) * np.log(np.clip(1.0 - (t * t) / dim, 0.0, None))
    else:
        raise ValueError(f"unknown density {kind!r}; expected 'gaussian' or 'sphere'")
    return t, np.exp(logp - logp.max())


def _cumulative(t: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trapezoid cumulative integrals of p, t p and t^2 p, normalised to total mass 1."""
    dt = np.diff(t)

    def cum(f):
        return np.concatenate([[0.0], np.cumsum(0.5 * (f[1:] + f[:-1]) * dt)])

    m0, m1, m2 = cum(p), cum(t * p), cum(t * t * p)
    z = m0[-1]
    return m0 / z, m1 / z, m2 / z


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(bits: int, kind: str = "sphere", dim: int | None = None,
                       tol: float = 1e-10, max_iter: int = 200_000) -> tuple[np.ndarray, float]:
    """Solve the 2**bits-level Lloyd-Max quantizer for a symmetric unit-variance density.

    Args:
        bits: bits per index (1..8).
        kind: "gaussian" (N(0,1)) or "sphere" (coordinate of a random unit vector in R^dim,
            scaled by sqrt(dim)).
        dim: the dimension for "sphere".

    Returns:
        (centroids, mse): float64 array of shape [2**bits], sorted ascending, and the expected
        per-coordinate squared error E[(t - Q(t))^2] (the relative MSE, since E[t^2] = 1).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    t, p = _density(kind, dim)
    f0, f1, f2 = _cumulative(t, p)
    levels = 1 << bits
    lo, hi = t[0], t[-1]
    # Quantile initialisation: close to optimal already, so Lloyd converges quickly even at 8 bits.
    c = np.interp((np.arange(levels) + 0.5) / levels, f0, t)

    def cells(c):
        edges = np.concatenate([[lo], 0.5 * (c[1:] + c[:-1]), [hi]])
        return np.interp(edges, t, f0), np.interp(edges, t, f1), np.interp(edges, t, f2)

    for _ in range(max_iter):
        e0, e1, _ = cells(c)
        mass, first = np.diff(e0), np.diff(e1)
        new = np.where(mass > 0, first / np.maximum(mass, 1e-300), c)
        new = 0.5 * (new - new[::-1])  # the density is even, so the optimum is symmetric
        delta = np.max(np.abs(new - c))
        c = new
        if delta < tol:
            break
    e0, e1, e2 = cells(c)
    mse = float(np.sum(np.diff(e2) - 2 * c * np.diff(e1) + c * c * np.diff(e0)))
    return c, mse
