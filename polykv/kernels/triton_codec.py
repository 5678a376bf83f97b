"""Triton device helpers that read the packed KV formats of polykv.codecs (DESIGN §3).

Tiles. A K or V row of D values is read as NG = D / GW tiles of GW columns (GW = G for turbo, D
otherwise). A tile is decoded from contiguous byte chunks (planar layout, codecs/packing.py) in NPH
"phases": phase p is the contiguous run of W = GW / NPH dims [p*W, (p+1)*W) and is one shift/mask of
a [BN, W] byte chunk:

    kind     NPH  chunks of a tile (bytes)                phase p
    raw        1  the f16/bf16 values                     -
    q8_0       1  int8 [BN, D]                            q * scale[d // 32]
    q4_0       2  [BN, D/2]                               ((b >> 4p) & 15) - 8, scale per 32 dims
    turbo8     1  [BN, G]                                 cent[b]
    turbo4     2  [BN, G/2]                               cent[(b >> 4p) & 15]
    turbo2     4  [BN, G/4]                               cent[(b >> 2p) & 3]
    turbo3     8  lo0, lo1 [BN, G/8] (low-bit plane       cent[((lo_{p%2} >> 2(p//2)) & 3)
                  halves), hi [BN, G/8] (high-bit plane)       | (((hi >> p) & 1) << 2)]

The phases are joined (tl.join tree + reshape, registers only) into one fp16 [BN, GW] tile whose
column c holds dim perm(c) = bitrev(c % NPH) * W + c // NPH; q is loaded and the output stored in
that column order, so the dots never need the natural order. turbo values come out WITHOUT the norm
(K: scores are scaled by norm[t] after the dot; V: P is scaled by norm[t] before it).

Decoding of a phase: DEC=0 plain Triton (shift/mask, select tree; the only mode the interpreter
runs); DEC=1 PTX inline asm on 4 packed bytes at a time (shift/mask on the packed word, then `prmt`
byte permutes as a 8-entry fp16 lookup table: 2.5-3.5 instructions per value instead of ~15), with
the table baked into the asm string (asm_strings()).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import torch
import triton
import triton.language as tl

from ..codecs import Codec
from ..codecs.blockq import Q4_0, Q8_0
from ..codecs.raw import RawCodec
from ..codecs.turbo import TurboCodec

KIND_RAW, KIND_Q8, KIND_Q4, KIND_TURBO = 0, 1, 2, 3


def _codec_key(codec: Codec) -> tuple:
    """What the kernels' view of a codec depends on (its type, name, head_dim and group)."""
    return type(codec).__name__, codec.name, codec.head_dim, getattr(codec, "group", 0)


_META: dict = {}


def codec_meta(codec: Codec) -> Mapping:
    """Compile-time description of a codec for the kernels (read-only; built once per codec key:
    every eager attention call asks for it several times)."""
    key = _codec_key(codec)
    m = _META.get(key)
    if m is None:
        m = _META[key] = MappingProxyType(_codec_meta(codec))
    return m


def _codec_meta(codec: Codec) -> dict:
    D = codec.head_dim
    if isinstance(codec, RawCodec):
        return dict(KIND=KIND_RAW, BITS=16, G=D, GW=D, NPH=1)
    if isinstance(codec, Q8_0):
        return dict(KIND=KIND_Q8, BITS=8, G=32, GW=D, NPH=1)
    if isinstance(codec, Q4_0):
        return dict(KIND=KIND_Q4, BITS=4, G=32, GW=D, NPH=2)
    if isinstance(codec, TurboCodec):
        nph = {8: 1, 4: 2, 3: 8, 2: 4}[codec.bits]
        return dict(KIND=KIND_TURBO, BITS=codec.bits, G=codec.group, GW=codec.group, NPH=nph)
    raise TypeError(f"no kernel support for codec {codec!r}")


# ----------------------------------------------------------------------------- inline asm (PTX)

def _f16_bits(vals) -> list[int]:
    return [int(x) for x in np.asarray(vals, dtype=np.float16).view(np.uint16)]


def _word(bytes4) -> str:
    return f"0x{sum((b & 0xFF) << (8 * i) for i, b in enumerate(bytes4)):08x}"


