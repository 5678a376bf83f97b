"""Dequant materialize (DESIGN §4 Level A): packed rows -> dense f16/bf16/f32 tile.

True space by default (turbo: centroid x norm, then the inverse rotation as one fp32 dot per group);
rotated=True keeps the storage domain (for a caller that rotates q and unrotates the output once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codecs import Packed, rotation_matrix
from .launch import launch as cached_launch
from .triton_codec import cdiv, codec_meta, placeholder


@triton.jit
def _dequant_kernel(CODES, SCALES, CENT, ROTT, OUT, R, CB, NSC,
                    D: tl.constexpr, BLOCK_R: tl.constexpr, KIND: tl.constexpr,
                    BITS: tl.constexpr, G: tl.constexpr, ROTATED: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    m2 = rmask[:, None]
    rc = r.to(tl.int64) * CB
    rs = r.to(tl.int64) * NSC
    ro = r.to(tl.int64) * D
    if KIND == 3:
        NG: tl.constexpr = D // G
        GB: tl.constexpr = G * BITS // 8
        i = tl.arange(0, G)
        for g in tl.static_range(NG):
            # planar layout (codecs/packing.py)
            if BITS == 3:
                lo = tl.load(CODES + rc[:, None] + (g * GB + i % (G // 4))[None, :], mask=m2,
                             other=0)
                hi = tl.load(CODES + rc[:, None] + (g * GB + G // 4 + i % (G // 8))[None, :],
                             mask=m2, other=0)
                idx = ((lo.to(tl.int32) >> (2 * (i // (G // 4)))[None, :]) & 3) | \
                    (((hi.to(tl.int32) >> (i // (G // 8))[None, :]) & 1) << 2)
            else:
                by = tl.load(CODES + rc[:, None] + (g * GB + i % GB)[None, :], mask=m2, other=0)
                idx = (by.to(tl.int32) >> ((i // GB) * BITS)[None, :]) & ((1 << BITS) - 1)
            nrm = tl.load(SCALES + rs + g, mask=rmask, other=0.0).to(tl.float32)
            y = tl.load(CENT + idx) * nrm[:, None]
            if not ROTATED:
                rt = tl.load(ROTT + i[:, None] * G + i[None, :])
                y = tl.dot(y, rt, input_precision="ieee")
            tl.store(OUT + ro[:, None] + (g * G + i)[None, :], y.to(OUT.dtype.element_ty), mask=m2)
    else:
        d = tl.arange(0, D)
        if KIND == 0:
            y = tl.load(CODES + rc[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        elif KIND == 1:
            q = tl.load(CODES + rc[:, None] + d[None, :], mask=m2, other=0).to(tl.float32)
            sc = tl.load(SCALES + rs[:, None] + (d // 32)[None, :], mask=m2, other=0.0)
            y = q * sc.to(tl.float32)
        else:
            by = tl.load(CODES + rc[:, None] + (d % (D // 2))[None, :], mask=m2,
                         other=0).to(tl.int32)
            q = ((by >> (4 * (d // (D // 2)))[None, :]) & 15) - 8
            sc = tl.load(SCALES + rs[:, None] + (d // 32)[None, :], mask=m2, other=0.0)
            y = q.to(tl.float32) * sc.to(tl.float32)
        tl.store(OUT + ro[:, None] + d[None, :], y.to(OUT.dtype.element_ty), mask=m2)


def dequantize_triton(p: Packed, codec, dtype=torch.float16, rotated: bool = False,
                      block_r: int = 16) -> torch.Tensor:
    meta = codec_meta(codec)
    D = codec.head_dim
    lead = p.codes.shape[:-1]
    codes = p.codes.reshape(-1, p.codes.shape[-1]).contiguous()
    R = codes.shape[0]
    dev = codes.device
    scales = p.scales.reshape(R, -1).contiguous() if p.scales is not None else codes
    nsc = scales.shape[1] if p.scales is not None else 0
    out = torch.empty(R, D, dtype=dtype, device=dev)
    dummy = placeholder(dev)
    if meta["KIND"] == 3:
        cent = codec.tables(dev)[0]
        rott = rotation_matrix(meta["G"], dev).t().contiguous()
    else:
        cent = rott = dummy
    if R:
        cached_launch(
            _dequant_kernel, (cdiv(R, block_r),), codes, scales, cent, rott, out, R, codes.shape[1], nsc,
            D=D, BLOCK_R=block_r, KIND=meta["KIND"], BITS=meta["BITS"], G=meta["G"],
            ROTATED=bool(rotated), num_warps=4)
    return out.reshape(*lead, D)
