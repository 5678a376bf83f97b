"""One decode or verify step of the agents' recent windows (polykv.pool.ring) in one launch.

The step stores the forward's new K/V rows into the q8_0 ring and returns the window segment the
attention reads (`reference.ring_step_ref` is the torch definition). In torch that is two
quantize launches, a scatter and a gather of four tensors: about fourteen kernels per layer and
step, each a few µs of a captured step (H200: a window of 8 rows cost +0.26 ms per 4-layer step at
32 agents, kernels_notes v17). Here one program per (agent, KV head) copies the segment's older
rows from the ring, encodes the new rows (bit for bit `quantize_into`'s q8_0: `q8_0_rows`) and
writes them to the ring and to the segment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codecs import Packed
from .launch import launch as cached_launch
from .triton_codec import next_pow2, placeholder
from .triton_quantize import PAIR_MAX_ROWS, _quantize_tile, pair_args, q8_0_rows


@triton.jit
def _copy_rows(SRC, DST, src_row, dst_row, mask, COLS: tl.constexpr):
    """rows src_row [N] of SRC [*, COLS] to rows dst_row [N] of DST [*, COLS] where mask."""
    c = tl.arange(0, COLS)
    x = tl.load(SRC + src_row[:, None] * COLS + c[None, :], mask=mask[:, None])
    tl.store(DST + dst_row[:, None] * COLS + c[None, :], x, mask=mask[:, None])


@triton.jit
def _encode_rows(X, x_row, jmask, RC, RS, ring_row, SC, SS, seg_row, real, WC, WS, wide_row, wide_real,
                 D: tl.constexpr, WIDE: tl.constexpr):
    """rows x_row [NQP] of X (true space, last dim contiguous) as q8_0 to the ring rows ring_row
    (every column: padded ones go to the scratch row), to the segment rows seg_row where real and,
    WIDE, to the rows wide_row of the wide segment WC / WS where wide_real."""
    NB: tl.constexpr = D // 32
    d = tl.arange(0, D)
    jb = tl.arange(0, NB)
    q, d16 = q8_0_rows(tl.load(X + x_row[:, None] + d[None, :], mask=jmask[:, None], other=0.0)
                       .to(tl.float32))
    tl.store(RC + ring_row[:, None] * D + d[None, :], q, mask=jmask[:, None])
    tl.store(RS + ring_row[:, None] * NB + jb[None, :], d16, mask=jmask[:, None])
    tl.store(SC + seg_row[:, None] * D + d[None, :], q, mask=real[:, None])
    tl.store(SS + seg_row[:, None] * NB + jb[None, :], d16, mask=real[:, None])
    if WIDE:
        tl.store(WC + wide_row[:, None] * D + d[None, :], q, mask=wide_real[:, None])
        tl.store(WS + wide_row[:, None] * NB + jb[None, :], d16, mask=wide_real[:, None])


@triton.jit
def _ring_step_kernel(K, V, ROWS, SEG_ROWS, REAL, RKC, RKS, RVC, RVS, SKC, SKS, SVC, SVS,
                      skg, skh, skt, svg, svh, svt, HKV, RING_ROWS, NQ, W,
                      PPOS, PSCL, PKC, PKS, PVC, PVS, ROT_K, CENT_K, BOUNDS_K, ROT_V, CENT_V, BOUNDS_V,
                      pkcb, pkch, pkcs, pksb, pksh, pkss, pvcb, pvch, pvcs, pvsb, pvsh, pvss,
                      WPOS, WKC, WKS, WVC, WVS,
                      D: tl.constexpr, NQP: tl.constexpr, WP: tl.constexpr, PAGES: tl.constexpr = False,
                      PAGE_T: tl.constexpr = 16, KIND_K: tl.constexpr = 1, BITS_K: tl.constexpr = 8,
                      G_K: tl.constexpr = 32, HAS_S: tl.constexpr = False, SPLIT_K: tl.constexpr = False,
                      KIND_V: tl.constexpr = 1, BITS_V: tl.constexpr = 8, G_V: tl.constexpr = 32,
                      SPLIT_V: tl.constexpr = False, WRAPS: tl.constexpr = False, WIDE: tl.constexpr = False):
    # program (g, h): agent g's KV head h. Ring [HKV, RING_ROWS, *]; segment [G, HKV, W, *].
    # PAGES: the same rows also to the pages (`_quantize_tile` of quantize-on-write, positions PPOS).
    # WRAPS: the stores may hit ring rows the segment reads (a long feed): every thread's reads
    # first. Agent g's ring rows are its own, so no other program touches them.
    # WIDE: agent g's segment also to row WPOS[g] of the wide segment [J, HKV, W, *] where >= 0
    # (a split step's joining agents: written here, not gathered by four launches per layer).
    pid = tl.program_id(0)
    g = (pid // HKV).to(tl.int64)
    h = (pid % HKV).to(tl.int64)
    NB: tl.constexpr = D // 32
    ring0 = h * RING_ROWS
    seg0 = (g * HKV + h) * W
    # the segment's rows that are not new real columns: from the ring as it was before this step
    i = tl.arange(0, WP)
    j_of_i = i - (W - NQ)
    new_i = (j_of_i >= 0) & (i < W)
    real_i = tl.load(REAL + g * NQ + j_of_i, mask=new_i, other=0) != 0
    old = (i < W) & ~(new_i & real_i)
    src = ring0 + tl.load(SEG_ROWS + g * W + i, mask=i < W, other=0)
    _copy_rows(RKC, SKC, src, seg0 + i, old, D)
    _copy_rows(RKS, SKS, src, seg0 + i, old, NB)
    _copy_rows(RVC, SVC, src, seg0 + i, old, D)
    _copy_rows(RVS, SVS, src, seg0 + i, old, NB)
    wide0 = seg0  # never stored to unless WIDE
    is_wide = False
    if WIDE:
        wp = tl.load(WPOS + g).to(tl.int64)
        is_wide = wp >= 0
        wide0 = (tl.maximum(wp, 0) * HKV + h) * W
        _copy_rows(RKC, WKC, src, wide0 + i, old & is_wide, D)
        _copy_rows(RKS, WKS, src, wide0 + i, old & is_wide, NB)
        _copy_rows(RVC, WVC, src, wide0 + i, old & is_wide, D)
        _copy_rows(RVS, WVS, src, wide0 + i, old & is_wide, NB)
    if WRAPS:
        tl.debug_barrier()
    # the new columns: encoded once, stored to the ring (scratch row where not kept) and the segment
    j = tl.arange(0, NQP)
    jmask = j < NQ
    real = (tl.load(REAL + g * NQ + j, mask=jmask, other=0) != 0) & jmask
    ring_row = ring0 + tl.load(ROWS + g * NQ + j, mask=jmask, other=0)
    seg_row = seg0 + W - NQ + j
    wide_row = wide0 + W - NQ + j
    wide_real = real & is_wide
    _encode_rows(K, g * skg + h * skh + j * skt, jmask, RKC, RKS, ring_row, SKC, SKS, seg_row, real,
                 WKC, WKS, wide_row, wide_real, D, WIDE)
    _encode_rows(V, g * svg + h * svh + j * svt, jmask, RVC, RVS, ring_row, SVC, SVS, seg_row, real,
                 WVC, WVS, wide_row, wide_real, D, WIDE)
    if PAGES:
        _quantize_tile(K, PPOS, PSCL, PKC, PKS, ROT_K, CENT_K, BOUNDS_K, skg, skh, skt, pkcb, pkch, pkcs,
                       pksb, pksh, pkss, g, h, NQ, 0, D, PAGE_T, KIND_K, BITS_K, G_K, HAS_S, SPLIT_K)
        _quantize_tile(V, PPOS, PSCL, PVC, PVS, ROT_V, CENT_V, BOUNDS_V, svg, svh, svt, pvcb, pvch, pvcs,
                       pvsb, pvsh, pvss, g, h, NQ, 0, D, PAGE_T, KIND_V, BITS_V, G_V, False, SPLIT_V)


def ring_step_triton(ring_k: Packed, ring_v: Packed, k: torch.Tensor, v: torch.Tensor,
                     rows: torch.Tensor, seg_rows: torch.Tensor, real: torch.Tensor,
                     seg_k: Packed, seg_v: Packed, pages=None, wraps: bool = False,
                     wide: tuple | None = None) -> bool:
    """See `reference.ring_step_ref` (the same arguments and effects, bit for bit): ring_k / ring_v
    q8_0 Packed leading [Hkv, ring_rows] (contiguous); k, v [G, Hkv, n_q, D] (last dim contiguous);
    rows int64 [G, n_q]; seg_rows int64 [G, W]; real bool [G, n_q]; seg_k / seg_v q8_0 Packed leading
    [G, Hkv, W] (contiguous), written. pages (`dispatch.KVTarget`, codecs as Codec objects): k, v
    also written there in the same launch — bit for bit `quantize_kv_into` — where n_q <=
    PAIR_MAX_ROWS; returns whether pages (if any) were written. wraps: the stores may overwrite ring
    rows the segment reads (R - 1 + n_q > C, a prompt's feed): the segment is read first. wide:
    (pos int [G] contiguous, wide_k, wide_v q8_0 Packed leading [J, Hkv, W], contiguous): agent g's
    segment also to row pos[g] of wide_k / wide_v where pos[g] >= 0 (`dispatch.ring_step`)."""
    G, H, NQ, D = k.shape
    W = seg_rows.shape[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in the last dim")
    fused = pages is not None and NQ <= PAIR_MAX_ROWS
    dev = k.device
    if fused:
        head, strides, consts = pair_args(pages.k, pages.k_codec, pages.v, pages.v_codec, pages.positions,
                                          pages.innerq, k.dtype, v.dtype, dev)
        page_args, page_meta = (*head, *strides), dict(PAGES=True, PAGE_T=PAIR_MAX_ROWS, **consts)
    else:
        dummy = placeholder(dev)
        page_args, page_meta = (dummy,) * 12 + (0,) * 12, {}
    if wide is None:
        wide_args = (placeholder(dev),) * 5
    else:
        pos, wk, wv = wide
        wide_args = (pos, wk.codes, wk.scales, wv.codes, wv.scales)
    if G * H:
        cached_launch(_ring_step_kernel, (G * H,), k, v, rows.contiguous(), seg_rows.contiguous(),
                      real.contiguous(), ring_k.codes, ring_k.scales, ring_v.codes, ring_v.scales,
                      seg_k.codes, seg_k.scales, seg_v.codes, seg_v.scales, k.stride(0), k.stride(1),
                      k.stride(2), v.stride(0), v.stride(1), v.stride(2), H, ring_k.codes.shape[1],
                      NQ, W, *page_args, *wide_args, D=D, NQP=next_pow2(NQ), WP=next_pow2(W), **page_meta,
                      WRAPS=bool(wraps), WIDE=wide is not None,
                      enable_fp_fusion=False)  # quantize-on-write's exact q8_0 / turbo arithmetic
    return fused or pages is None


@triton.jit
def _ring_index_kernel(SLOTS, LENS, PAGE_ROWS, REAL, GATHER, ROWS, KV_START, OLDER, slot0, C, SCRATCH,
                       PAGE_SCRATCH, R: tl.constexpr, NQ: tl.constexpr, W: tl.constexpr,
                       NQP: tl.constexpr, WP: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """One agent per program: `reference.ring_indices_ref` for row g (positions are floored mod C,
    as torch's %: a segment may start before the agent's first row). HAS_SLOTS False: agent g is
    in slot slot0 + g (SLOTS unread)."""
    g = tl.program_id(0)
    L = tl.load(LENS + g).to(tl.int64)
    if HAS_SLOTS:
        base = tl.load(SLOTS + g).to(tl.int64) * C
    else:
        base = (slot0 + g).to(tl.int64) * C
    i = tl.arange(0, WP)
    pos = (L - W + i) % C
    tl.store(GATHER + g * W + i, base + tl.where(pos < 0, pos + C, pos), mask=i < W)
    j = tl.arange(0, NQP)
    jm = j < NQ
    real = tl.load(PAGE_ROWS + g * NQ + j, mask=jm, other=PAGE_SCRATCH) != PAGE_SCRATCH
    tl.store(REAL + g * NQ + j, real, mask=jm)
    keep = real & (j >= NQ - C)  # among the newest C
    posj = (L - NQ + j) % C
    row = tl.where(keep, base + tl.where(posj < 0, posj + C, posj), SCRATCH)
    tl.store(ROWS + g * NQ + j, row, mask=jm)
    tl.store(KV_START + g, tl.minimum(tl.maximum(W - L, 0), W).to(tl.int32))
    tl.store(OLDER + g, tl.maximum(L - R, 0).to(tl.int32))


def ring_indices_triton(slots, lens: torch.Tensor, page_rows: torch.Tensor, page_scratch: int, R: int,
                        C: int, scratch_row: int) -> tuple[torch.Tensor, ...]:
    """See `reference.ring_indices_ref` (the same outputs, exactly): one launch where the torch
    ops take about thirteen kernels of a captured step. slots: a slice or integer [G]; lens integer
    [G]; page_rows int64 [G, n_q] contiguous; all on one device."""
    G, NQ = page_rows.shape
    W = R - 1 + NQ
    dev = page_rows.device
    gather = torch.empty(G, W, dtype=torch.int64, device=dev)
    rows = torch.empty(G, NQ, dtype=torch.int64, device=dev)
    real = torch.empty(G, NQ, dtype=torch.bool, device=dev)
    kv_start, older = (torch.empty(G, dtype=torch.int32, device=dev) for _ in range(2))
    if G:
        ranged = isinstance(slots, slice)
        cached_launch(_ring_index_kernel, (G,), page_rows if ranged else slots, lens, page_rows, real, gather,
                      rows, kv_start, older, (slots.start or 0) if ranged else 0, int(C), int(scratch_row),
                      int(page_scratch), R=int(R), NQ=NQ, W=W, NQP=next_pow2(NQ), WP=next_pow2(W),
                      HAS_SLOTS=not ranged, num_warps=1)
    return gather, rows, kv_start, real, older
