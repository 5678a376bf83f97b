"""Quantize-on-write: encode K/V rows and scatter them into preallocated packed cache storage.

x [B, Hkv, T, D] is written to dst rows (b, h, positions[b, t]). Bit-exact with the torch codecs for
f16/bf16, q8_0 and q4_0 (IEEE divisions via div_rn, round-half-even done by hand, FMA contraction
off). turbo: the rotation (fp32 dot, IEEE) and the norm sum in a different order than torch, so u
can differ by a few ulps; an index then differs only when u sits within those ulps of a Lloyd-Max
boundary (neighbouring index), and the fp16 corrected norm by at most one ulp. tests/kernels
bounds both.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..codecs import Packed, rotation_matrix
from .launch import launch as cached_launch
from .triton_codec import cdiv, codec_meta, next_pow2, placeholder


@triton.jit
def _pack(idx, BT: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr):
    """int32 indices [BT, L] (values < 2**BITS) -> packed byte values int32 [BT, L*BITS/8] in the
    planar layout of codecs/packing.py (byte j holds values j + r*L/PB at bits r*BITS)."""
    PB: tl.constexpr = 8 // BITS
    v = tl.reshape(idx, [BT, PB, L // PB])
    sh = tl.arange(0, PB) * BITS
    return tl.sum(v << sh[None, :, None], 1)


@triton.jit
def _rne(x):
    """Round half to even (torch.round) for |x| < 2**22: adding 1.5 * 2**23 leaves no fraction
    bits, so the fp32 add rounds x to an integer the IEEE way (half to even) and the subtraction
    is exact — 2 instructions, where floor-based rounding took ~8 (the kernel builds without FMA
    contraction, and nothing reassociates fp adds)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def q8_0_rows(x):
    """q8_0 of float32 rows x [BT, D]: (codes int8 [BT, D], block scales fp16 [BT, D // 32]),
    bit for bit the torch codec's (IEEE divisions, round half to even)."""
    BT: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    NB: tl.constexpr = D // 32
    x3 = tl.reshape(x, [BT, NB, 32])
    amax = tl.max(tl.abs(x3), 2)
    d16 = tl.math.div_rn(amax, tl.full([BT, NB], 127.0, tl.float32)).to(tl.float16)
    df = d16.to(tl.float32)
    inv = tl.where(df > 0, tl.math.div_rn(tl.full([BT, NB], 1.0, tl.float32), tl.where(df > 0, df, 1.0)),
                   0.0)
    q = _rne(x3 * inv[:, :, None])
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32).to(tl.int8)
    return tl.reshape(q, [BT, D]), d16


@triton.jit
def _turbo_index(u, BOUNDS, CENT, BITS: tl.constexpr):
    """Lloyd-Max index of u [BT, G] (torch.bucketize(u, bounds): #(bounds < u)) and the per-row
    sum of the squared centroids of those indices [BT]. Up to 4 bits the codebook is symmetric
    (centroids -c / +c, boundaries -b / 0 / +b; checked on the host, `_symmetric`), so |u| is
    compared with the positive boundaries only, against scalars held in registers, and the sum of
    c^2 comes from how many values of the row pass each boundary (a row sum per boundary, no
    [BT, G] tensor of squares live through the search): no gather. A |u| exactly on a boundary
    takes the upper index on both sides (torch: the lower on the negative side; a neighbouring
    index, as a rounding difference would give). Wider codes: binary search with gathers."""
    if BITS <= 4:
        HALF: tl.constexpr = 1 << (BITS - 1)
        G: tl.constexpr = u.shape[1]
        a = tl.abs(u)
        c0 = tl.load(CENT + HALF)
        c2sum = tl.zeros([u.shape[0]], tl.float32) + G * (c0 * c0)
        m = tl.zeros(u.shape, tl.float32)  # counted in float: select + add, no predicate-to-int
        for k in tl.static_range(HALF - 1):
            above = tl.where(tl.load(BOUNDS + HALF + k) < a, 1.0, 0.0)
            m += above
            lo = tl.load(CENT + HALF + k)
            hi = tl.load(CENT + HALF + k + 1)
            c2sum += tl.sum(above, 1) * (hi * hi - lo * lo)
        idx = tl.where(u > 0, HALF + m, HALF - 1 - m).to(tl.int32)
    else:
        idx = tl.zeros(u.shape, tl.int32)
        for k in tl.static_range(BITS):
            bnd = tl.load(BOUNDS + idx + ((1 << (BITS - 1 - k)) - 1))
            idx = tl.where(bnd < u, idx + (1 << (BITS - 1 - k)), idx)
        c = tl.load(CENT + idx)
        c2sum = tl.sum(c * c, 1)
    return idx, c2sum


