"""Triton device helpers that read the packed KV formats of polykv.codecs (DESIGN §3).

Sub-column decomposition (used by the attention kernels): a row of D values is read as PER
sub-tensors of C = D / PER columns, value d = PER * c + k living in sub-tensor k at column c. Every
byte is then loaded exactly once per tile and each sub-tensor is a plain shift/mask of it:

    kind     PER  byte of column c                                  value k
    raw        1  the f16/bf16 value itself                         -
    q8_0       1  int8 at c                                         q * scale[c // 32]
    q4_0       2  byte c                                            ((b >> 4k) & 15) - 8) * scale[c // 16]
    turbo8     1  byte c                                            cent[b] * norm[c // G]
    turbo4     2  byte c                                            cent[(b >> 4k) & 15] * norm[c // (G/2)]
    turbo2     4  byte c                                            cent[(b >> 2k) & 3] * norm[c // (G/4)]
    turbo3     4  lo = byte g*GB + j (j = c % (G/4), g = c // (G/4))  lo 2 bits (lo >> 2k) & 3,
                  hi = byte g*GB + G/4 + j // 2                     hi bit (hi >> (4*(j%2) + k)) & 1
The attention kernels load q (and store the output) in the same decomposition, so no reordering of
the decoded tile is ever needed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..codecs import Codec
from ..codecs.blockq import Q4_0, Q8_0
from ..codecs.raw import RawCodec
from ..codecs.turbo import TurboCodec

KIND_RAW, KIND_Q8, KIND_Q4, KIND_TURBO = 0, 1, 2, 3


def codec_meta(codec: Codec) -> dict:
    """Compile-time description of a codec for the kernels."""
    if isinstance(codec, RawCodec):
        return dict(KIND=KIND_RAW, BITS=16, G=codec.head_dim, PER=1)
    if isinstance(codec, Q8_0):
        return dict(KIND=KIND_Q8, BITS=8, G=32, PER=1)
    if isinstance(codec, Q4_0):
        return dict(KIND=KIND_Q4, BITS=4, G=32, PER=2)
    if isinstance(codec, TurboCodec):
        per = {8: 1, 4: 2, 3: 4, 2: 4}[codec.bits]
        return dict(KIND=KIND_TURBO, BITS=codec.bits, G=codec.group, PER=per)
    raise TypeError(f"no kernel support for codec {codec!r}")


@triton.jit
def load_tile(codes_ptr, scales_ptr, row_off, srow_off, nmask, C: tl.constexpr,
              KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr):
    """Load the bytes of a [BN, C] tile (sub-column layout) and the per-column scale/norm.

    row_off / srow_off: int64 [BN] element offsets of each row in codes / scales.
    Returns (b0, b1, sc): b0 int32 (float32 for raw / q8_0) [BN, C], b1 (turbo3 high-bit bytes,
    else b0), sc float32 [BN, C] (unused for raw)."""
    c = tl.arange(0, C)
    m2 = nmask[:, None]
    # one if/elif chain and a single return: Triton checks every return's type, even in
    # constexpr branches that are not taken
    if KIND == 0:
        b0 = tl.load(codes_ptr + row_off[:, None] + c[None, :], mask=m2, other=0.0)
        b0 = b0.to(tl.float32)
        b1 = b0
        sc = b0
    elif KIND == 1:
        b0 = tl.load(codes_ptr + row_off[:, None] + c[None, :], mask=m2, other=0).to(tl.float32)
        b1 = b0
        nb = tl.arange(0, C // 32)
        sc = tl.load(scales_ptr + srow_off[:, None] + nb[None, :], mask=m2,
                     other=0.0).to(tl.float32)  # [BN, NB]: broadcast in sub_values
    elif KIND == 2:
        b0 = tl.load(codes_ptr + row_off[:, None] + c[None, :], mask=m2, other=0).to(tl.int32)
        b1 = b0
        sc = tl.load(scales_ptr + srow_off[:, None] + (c // 16)[None, :], mask=m2,
                     other=0.0).to(tl.float32)
    elif BITS == 3:
        GB: tl.constexpr = G * 3 // 8
        Q4: tl.constexpr = G // 4
        g = c // Q4
        j = c % Q4
        lo_off = g * GB + j
        hi_off = g * GB + Q4 + j // 2
        b0 = tl.load(codes_ptr + row_off[:, None] + lo_off[None, :], mask=m2, other=0).to(tl.int32)
        b1 = tl.load(codes_ptr + row_off[:, None] + hi_off[None, :], mask=m2, other=0).to(tl.int32)
        if C == Q4:  # one group per row: one norm per row, no gather
            sc = tl.load(scales_ptr + srow_off, mask=nmask, other=0.0).to(tl.float32)[:, None]
        else:
            sc = tl.load(scales_ptr + srow_off[:, None] + g[None, :], mask=m2,
                         other=0.0).to(tl.float32)
    else:
        CPG: tl.constexpr = G * BITS // 8  # columns (bytes) per group
        b0 = tl.load(codes_ptr + row_off[:, None] + c[None, :], mask=m2, other=0).to(tl.int32)
        b1 = b0
        if C == CPG:
            sc = tl.load(scales_ptr + srow_off, mask=nmask, other=0.0).to(tl.float32)[:, None]
        else:
            sc = tl.load(scales_ptr + srow_off[:, None] + (c // CPG)[None, :], mask=m2,
                         other=0.0).to(tl.float32)
    return b0, b1, sc


@triton.jit
def sub_values(b0, b1, sc, cent_ptr, K: tl.constexpr, C: tl.constexpr, KIND: tl.constexpr,
               BITS: tl.constexpr, G: tl.constexpr, LUT_SELECT: tl.constexpr = True):
    """Float32 values [BN, C] of sub-tensor K of a tile loaded by load_tile."""
    if KIND == 0:
        val = b0
    elif KIND == 1:
        BN: tl.constexpr = b0.shape[0]
        NB: tl.constexpr = C // 32
        val = tl.reshape(tl.reshape(b0, [BN, NB, 32]) * sc[:, :, None], [BN, C])
    elif KIND == 2:
        q = ((b0 >> (4 * K)) & 15) - 8
        val = q.to(tl.float32) * sc
    else:
        if BITS == 8:
            idx = b0
        elif BITS == 4:
            idx = (b0 >> (4 * K)) & 15
        elif BITS == 2:
            idx = (b0 >> (2 * K)) & 3
        else:
            Q4: tl.constexpr = G // 4
            c = tl.arange(0, C)
            hs = 4 * ((c % Q4) % 2) + K
            idx = ((b0 >> (2 * K)) & 3) | (((b1 >> hs[None, :]) & 1) << 2)
        if LUT_SELECT and BITS <= 4:
            val = _lut(idx, cent_ptr, BITS) * sc
        else:
            val = tl.load(cent_ptr + idx) * sc
    return val


@triton.jit
def _lut8(idx, cent_ptr, base: tl.constexpr, BITS: tl.constexpr):
    """cent[base + (idx & 7)] (or & 3 for BITS == 2) by a tree of selects: no memory gather."""
    b0 = (idx & 1) != 0
    b1 = (idx & 2) != 0
    v01 = tl.where(b0, tl.load(cent_ptr + base + 1), tl.load(cent_ptr + base + 0))
    v23 = tl.where(b0, tl.load(cent_ptr + base + 3), tl.load(cent_ptr + base + 2))
    v = tl.where(b1, v23, v01)
    if BITS >= 3:
        v45 = tl.where(b0, tl.load(cent_ptr + base + 5), tl.load(cent_ptr + base + 4))
        v67 = tl.where(b0, tl.load(cent_ptr + base + 7), tl.load(cent_ptr + base + 6))
        v = tl.where((idx & 4) != 0, tl.where(b1, v67, v45), v)
    return v


@triton.jit
def _lut(idx, cent_ptr, BITS: tl.constexpr):
    if BITS == 4:
        v = tl.where((idx & 8) != 0, _lut8(idx, cent_ptr, 8, 3), _lut8(idx, cent_ptr, 0, 3))
    else:
        v = _lut8(idx, cent_ptr, 0, BITS)
    return v