def _lut8_tail(t16: list[int], idx: str, sign: str = "") -> str:
    """PTX: 4 packed byte indices (< 8) in register `idx` -> $0, $1 (4 fp16 via table t16); sign:
    a register whose bytes are all ones where the value's sign bit is to be flipped."""
    lo = [x & 0xFF for x in t16] + [0] * (8 - len(t16))
    hi = [x >> 8 for x in t16] + [0] * (8 - len(t16))
    flip = f"and.b32 {sign}, {sign}, 0x80808080; xor.b32 h, h, {sign}; " if sign else ""
    return (f"shr.b32 t, {idx}, 4; or.b32 t, t, {idx}; prmt.b32 s, t, t, 0x0020; "
            f"mov.b32 x, {_word(lo[:4])}; mov.b32 y, {_word(lo[4:])}; prmt.b32 l, x, y, s; "
            f"mov.b32 x, {_word(hi[:4])}; mov.b32 y, {_word(hi[4:])}; prmt.b32 h, x, y, s; " + flip +
            "prmt.b32 $0, l, h, 0x5140; prmt.b32 $1, l, h, 0x7362;")


_REGS = "{ .reg .b32 a, b, j, m, t, s, x, y, l, h, la, lb, ha, hb; "


def _asm_small(t16: list[int], bits: int, p: int) -> str:
    """bits 2 / 3: phase p of the planar layout ($2 = low-plane bytes, $3 = high-plane bytes)."""
    sl = 2 * p if bits == 2 else 2 * (p // 2)
    s = _REGS + f"shr.b32 a, $2, {sl}; and.b32 a, a, 0x03030303; "
    if bits == 3:
        if p > 2:
            s += f"shr.b32 b, $3, {p - 2}; "
        elif p < 2:
            s += f"shl.b32 b, $3, {2 - p}; "
        else:
            s += "mov.b32 b, $3; "
        s += "and.b32 b, b, 0x04040404; or.b32 a, a, b; "
    return s + _lut8_tail(t16, "a") + " }"


def _asm_nib(t16: list[int], p: int) -> str:
    """4-bit turbo: nibble p of $2 -> fp16 via the codebook t16 (16 entries, ascending, symmetric:
    t16[15 - i] is -t16[i], as every Lloyd-Max codebook is). One 8-entry lookup of the lower half:
    an index i >= 8 reads entry 15 - i (i xor the byte's mask m, all ones when bit 3 is set) and
    gets its sign flipped (m & 0x80 on the high byte) -- 12 ALU instructions per 4 values where
    two lookups of the halves and a byte select took 19 (kernels_notes v23)."""
    if any(t16[15 - i] != t16[i] ^ 0x8000 for i in range(16)):
        raise ValueError("the 4-bit decode needs a symmetric codebook")
    # m: bit 3 of each byte's nibble moved to the byte's top bit (already there for p = 1), then
    # that bit replicated over the byte (prmt's sign mode)
    top = "shl.b32 m, $2, 4; prmt.b32 m, m, m, 0xBA98; " if p == 0 else "prmt.b32 m, $2, $2, 0xBA98; "
    return (_REGS + f"shr.b32 a, $2, {4 * p}; " + top + "xor.b32 j, a, m; and.b32 j, j, 0x07070707; "
            + _lut8_tail(t16[:8], "j", sign="m") + " }")


def _asm_q4(p: int) -> str:
    """q4_0: nibble p of $2 -> fp16(i - 8) by the magic number, as ASM_Q8: the nibble is the low
    mantissa byte of fp16 0x64ii = 1024 + i, and 1032 is subtracted (exact for every nibble)."""
    return (_REGS + f"shr.b32 a, $2, {4 * p}; and.b32 a, a, 0x0f0f0f0f; mov.b32 x, 0x64646464; "
            "prmt.b32 l, a, x, 0x4140; prmt.b32 h, a, x, 0x4342; mov.b32 y, 0x64086408; "
            "sub.f16x2 $0, l, y; sub.f16x2 $1, h, y; }")


ASM_Q8 = (_REGS + "xor.b32 a, $2, 0x80808080; mov.b32 x, 0x64646464; prmt.b32 l, a, x, 0x4140; "
          "prmt.b32 h, a, x, 0x4342; mov.b32 y, 0x64806480; sub.f16x2 $0, l, y; "
          "sub.f16x2 $1, h, y; }")  # int8 -> fp16 exactly: fp16(0x6400 | (q ^ 0x80)) - 1152


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b) for launch arithmetic (triton.cdiv is a ConstexprFunction: ~2 µs a
    call, and an eager attention call made a dozen of them)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side smallest power of two >= n, as triton.next_power_of_2 (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_ASM: dict = {}


def asm_strings(codec: Codec) -> tuple[str, ...]:
    """Eight PTX strings (one per phase, "" when unused) for DEC=1. Built once per codec type,
    name and head_dim (a turbo codebook depends on its bits and group only): building them costs
    ~0.2-0.4 ms of host time, which every eager attention call paid."""
    key = (type(codec).__name__, codec.name, codec.head_dim)
    out = _ASM.get(key)
    if out is None:
        out = _ASM[key] = _build_asm_strings(codec)
    return out


def _build_asm_strings(codec: Codec) -> tuple[str, ...]:
    m = codec_meta(codec)
    out = [""] * 8
    if m["KIND"] == KIND_Q8:
        out[0] = ASM_Q8
    elif m["KIND"] == KIND_Q4:
        out[0], out[1] = _asm_q4(0), _asm_q4(1)
    elif m["KIND"] == KIND_TURBO and m["BITS"] in (2, 3, 4):
        t = _f16_bits(codec.centroids.numpy())
        for p in range(m["NPH"]):
            out[p] = _asm_nib(t, p) if m["BITS"] == 4 else _asm_small(t, m["BITS"], p)
    return tuple(out)


def asm_ok(codec: Codec, block_n: int, num_warps: int) -> bool:
    """DEC=1 needs every thread to hold a multiple of 4 elements of the smallest byte chunk."""
    m = codec_meta(codec)
    if m["KIND"] == KIND_RAW or (m["KIND"] == KIND_TURBO and m["BITS"] == 8):
        return False
    w = m["GW"] // m["NPH"]
    return (block_n * w) % (4 * 32 * num_warps) == 0


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def perm_cols(GW: tl.constexpr, NPH: tl.constexpr):
    """Dim (within the tile) held by each column of a joined tile."""
    c = tl.arange(0, GW)
    lo = c % NPH
    if NPH == 8:
        p = ((lo & 1) << 2) | (lo & 2) | (lo >> 2)
    elif NPH == 4:
        p = ((lo & 1) << 1) | (lo >> 1)
    else:
        p = lo
    return p * (GW // NPH) + c // NPH


@triton.jit
def _asm16(a, b, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,=r,r,r", [a, b], dtype=tl.float16, is_pure=True,
                                     pack=4)


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


@triton.jit
def _phase(lo, hi, cent_ptr, p: tl.constexpr, BITS: tl.constexpr, DEC: tl.constexpr,
           ASM: tl.constexpr):
    """fp16 [BN, W] centroid values of phase p (turbo 2/3/4-bit)."""
    if DEC == 1:
        v = _asm16(lo, hi, ASM)
    else:
        if BITS == 4:
            idx = (lo.to(tl.int32) >> (4 * p)) & 15
        elif BITS == 2:
            idx = (lo.to(tl.int32) >> (2 * p)) & 3
        else:
            idx = ((lo.to(tl.int32) >> (2 * (p // 2))) & 3) | (((hi.to(tl.int32) >> p) & 1) << 2)
        v = _lut(idx, cent_ptr, BITS).to(tl.float16)
    return v


@triton.jit
def _q4_phase(b, sc, p: tl.constexpr, DEC: tl.constexpr, ASM: tl.constexpr):
    BN: tl.constexpr = b.shape[0]
    W: tl.constexpr = b.shape[1]
    if DEC == 1:
        v = _asm16(b, b, ASM)
    else:
        v = (((b.to(tl.int32) >> (4 * p)) & 15) - 8).to(tl.float16)
    return tl.reshape(tl.reshape(v, [BN, W // 32, 32]) * sc[:, :, None], [BN, W])


@triton.jit
def load_tile(CODES, SCALES, CENT, row_off, srow_off, nmask, g: tl.constexpr, BN: tl.constexpr,
              D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
              GW: tl.constexpr, NPH: tl.constexpr, DEC: tl.constexpr,
              A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
              A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr):
    """fp16 [BN, GW] tile g of a row block (columns in perm_cols order; turbo without norm).
    row_off / srow_off: int64 [BN] element offsets of each row in codes / scales."""
    m2 = nmask[:, None]
    W: tl.constexpr = GW // NPH
    w = tl.arange(0, W)
    # one if/elif chain and a single return: Triton checks every return's type
    if KIND == 0:
        val = tl.load(CODES + row_off[:, None] + w[None, :], mask=m2, other=0.0).to(tl.float16)
    elif KIND == 1:
        q = tl.load(CODES + row_off[:, None] + w[None, :], mask=m2, other=0)
        if DEC == 1:
            v = _asm16(q, q, A0)
        else:
            v = q.to(tl.float16)
        NB: tl.constexpr = D // 32
        sc = tl.load(SCALES + srow_off[:, None] + tl.arange(0, NB)[None, :], mask=m2, other=0.0)
        val = tl.reshape(tl.reshape(v, [BN, NB, 32]) * sc[:, :, None], [BN, D])
    elif KIND == 2:
        b = tl.load(CODES + row_off[:, None] + w[None, :], mask=m2, other=0)
        NH: tl.constexpr = D // 64
        jb = tl.arange(0, NH)
        s0 = tl.load(SCALES + srow_off[:, None] + jb[None, :], mask=m2, other=0.0)
        s1 = tl.load(SCALES + srow_off[:, None] + (NH + jb)[None, :], mask=m2, other=0.0)
        v0 = _q4_phase(b, s0, 0, DEC, A0)
        v1 = _q4_phase(b, s1, 1, DEC, A1)
        val = tl.reshape(tl.join(v0, v1), [BN, GW])
    elif BITS == 8:
        b = tl.load(CODES + row_off[:, None] + (g * G + w)[None, :], mask=m2, other=0)
        val = tl.load(CENT + b.to(tl.int32)).to(tl.float16)
    elif BITS == 4:
        b = tl.load(CODES + row_off[:, None] + (g * (G // 2) + w)[None, :], mask=m2, other=0)
        v0 = _phase(b, b, CENT, 0, 4, DEC, A0)
        v1 = _phase(b, b, CENT, 1, 4, DEC, A1)
        val = tl.reshape(tl.join(v0, v1), [BN, GW])
    elif BITS == 2:
        b = tl.load(CODES + row_off[:, None] + (g * (G // 4) + w)[None, :], mask=m2, other=0)
        v0 = _phase(b, b, CENT, 0, 2, DEC, A0)
        v1 = _phase(b, b, CENT, 1, 2, DEC, A1)
        v2 = _phase(b, b, CENT, 2, 2, DEC, A2)
        v3 = _phase(b, b, CENT, 3, 2, DEC, A3)
        val = tl.reshape(tl.join(tl.join(v0, v1), tl.join(v2, v3)), [BN, GW])
    else:
        base = row_off[:, None] + (g * (3 * G // 8) + w)[None, :]
        la = tl.load(CODES + base, mask=m2, other=0)
        lb = tl.load(CODES + base + W, mask=m2, other=0)
        hi = tl.load(CODES + base + 2 * W, mask=m2, other=0)
        v0 = _phase(la, hi, CENT, 0, 3, DEC, A0)
        v1 = _phase(lb, hi, CENT, 1, 3, DEC, A1)
        v2 = _phase(la, hi, CENT, 2, 3, DEC, A2)
        v3 = _phase(lb, hi, CENT, 3, 3, DEC, A3)
        v4 = _phase(la, hi, CENT, 4, 3, DEC, A4)
        v5 = _phase(lb, hi, CENT, 5, 3, DEC, A5)
        v6 = _phase(la, hi, CENT, 6, 3, DEC, A6)
        v7 = _phase(lb, hi, CENT, 7, 3, DEC, A7)
        val = tl.reshape(tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)),
                                 tl.join(tl.join(v4, v5), tl.join(v6, v7))), [BN, GW])
    return val


_PLACEHOLDERS: dict = {}


def placeholder(device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [1] tensor for pointer arguments a kernel variant never reads (codebooks of non-turbo
    codecs, absent InnerQ scales, the page table of unpaged launches: int32): one per (device,
    dtype), so launches allocate and fill nothing (a captured decode step would otherwise carry a
    fill kernel per call)."""
    key = (str(torch.device(device)), dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return t



# ----------------------------------------------------------------------------- phase tiles (v5)
#
# A row of D values is read as NP = D / PW "phases" of PW contiguous dims [fp*PW, (fp+1)*PW), each
# decoded from ONE contiguous byte run by one uniform shift/mask (planar layout) — an elementwise
# chain from a load to the dot. Triton then keeps the compressed bytes in shared memory (cp.async)
# and decodes them in registers straight in the mma operand layout: no decoded tile goes back
# through shared memory, and no join/reshape shuffles. Phase fp = (g * NPH + ph) * NSB + sb:
# tile g (turbo group), planar phase ph, 32-dim scale block sb (q8_0 / q4_0). Its per-row factor
# (block scale for q8_0 / q4_0, group norm for turbo, none for raw) is applied by the caller: to the
# scores for K, to P for V.

_PHASE_META: dict = {}


def phase_meta(codec: Codec) -> Mapping:
    """codec_meta plus NSB (scale sub-blocks per planar phase) and PW (phase width); read-only,
    built once per codec key."""
    key = _codec_key(codec)
    pm = _PHASE_META.get(key)
    if pm is None:
        m = dict(codec_meta(codec))
        w = m["GW"] // m["NPH"]
        m["NSB"] = w // 32 if m["KIND"] in (KIND_Q8, KIND_Q4) else 1
        m["PW"] = w // m["NSB"]
        pm = _PHASE_META[key] = MappingProxyType(m)
    return pm


def phase_ok(codec: Codec) -> bool:
    """The phase kernels need every phase >= 16 dims wide (tl.dot's smallest K / N)."""
    return phase_meta(codec)["PW"] >= 16


@triton.jit
def _asm16_ph(a, b, ph: tl.constexpr, A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr,
              A3: tl.constexpr, A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr,
              A7: tl.constexpr):
    """_asm16 with the PTX string of planar phase ph."""
    if ph == 0:
        v = _asm16(a, b, A0)
    elif ph == 1:
        v = _asm16(a, b, A1)
    elif ph == 2:
        v = _asm16(a, b, A2)
    elif ph == 3:
        v = _asm16(a, b, A3)
    elif ph == 4:
        v = _asm16(a, b, A4)
    elif ph == 5:
        v = _asm16(a, b, A5)
    elif ph == 6:
        v = _asm16(a, b, A6)
    else:
        v = _asm16(a, b, A7)
    return v


@triton.jit
def phase_tile(CODES, CENT, row_off, m2, g: tl.constexpr, ph: tl.constexpr, sb: tl.constexpr,
               D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
               PW: tl.constexpr, DEC: tl.constexpr,
               A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
               A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr,
               TRANS: tl.constexpr = False):
    """fp16 [BN, PW] values of phase (g, ph, sb) without their factor (q8_0 / q4_0: the integer
    values; turbo: centroids). row_off int64 [BN, 1] element offsets of the rows, m2 [BN, 1] mask.
    TRANS: the tile [PW, BN] instead (row_off / m2 [1, BN]), loaded transposed.
    A0..A7: the PTX strings of the planar phases (asm_strings), used when DEC == 1."""
    if TRANS:
        w = tl.arange(0, PW)[:, None]
    else:
        w = tl.arange(0, PW)[None, :]
    if KIND == 0:
        val = tl.load(CODES + row_off + w, mask=m2, other=0.0).to(tl.float16)
    elif KIND == 1:
        q = tl.load(CODES + row_off + (sb * PW + w), mask=m2, other=0)
        if DEC == 1:
            val = _asm16(q, q, A0)
        else:
            val = q.to(tl.float16)
    elif KIND == 2:
        b = tl.load(CODES + row_off + (sb * PW + w), mask=m2, other=0)
        if DEC == 1:
            val = _asm16_ph(b, b, ph, A0, A1, A2, A3, A4, A5, A6, A7)
        else:
            val = (((b.to(tl.int32) >> (4 * ph)) & 15) - 8).to(tl.float16)
    else:
        gb = g * (G * BITS // 8)
        if BITS == 8:
            b = tl.load(CODES + row_off + (gb + w), mask=m2, other=0)
            val = tl.load(CENT + b.to(tl.int32)).to(tl.float16)
        elif BITS == 3:
            lo = tl.load(CODES + row_off + (gb + (ph % 2) * PW + w), mask=m2, other=0)
            hi = tl.load(CODES + row_off + (gb + 2 * PW + w), mask=m2, other=0)
            if DEC == 1:
                val = _asm16_ph(lo, hi, ph, A0, A1, A2, A3, A4, A5, A6, A7)
            else:
                val = _phase(lo, hi, CENT, ph, 3, 0, A0)
        else:
            b = tl.load(CODES + row_off + (gb + w), mask=m2, other=0)
            if DEC == 1:
                val = _asm16_ph(b, b, ph, A0, A1, A2, A3, A4, A5, A6, A7)
            else:
                val = _phase(b, b, CENT, ph, BITS, 0, A0)
    return val