@triton.jit
def _quantize_tile(X, POS, SCL, CODES, SCALES, ROT, CENT, BOUNDS,
                   sxb, sxh, sxt, scb, sch, scs, ssb, ssh, sss, b, h, T, tile,
                   D: tl.constexpr, BLOCK_T: tl.constexpr, KIND: tl.constexpr,
                   BITS: tl.constexpr, G: tl.constexpr, HAS_S: tl.constexpr, SPLIT: tl.constexpr):
    """Row tile `tile` of sequence b, KV head h: rows t of X encoded to CODES / SCALES rows POS[b, t]."""
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    pos = tl.load(POS + b.to(tl.int64) * T + t, mask=tmask, other=0).to(tl.int64)
    xrow = b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + t.to(tl.int64) * sxt
    crow = b.to(tl.int64) * scb + h.to(tl.int64) * sch + pos * scs
    srow = b.to(tl.int64) * ssb + h.to(tl.int64) * ssh + pos * sss
    m2 = tmask[:, None]
    if KIND == 3:
        NG: tl.constexpr = D // G
        GB: tl.constexpr = G * BITS // 8
        i = tl.arange(0, G)
        # ROT is the rotation times sqrt(G): entries exactly +-1 in fp16. The fp32 rows are split
        # into fp16 hi + lo parts, so two tensor-core dots with fp32 accumulation give x @ R*sqrt(G)
        # to ~2^-22 relative (fp16 rows without InnerQ: lo is 0, one dot, SPLIT=False). Read per
        # tile (L2-resident, 32 KB at G = 128): held across the walk it pinned 64 registers per
        # thread and the tile spilled.
        rot = tl.load(ROT + i[:, None] * G + i[None, :])
        for g in tl.static_range(NG):
            xg = tl.load(X + xrow[:, None] + (g * G + i)[None, :], mask=m2, other=0.0)
            xg = xg.to(tl.float32)
            if HAS_S:
                xg = xg * tl.load(SCL + h * D + g * G + i)[None, :]
            x_hi = xg.to(tl.float16)
            y = tl.dot(x_hi, rot, out_dtype=tl.float32)
            if SPLIT:
                x_lo = (xg - x_hi.to(tl.float32)).to(tl.float16)
                y += tl.dot(x_lo, rot, out_dtype=tl.float32)
            norm = tl.sqrt(tl.sum(xg * xg, 1))
            safe = tl.where(norm > 0, norm, 1.0)
            # u = (x @ R) * sqrt(G) / ||x|| = (x @ R*sqrt(G)) / ||x||
            scl = tl.math.div_rn(tl.full([BLOCK_T], 1.0, tl.float32), safe)
            u = y * scl[:, None]
            idx, c2sum = _turbo_index(u, BOUNDS, CENT, BITS)
            cn = tl.sqrt(c2sum)
            corr = tl.where(norm > 0, tl.math.div_rn(norm, tl.where(cn > 0, cn, 1.0)), 0.0)
            tl.store(SCALES + srow + g, corr.to(tl.float16), mask=tmask)
            if BITS == 8:
                tl.store(CODES + crow[:, None] + (g * GB + i)[None, :], idx.to(tl.uint8), mask=m2)
            elif BITS == 3:
                lo = _pack(idx & 3, BLOCK_T, G, 2)
                hi = _pack(idx >> 2, BLOCK_T, G, 1)
                jl = tl.arange(0, G // 4)
                jh = tl.arange(0, G // 8)
                tl.store(CODES + crow[:, None] + (g * GB + jl)[None, :], lo.to(tl.uint8), mask=m2)
                tl.store(CODES + crow[:, None] + (g * GB + G // 4 + jh)[None, :], hi.to(tl.uint8),
                         mask=m2)
            else:
                pk = _pack(idx, BLOCK_T, G, BITS)
                j = tl.arange(0, GB)
                tl.store(CODES + crow[:, None] + (g * GB + j)[None, :], pk.to(tl.uint8), mask=m2)
    else:
        d = tl.arange(0, D)
        x = tl.load(X + xrow[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_S:
            x = x * tl.load(SCL + h * D + d)[None, :]
        if KIND == 0:
            tl.store(CODES + crow[:, None] + d[None, :], x.to(CODES.dtype.element_ty), mask=m2)
        else:
            NB: tl.constexpr = D // 32
            x3 = tl.reshape(x, [BLOCK_T, NB, 32])
            jb = tl.arange(0, NB)
            if KIND == 1:
                q, d16 = q8_0_rows(x)
                tl.store(CODES + crow[:, None] + d[None, :], q, mask=m2)
            else:
                ax = tl.abs(x3)
                pos_m = tl.argmax(ax, 2, tie_break_left=True)
                col = tl.arange(0, 32)
                m = tl.sum(tl.where(col[None, None, :] == pos_m[:, :, None], x3, 0.0), 2)
                d16 = (m * -0.125).to(tl.float16)
                df = d16.to(tl.float32)
                inv = tl.where(df != 0, tl.math.div_rn(tl.full([BLOCK_T, NB], 1.0, tl.float32),
                                                       tl.where(df != 0, df, 1.0)), 0.0)
                q = tl.floor(x3 * inv[:, :, None] + 8.5)
                q = tl.minimum(tl.maximum(q, 0.0), 15.0).to(tl.int32)
                pk = _pack(tl.reshape(q, [BLOCK_T, D]), BLOCK_T, D, 4)
                j = tl.arange(0, D // 2)
                tl.store(CODES + crow[:, None] + j[None, :], pk.to(tl.uint8), mask=m2)
            tl.store(SCALES + srow[:, None] + jb[None, :], d16, mask=m2)


@triton.jit
def _quantize_kernel(X, POS, SCL, CODES, SCALES, ROT, CENT, BOUNDS,
                     sxb, sxh, sxt, scb, sch, scs, ssb, ssh, sss,
                     HKV, T, N_TILES,
                     D: tl.constexpr, BLOCK_T: tl.constexpr, KIND: tl.constexpr,
                     BITS: tl.constexpr, G: tl.constexpr, HAS_S: tl.constexpr, SPLIT: tl.constexpr):
    # grid (B * HKV, programs along T): each program walks row tiles pid_t, pid_t + nprog, ...
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    h = pid_bh % HKV
    for tile in range(tl.program_id(1), N_TILES, tl.num_programs(1)):
        _quantize_tile(X, POS, SCL, CODES, SCALES, ROT, CENT, BOUNDS, sxb, sxh, sxt, scb, sch, scs,
                       ssb, ssh, sss, b, h, T, tile, D, BLOCK_T, KIND, BITS, G, HAS_S, SPLIT)


@triton.jit
def _quantize_pair_kernel(K, V, POS, SCL, KC, KS, VC, VS, ROT_K, CENT_K, BOUNDS_K,
                          ROT_V, CENT_V, BOUNDS_V,
                          skb, skh, skt, svb, svh, svt, kcb, kch, kcs, ksb, ksh, kss,
                          vcb, vch, vcs, vsb, vsh, vss, HKV, T,
                          D: tl.constexpr, BLOCK_T: tl.constexpr,
                          KIND_K: tl.constexpr, BITS_K: tl.constexpr, G_K: tl.constexpr,
                          HAS_S: tl.constexpr, SPLIT_K: tl.constexpr,
                          KIND_V: tl.constexpr, BITS_V: tl.constexpr, G_V: tl.constexpr,
                          SPLIT_V: tl.constexpr):
    # grid (2 * B * HKV,): the first B * HKV programs encode K's rows (InnerQ scales with HAS_S),
    # the others V's — the tile of `_quantize_kernel` for either, T <= BLOCK_T rows (one tile)
    pid = tl.program_id(0)
    n = tl.num_programs(0) // 2
    bh = pid % n
    b = bh // HKV
    h = bh % HKV
    if pid < n:
        _quantize_tile(K, POS, SCL, KC, KS, ROT_K, CENT_K, BOUNDS_K, skb, skh, skt, kcb, kch, kcs,
                       ksb, ksh, kss, b, h, T, 0, D, BLOCK_T, KIND_K, BITS_K, G_K, HAS_S, SPLIT_K)
    else:
        _quantize_tile(V, POS, SCL, VC, VS, ROT_V, CENT_V, BOUNDS_V, svb, svh, svt, vcb, vch, vcs,
                       vsb, vsh, vss, b, h, T, 0, D, BLOCK_T, KIND_V, BITS_V, G_V, False, SPLIT_V)


_ROT16: dict = {}


def _signed_rotation(G: int, device) -> torch.Tensor:
    """The rotation times sqrt(G) as fp16 (entries exactly +-1), built once per (G, device)."""
    key = (G, str(torch.device(device)))
    r = _ROT16.get(key)
    if r is None:
        r = (rotation_matrix(G, device) * math.sqrt(G)).round().to(torch.float16).contiguous()
        _ROT16[key] = r
    return r


def quantize_into_triton(dst: Packed, x: torch.Tensor, codec, positions: torch.Tensor,
                         innerq: torch.Tensor | None = None, block_t: int | None = None,
                         num_warps: int | None = None, programs_per_sm: int | None = None) -> None:
    """x [B, Hkv, T, D]; positions int [B, T]; dst Packed leading [B, Hkv, S_cap]. Row tiles of
    `block_t` rows (default: turbo 128 on 8 warps, fewer for short T; others 32).
    programs_per_sm: at most that many programs per SM, each walking several tiles
    (`_quantize_kernel`); 0: one program per tile (default: 2 for turbo, 0 otherwise)."""
    B, Hkv, T, D = x.shape
    meta = codec_meta(codec)
    dev = x.device
    pos = positions.to(device=dev, dtype=torch.int64).contiguous()
    c = dst.codes
    s = dst.scales if dst.scales is not None else dst.codes
    if c.stride(-1) != 1 or s.stride(-1) != 1:
        raise ValueError("dst must be contiguous in the last dim")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rot, cent, bounds = _codec_args(codec, dev)
    scl = innerq.to(device=dev, dtype=torch.float32).contiguous() if innerq is not None else placeholder(dev)
    turbo = meta["KIND"] == 3
    split = x.dtype != torch.float16 or innerq is not None
    cap_key = (meta["KIND"], meta["BITS"], D, x.dtype, innerq is not None, str(dev))
    chosen = block_t is not None
    if block_t is None:  # H200 sweep (docs/kernels_notes.md, quantize): 128-row turbo tiles on 8 warps
        # (at most 128 x 128 values a tile: D = 256 at 128 rows needed 240 KB of shared memory)
        block_t = (min(16384 // D, max(16, next_pow2(T))) if turbo else (32 if T >= 32 else 16))
        block_t = min(block_t, _TILE_CAP.get(cap_key, block_t))
    if programs_per_sm is None:  # H200, v10 builds: turbo3 69.1 us at 2 per SM, 72.1 at 4, 78.7 at 8
        programs_per_sm = 2 if turbo else 0
    while True:
        n_tiles = cdiv(T, block_t)
        per_head = (max(1, cdiv(programs_per_sm * _sm_count(dev), B * Hkv)) if programs_per_sm > 0
                    else n_tiles)
        try:
            cached_launch(
                _quantize_kernel, (B * Hkv, min(n_tiles, per_head)), x, pos, scl, c, s, rot, cent, bounds,
                x.stride(0), x.stride(1), x.stride(2), c.stride(0), c.stride(1), c.stride(2),
                s.stride(0), s.stride(1), s.stride(2),
                Hkv, T, n_tiles,
                D=D, BLOCK_T=block_t, KIND=meta["KIND"], BITS=meta["BITS"], G=meta["G"],
                HAS_S=innerq is not None, SPLIT=split,
                num_warps=num_warps or (8 if turbo and block_t >= 128 else 4), enable_fp_fusion=False)
            return
        except OutOfResources:
            # the build needs more shared memory than the device has (H200: turbo8 at head_dim 128
            # on fp32 rows asked 240 KB of 227 KB): halve the row tile, remember it for this shape
            if chosen or block_t <= 16:
                raise
            block_t //= 2
            _TILE_CAP[cap_key] = block_t


_TILE_CAP: dict = {}  # (kind, bits, D, row dtype, InnerQ, device) -> largest tile that built

#: Rows per sequence up to which `quantize_pair_triton` writes K and V in one launch (a decode or
#: verify step's rows: one 16-row tile each, the tile `quantize_into_triton` picks for them).
PAIR_MAX_ROWS = 16


def _codec_args(codec, dev) -> tuple:
    """(rot, cent, bounds) of a turbo codec for `_quantize_tile` (placeholders otherwise)."""
    meta = codec_meta(codec)
    if meta["KIND"] != 3:
        dummy = placeholder(dev)
        return dummy, dummy, dummy
    if meta["BITS"] <= 4:
        _check_symmetric(codec)
    return (_signed_rotation(meta["G"], dev), *codec.tables(dev))


def pair_args(dst_k: Packed, k_codec, dst_v: Packed, v_codec, positions: torch.Tensor,
              innerq: torch.Tensor | None, k_dtype: torch.dtype, v_dtype: torch.dtype, dev) -> tuple:
    """What `_quantize_tile` needs to write K rows (dtype k_dtype) to dst_k and V rows to dst_v at
    positions int [B, T], as the kernels that run it for both take it (`_quantize_pair_kernel`,
    `triton_ring._ring_step_kernel`): (head, strides, consts) — head: positions, InnerQ scales, K's
    codes and scales, V's, then K's and V's rotation / centroids / bounds; strides: the four
    destination tensors' first three strides; consts: the codecs' constexprs."""
    kc, vc = dst_k.codes, dst_v.codes
    ks = dst_k.scales if dst_k.scales is not None else kc
    vs = dst_v.scales if dst_v.scales is not None else vc
    if any(t.stride(-1) != 1 for t in (kc, ks, vc, vs)):
        raise ValueError("dst must be contiguous in the last dim")
    pos = positions.to(device=dev, dtype=torch.int64).contiguous()
    scl = innerq.to(device=dev, dtype=torch.float32).contiguous() if innerq is not None else placeholder(dev)
    head = (pos, scl, kc, ks, vc, vs, *_codec_args(k_codec, dev), *_codec_args(v_codec, dev))
    strides = tuple(t.stride(i) for t in (kc, ks, vc, vs) for i in range(3))
    mk, mv = codec_meta(k_codec), codec_meta(v_codec)
    consts = dict(KIND_K=mk["KIND"], BITS_K=mk["BITS"], G_K=mk["G"], HAS_S=innerq is not None,
                  SPLIT_K=k_dtype != torch.float16 or innerq is not None,
                  KIND_V=mv["KIND"], BITS_V=mv["BITS"], G_V=mv["G"], SPLIT_V=v_dtype != torch.float16)
    return head, strides, consts


def quantize_pair_triton(dst_k: Packed, k: torch.Tensor, k_codec, dst_v: Packed, v: torch.Tensor,
                         v_codec, positions: torch.Tensor, innerq: torch.Tensor | None = None) -> bool:
    """`quantize_into_triton` of k into dst_k (InnerQ scales innerq) and of v into dst_v at the same
    positions int [B, T], in one launch (a step's K and V writes: one kernel instead of two,
    each a few µs of a captured decode step). k, v [B, Hkv, T, D]; dst_* Packed leading
    [B, Hkv, S_cap] (any batch stride, 0 included). Returns False, writing nothing, where T >
    PAIR_MAX_ROWS (the caller then writes them apart)."""
    B, Hkv, T, D = k.shape
    if T > PAIR_MAX_ROWS or v.shape != k.shape:
        return False
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    head, strides, consts = pair_args(dst_k, k_codec, dst_v, v_codec, positions, innerq, k.dtype, v.dtype,
                                      k.device)
    if B * Hkv * T:
        cached_launch(
            _quantize_pair_kernel, (2 * B * Hkv,), k, v, *head,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), *strides, Hkv, T,
            D=D, BLOCK_T=PAIR_MAX_ROWS, **consts, num_warps=4, enable_fp_fusion=False)
    return True


_SYMMETRIC: set = set()


def _check_symmetric(codec) -> None:
    """`_turbo_index` relies on a symmetric codebook (centroids c_k = -c_{L-1-k}, boundaries b_k =
    -b_{L-2-k}), as Lloyd-Max on the symmetric coordinate distribution gives; checked once per codec."""
    key = (codec.head_dim, codec.bits)
    if key in _SYMMETRIC:
        return
    cent, bounds = (t.detach().float().cpu() for t in codec.tables("cpu"))
    if not (torch.equal(cent, -cent.flip(0)) and torch.equal(bounds, -bounds.flip(0))):
        raise ValueError(f"turbo{codec.bits} codebook (head_dim {codec.head_dim}) is not symmetric; "
                         "the quantize kernel's index search needs it")
    _SYMMETRIC.add(key)


def _sm_count(device) -> int:
    """Multiprocessors of `device` (CUDA), a nominal 4 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
