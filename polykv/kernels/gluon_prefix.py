"""Warp-specialised prefix pass of the cascade (Hopper, Gluon): the FA3 structure over compressed K/V.

The tile kernel (triton_decode._decode_kernel) runs one serial chain per warp — load codes, decode,
store the tile to shared memory, wgmma, wait, softmax, decode V, wgmma, wait — and the H200 profile
(docs/kernels_notes.md v9/v10) shows the tensor pipe busy ~16 % of the time. Here the two halves run
in different warps of one CTA, connected by mbarriers over a ring of NBUF shared-memory stages:

* producer (the default partition: one warp group): loads tile i + 1's code words while it decodes
  tile i in registers (PTX byte-permute lookups, triton_codec.asm_strings via `unpacked`), applies
  the per-row factors (q8_0 block scales to K, the turbo norms to V), stores fp16 [BLOCK_N, D] K
  and V tiles into stage i % NBUF and signals `ready`; it waits on `empty` before reusing a stage.
* consumers (a worker partition of BLOCK_M // 16 warps: one warp group per 64 query rows):
  S = q K^T and O += P V on the tensor cores (wgmma, B operands from shared memory), the online
  softmax in registers (q pre-scaled, so scores come out in log2 units), S of tile i + 1 issued
  before P V of tile i (FA3's intra-warp-group overlap), then the stage is released. With 128-row
  tiles the two consumer warp groups are two partitions that take turns issuing their wgmmas
  (FA3's ping-pong, `turns` barriers): one group's softmax runs under the other's products.

Every query row of a KV head sits in one CTA (all agents x GQA heads, up to 128 rows), so each
compressed tile is decoded once per step for all of them — the tile kernel decoded it once per
64-row tile. Contract: as the tile kernel for the cascade prefix pass — one sequence (the shared
prefix, leading dim 1), not causal, no window, no page table, no left padding; K q8_0, V turbo3 with
one rotation group per row (group == head_dim), head_dim 128. Output in V's storage domain, split
partials in the tile kernel's layout (combined by triton_decode.combine_splits).

Gluon kernels do not run in Triton's interpreter: tests build this kernel offline for sm_90 on the
CPU (tests/kernels/test_gluon_prefix.py) and the GPU suite checks it against kernels/reference.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .launch import launch as cached_launch


# registers per consumer thread (setmaxnreg) for 128- / 64-row tiles; the producer warp group gets
# the rest of the CTA's maxnreg share (H200, kernels_notes v16: 200 / 152 spilled the producer once
# its addressing kept per-tile offsets in registers; 192 / 144 do not, and the consumers' loop
# is the same 301 instructions at 144)
CONSUMER_REGS = {128: 192, 64: 144}


@functools.lru_cache(maxsize=None)
def unpacked(asm: str) -> str:
    """A triton_codec PTX lookup (inputs $2, $3: 4 packed bytes each; outputs $0, $1: two fp16
    pairs) rewritten for one 32-bit word per element: inputs $4, $5, outputs $0..$3 one fp16
    each (byte j of the word -> $j). Fed words, not bytes, so that tiles carried across loop
    iterations stay 4 bytes per register (an int8 tensor is one register per byte)."""
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}")
    body = body[1:-1]
    for old, new in (("$2", "$4"), ("$3", "$5"), ("$0", "o0t"), ("$1", "o1t")):
        body = body.replace(old, new)
    return ("{ .reg .b32 o0t, o1t; " + body +
            " mov.b32 {$0, $1}, o0t; mov.b32 {$2, $3}, o1t; }")


@gluon.jit
def _asm_words(a, b, f, ASM: gl.constexpr):
    """int32 words [..] -> fp16 [.., 2, 2], byte j of each word at [.., j // 2, j % 2] (join
    appends its new dim last: the outer join takes bytes (0, 2) and (1, 3)), times the factor f
    (broadcast over a's shape, same layout), by an `unpacked` lookup (b: the second input word —
    the high-bit plane for turbo3; a again otherwise)."""
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        ASM, "=h,=h,=h,=h,r,r", [a, b], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=1)
    return gl.join(gl.join(o0 * f, o2 * f), gl.join(o1 * f, o3 * f))


@gluon.jit
def _k_addr(KW, KS, kbase, ksbase, n0, end, sks, skss, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """Addresses of q8_0 K rows [n0, n0 + BLOCK_N): (codes as int32 words [BLOCK_N, D / 32, 8],
    their block scales fp16 [BLOCK_N, D / 32, 1], the row mask rows < end [BLOCK_N, 1, 1]);
    KW, kbase, sks in words."""
    L: gl.constexpr = gl.BlockedLayout([1, 1, 4], [4, 4, 2], [4, 1, 1], [2, 1, 0])
    NB: gl.constexpr = D // 32
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    r3 = gl.expand_dims(gl.expand_dims(r, 1), 2)  # [BN, 1, 1] rows within the tile
    blk = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    b3 = gl.expand_dims(gl.expand_dims(blk, 0), 2)  # [1, NB, 1]
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    c3 = gl.expand_dims(gl.expand_dims(c, 0), 1)  # [1, 1, 8]
    # the tile's first row as one scalar offset, the rest int32 offsets that do not depend on the
    # tile (computed once, outside the loop): no 64-bit multiply per element per tile
    row0 = n0.to(gl.int64)
    return (KW + (kbase + row0 * sks) + (r3 * sks + b3 * 8 + c3),
            KS + (ksbase + row0 * skss) + (r3 * skss + b3), r3 < end - n0)


@gluon.jit
def _k_load(KW, KS, kbase, ksbase, n0, end, sks, skss, BLOCK_N: gl.constexpr, D: gl.constexpr,
            EVEN: gl.constexpr):
    """q8_0 K rows [n0, n0 + BLOCK_N) as stored: (codes as int32 words [BLOCK_N, D / 32, 8],
    block scales fp16 [BLOCK_N, D / 32, 1]); rows >= end read nothing (zeros) — EVEN: the caller
    never asks past end, no mask."""
    codes, scales, rmask = _k_addr(KW, KS, kbase, ksbase, n0, end, sks, skss, BLOCK_N, D)
    if EVEN:
        return gl.load(codes), gl.load(scales)
    return gl.load(codes, mask=rmask, other=0), gl.load(scales, mask=rmask, other=0.0)


@gluon.jit
def _k_decode(q, sc, BLOCK_N: gl.constexpr, D: gl.constexpr, KA: gl.constexpr):
    """fp16 [BLOCK_N, D] K tile: the int8 codes times their block scales."""
    return gl.reshape(_asm_words(q, q, sc, KA), [BLOCK_N, D])


@gluon.jit
def _v_addr(VW, VS, vbase, vsbase, n0, end, svs, svss, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """Addresses of turbo3 V rows [n0, n0 + BLOCK_N) (planar layout: low-bit planes lo0, lo1 and
    the high-bit plane, D / 8 bytes each): (the lo0 plane as int32 words [BLOCK_N, D / 32] — lo1
    and hi follow at + D / 32 and + D / 16 words —, norms fp16 [BLOCK_N], row mask [BLOCK_N]);
    VW, vbase, svs in words."""
    W: gl.constexpr = D // 32
    L: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    w = gl.arange(0, W, layout=gl.SliceLayout(0, L))
    row0 = n0.to(gl.int64)  # as _k_addr: one scalar per tile, tile-independent int32 offsets
    codes = VW + (vbase + row0 * svs) + (gl.expand_dims(r * svs, 1) + gl.expand_dims(w, 0))
    return codes, VS + (vsbase + row0 * svss) + r * svss, r < end - n0


@gluon.jit
def _v_load(VW, VS, vbase, vsbase, n0, end, svs, svss, BLOCK_N: gl.constexpr, D: gl.constexpr,
            EVEN: gl.constexpr):
    """turbo3 V rows [n0, n0 + BLOCK_N) as stored: (lo0, lo1, hi int32 words [BLOCK_N, D / 32],
    norms fp16 [BLOCK_N, 1]); rows >= end read nothing (EVEN: never asked, no mask)."""
    W: gl.constexpr = D // 32
    codes, norms, rows = _v_addr(VW, VS, vbase, vsbase, n0, end, svs, svss, BLOCK_N, D)
    if EVEN:
        return (gl.load(codes), gl.load(codes + W), gl.load(codes + 2 * W),
                gl.expand_dims(gl.load(norms), 1))
    rmask = gl.expand_dims(rows, 1)
    return (gl.load(codes, mask=rmask, other=0), gl.load(codes + W, mask=rmask, other=0),
            gl.load(codes + 2 * W, mask=rmask, other=0),
            gl.expand_dims(gl.load(norms, mask=rows, other=0.0), 1))


@gluon.jit
def _v_phase(lo, hi, nrm, BLOCK_N: gl.constexpr, W: gl.constexpr, ASM: gl.constexpr):
    """fp16 [BLOCK_N, 4 * W] values of one planar phase, times the row norms."""
    return gl.reshape(_asm_words(lo, hi, nrm, ASM), [BLOCK_N, 4 * W])


@gluon.jit
def _v_decode(la, lb, hi, nrm, BLOCK_N: gl.constexpr, D: gl.constexpr,
              VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr, VA3: gl.constexpr,
              VA4: gl.constexpr, VA5: gl.constexpr, VA6: gl.constexpr, VA7: gl.constexpr):
    """fp16 [BLOCK_N, D] V tile: centroids times the row norms, columns in
    triton_codec.perm_cols order (the phase join tree of load_tile)."""
    W: gl.constexpr = D // 32
    v0 = _v_phase(la, hi, nrm, BLOCK_N, W, VA0)
    v1 = _v_phase(lb, hi, nrm, BLOCK_N, W, VA1)
    v2 = _v_phase(la, hi, nrm, BLOCK_N, W, VA2)
    v3 = _v_phase(lb, hi, nrm, BLOCK_N, W, VA3)
    v4 = _v_phase(la, hi, nrm, BLOCK_N, W, VA4)
    v5 = _v_phase(lb, hi, nrm, BLOCK_N, W, VA5)
    v6 = _v_phase(la, hi, nrm, BLOCK_N, W, VA6)
    v7 = _v_phase(lb, hi, nrm, BLOCK_N, W, VA7)
    v = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
    return gl.reshape(v, [BLOCK_N, D])


@gluon.jit
def _producer(KW, KS, VW, VS, k_bufs, v_bufs, ready, empty, kbase, ksbase, vbase, vsbase, start,
              end, sks, skss, svs, svss, BLOCK_N: gl.constexpr, D: gl.constexpr,
              NBUF: gl.constexpr, KA: gl.constexpr, VA0: gl.constexpr, VA1: gl.constexpr,
              VA2: gl.constexpr, VA3: gl.constexpr, VA4: gl.constexpr, VA5: gl.constexpr,
              VA6: gl.constexpr, VA7: gl.constexpr, PREFETCH: gl.constexpr, EVEN: gl.constexpr):
    """Decodes every key tile of the split into the stage ring. PREFETCH: tile i + 1's bytes are
    loaded into registers before tile i is decoded (one tile of global-load latency hidden behind
    the decode; a tile past `end` loads nothing — EVEN: the last tile is loaded again instead,
    so no load needs a mask)."""
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    last = gl.maximum(end - BLOCK_N, start)
    kq, ks = _k_load(KW, KS, kbase, ksbase, start, end, sks, skss, BLOCK_N, D, EVEN)
    la, lb, hi, nrm = _v_load(VW, VS, vbase, vsbase, start, end, svs, svss, BLOCK_N, D, EVEN)
    for i in range(n_tiles):
        stage = i % NBUF
        n0 = start + i * BLOCK_N
        if PREFETCH:
            n1 = gl.minimum(n0 + BLOCK_N, last) if EVEN else n0 + BLOCK_N
            kq1, ks1 = _k_load(KW, KS, kbase, ksbase, n1, end, sks, skss, BLOCK_N, D, EVEN)
            la1, lb1, hi1, nrm1 = _v_load(VW, VS, vbase, vsbase, n1, end, svs, svss,
                                          BLOCK_N, D, EVEN)
        elif i > 0:
            kq, ks = _k_load(KW, KS, kbase, ksbase, n0, end, sks, skss, BLOCK_N, D, EVEN)
            la, lb, hi, nrm = _v_load(VW, VS, vbase, vsbase, n0, end, svs, svss, BLOCK_N, D, EVEN)
        # a stage's barriers start in phase 0: the first wait on `empty` (parity 1) passes at
        # once; decoding after the wait keeps fewer registers live across it
        mbarrier.wait(empty.index(stage), ((i // NBUF) & 1) ^ 1)
        k_bufs.index(stage).store(_k_decode(kq, ks, BLOCK_N, D, KA))
        v_bufs.index(stage).store(
            _v_decode(la, lb, hi, nrm, BLOCK_N, D, VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7))
        if PREFETCH:
            kq, ks, la, lb, hi, nrm = kq1, ks1, la1, lb1, hi1, nrm1
        # the generic-proxy stores must be visible to the consumers' wgmma (async proxy), from
        # every producer thread, before the single arrival
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def _softmax_step(s, m_i, l_i, cols, n0, end, valid, row_o: gl.constexpr, p_layout: gl.constexpr,
                  EVEN: gl.constexpr):
    """Online softmax over one score tile s [BLOCK_M, BLOCK_N] (log2 units: q was pre-scaled),
    keys n0 + cols, those >= end absent (EVEN: every tile is whole, no mask). valid False (a
    scalar): the tile does not count — m_i and l_i come back unchanged. Returns (P fp16 as the
    PV wgmma's A operand, alpha [BLOCK_M] in the accumulator's row layout, m_i, l_i).
    (FA4's lazy rescale — the accumulator rescaled only when a row's max grows by > 8 — was
    measured here and lost: the CTA-wide decision costs a barrier per tile, H200 +0-2 %.)"""
    if not EVEN:
        s = gl.where(gl.expand_dims(n0 + cols < end, 0), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep everything at 0
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    l_new = l_i * alpha + gl.sum(p, 1)
    return (gl.convert_layout(p.to(gl.float16), p_layout), gl.convert_layout(alpha, row_o),
            gl.where(valid, m_new, m_i), gl.where(valid, l_new, l_i))


@gluon.jit
def _consumer(O_PART, L_PART, q_smem, k_bufs, v_bufs, ready, empty, turns, q_row0, n_rows, start,
              end, N_SPLITS, split, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, NBUF: gl.constexpr, NW: gl.constexpr, PIPE: gl.constexpr,
              EVEN: gl.constexpr, WG: gl.constexpr):
    """The consumer warps of the query rows [q_row0, q_row0 + BLOCK_M). WG: -1 — every consumer
    warp group in this partition; 0 / 1 — one of two partitions of one warp group each, which
    take turns issuing their wgmmas (FA3's ping-pong: the `turns` barriers), so one group's
    softmax runs while the other's matrix multiplies hold the tensor cores."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    if PIPE:
        # FA3's intra-warpgroup overlap: S of tile i + 1 is issued before P V of tile i, and the
        # softmax of tile i + 1 runs while P V of tile i is on the tensor cores. The wait for P V
        # lists the softmax's results as dependencies, or ptxas sinks the exponentials below it.
        # The last iteration issues a dummy S (tile i again, valid=False: no effect) instead of
        # a branch.
        mbarrier.wait(ready.index(0), 0, pred=n_tiles > 0)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, cols, start, end, n_tiles > 0, row_o,
                                           p_layout, EVEN)
        for i in range(n_tiles):
            j = gl.minimum(i + 1, n_tiles - 1)
            mbarrier.wait(ready.index(j % NBUF), (j // NBUF) & 1)
            kb = k_bufs.index(j % NBUF)
            vb = v_bufs.index(i % NBUF)
            if WG >= 0:  # my turn: the other group issued its pair last (first turn: group 0)
                mbarrier.wait(turns.index(WG), (i & 1) ^ (1 - WG))
            s = warpgroup_mma(q_smem, kb.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, vb, acc * gl.expand_dims(alpha, 1), is_async=True)
            if WG >= 0:
                mbarrier.arrive(turns.index(1 - WG), count=1)
            s, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s, kb))  # in order: S done
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, cols, start + j * BLOCK_N, end,
                                               i + 1 < n_tiles, row_o, p_layout, EVEN)
            acc, _, p, alpha, m_i, l_i = warpgroup_mma_wait(
                num_outstanding=0, deps=(acc, vb, p, alpha, m_i, l_i))
            gl.thread_barrier()  # both warp groups are done with the stage before the arrival
            mbarrier.arrive(empty.index(i % NBUF), count=1)
    else:
        for i in range(n_tiles):
            stage = i % NBUF
            mbarrier.wait(ready.index(stage), (i // NBUF) & 1)
            kb = k_bufs.index(stage)
            vb = v_bufs.index(stage)
            s = warpgroup_mma(q_smem, kb.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_smem, kb))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, cols, start + i * BLOCK_N, end,
                                               i < n_tiles, row_o, p_layout, EVEN)
            acc = warpgroup_mma(p, vb, acc * gl.expand_dims(alpha, 1), is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, vb))
            gl.thread_barrier()  # both warp groups are done with the stage before the arrival
            mbarrier.arrive(empty.index(stage), count=1)

    # epilogue: the split's LSE (natural log) and normalised partial output
    has = l_i > 0
    l_safe = gl.where(has, l_i, 1.0)
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    rows_s = gl.arange(0, BLOCK_M, layout=row_s)
    prow_s = (q_row0 + rows_s).to(gl.int64) * N_SPLITS + split
    gl.store(L_PART + prow_s, lse, mask=rows_s < n_rows)
    inv = gl.convert_layout(gl.where(has, 1.0 / l_safe, 0.0), row_o)
    rows = gl.arange(0, BLOCK_M, layout=row_o)
    c = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    # column c of the V tile holds dim perm(c) (triton_codec.perm_cols, 8 phases)
    lo = c % 8
    dim = (((lo & 1) << 2) | (lo & 2) | (lo >> 2)) * (D // 8) + c // 8
    prow = (q_row0 + rows).to(gl.int64) * N_SPLITS + split
    ptr = O_PART + gl.expand_dims(prow * D, 1) + gl.expand_dims(dim, 0)
    gl.store(ptr, acc * gl.expand_dims(inv, 1), mask=gl.expand_dims(rows < n_rows, 1))


@gluon.jit
def _ws_prefix_kernel(Q, KC, KS, VC, VS, KV_LENS, O_PART, L_PART,
                      skh, sks, sksh, skss, svh, svs, svsh, svss, sqn, sqh, sqm, M_AGENT,
                      M_TOTAL, SPLIT_LEN, N_SPLITS, SPLIT0, qk_scale,
                      D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NBUF: gl.constexpr, KA: gl.constexpr,
                      VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr, VA3: gl.constexpr,
                      VA4: gl.constexpr, VA5: gl.constexpr, VA6: gl.constexpr, VA7: gl.constexpr,
                      CREG: gl.constexpr, PREFETCH: gl.constexpr, PIPE: gl.constexpr,
                      EVEN: gl.constexpr, PING: gl.constexpr):
    """Grid (Hkv, splits of this chunk, row tiles). Q [N, Hkv, M_AGENT, D] (any float dtype, K's
    domain; element strides sqn, sqh, sqm, last dim contiguous): KV head h's rows of all agents
    are its M_TOTAL = N * M_AGENT query rows, row n * M_AGENT + m; KC/KS q8_0 codes / scales and VC/VS turbo3 codes / norms of one chunk
    (leading dim 1); KV_LENS int32 [1] the chunk's rows; split j of the launch is global split
    SPLIT0 + j of O_PART float32 [Hkv * M_TOTAL, N_SPLITS, D] / L_PART [Hkv * M_TOTAL, N_SPLITS]."""
    NW: gl.constexpr = gl.num_warps()  # the producer warp group
    h = gl.program_id(0)
    pid_s = gl.program_id(1)
    q_row0 = h * M_TOTAL + gl.program_id(2) * BLOCK_M
    kv_len = gl.load(KV_LENS)
    start = pid_s * SPLIT_LEN
    end = gl.minimum(start + SPLIT_LEN, kv_len)

    # q tile -> shared memory (the wgmma A operand), rows past M_TOTAL are zeros
    QL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    qr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    local = gl.program_id(2) * BLOCK_M + qr
    # q pre-scaled by sm_scale * log2(e): the scores come out of the wgmma in log2 units
    q_off = ((local // M_AGENT).to(gl.int64) * sqn + h.to(gl.int64) * sqh
             + (local % M_AGENT).to(gl.int64) * sqm)
    q = gl.load(Q + gl.expand_dims(q_off, 1) + gl.expand_dims(qc, 0),
                mask=gl.expand_dims(local < M_TOTAL, 1), other=0.0)
    q = (q.to(gl.float32) * qk_scale).to(gl.float16)
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_M, D], tile, q)
    k_bufs = gl.allocate_shared_memory(gl.float16, [NBUF, BLOCK_N, D],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                            element_bitwidth=16, rank=2))
    v_bufs = gl.allocate_shared_memory(gl.float16, [NBUF, BLOCK_N, D],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                            element_bitwidth=16, rank=2))
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 if PING else 1)  # PING: each group releases
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()  # q and the barriers, written by every warp, before any partition reads them

    # codes are read as int32 words (strides skh, sks, svh, svs in words: the host checked)
    KW = KC.to(gl.pointer_type(gl.int32))
    VW = VC.to(gl.pointer_type(gl.int32))
    kbase = h.to(gl.int64) * skh
    ksbase = h.to(gl.int64) * sksh
    vbase = h.to(gl.int64) * svh
    vsbase = h.to(gl.int64) * svsh
    # the producer is the default partition (the kernel's num_warps = one warp group), the
    # consumers a worker partition of BLOCK_M // 16 warps: Triton 3.6 gives called functions a
    # warp count only inside worker partitions, and the consumers' row reductions need one
    n_rows = M_TOTAL - gl.program_id(2) * BLOCK_M
    # (the producer's entry is written out in both lists: a Gluon kernel cannot hold a function,
    # or a tuple holding constexprs, in a variable)
    if PING:  # two consumer partitions of 64 rows taking turns on the tensor cores
        gl.warp_specialize([(_producer, (
            KW, KS, VW, VS, k_bufs, v_bufs, ready, empty, kbase, ksbase, vbase, vsbase, start, end,
            sks, skss, svs, svss, BLOCK_N, D, NBUF, KA, VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7,
            PREFETCH, EVEN)), (_consumer, (
            O_PART, L_PART, q_smem.slice(0, 64), k_bufs, v_bufs, ready, empty, turns, q_row0,
            n_rows, start, end, N_SPLITS, SPLIT0 + pid_s, 64, BLOCK_N, D, NBUF, 4, PIPE, EVEN, 0)),
            (_consumer, (
            O_PART, L_PART, q_smem.slice(64, 64), k_bufs, v_bufs, ready, empty, turns,
            q_row0 + 64, n_rows - 64, start, end, N_SPLITS, SPLIT0 + pid_s, 64, BLOCK_N, D, NBUF,
            4, PIPE, EVEN, 1))], [4, 4], [CREG, CREG])
    else:
        gl.warp_specialize([(_producer, (
            KW, KS, VW, VS, k_bufs, v_bufs, ready, empty, kbase, ksbase, vbase, vsbase, start, end,
            sks, skss, svs, svss, BLOCK_N, D, NBUF, KA, VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7,
            PREFETCH, EVEN)), (_consumer, (
            O_PART, L_PART, q_smem, k_bufs, v_bufs, ready, empty, turns, q_row0, n_rows, start,
            end, N_SPLITS, SPLIT0 + pid_s, BLOCK_M, BLOCK_N, D, NBUF, BLOCK_M // 16, PIPE, EVEN,
            -1))], [BLOCK_M // 16], [CREG])


def ws_ok(qp: torch.Tensor, k_codec, v_codec) -> bool:
    """Whether the warp-specialised prefix pass applies to the query rows qp [N, Hkv, M, D] of N
    agents: a Hopper GPU (sm_90), head_dim 128, K q8_0, V turbo3 with one rotation group per row,
    and more query rows per KV head (N * M) than the decode-sized phase kernel takes."""
    from ..codecs.blockq import Q8_0
    from ..codecs.turbo import TurboCodec
    from .triton_decode import PHASE_MAX_ROWS, _interpreting

    N, _, M, D = qp.shape
    return (qp.is_cuda and not _interpreting() and torch.cuda.get_device_capability(qp.device) == (9, 0)
            and D == 128 and N * M > PHASE_MAX_ROWS and qp.stride(-1) == 1
            and isinstance(k_codec, Q8_0) and k_codec.head_dim == D
            and isinstance(v_codec, TurboCodec) and v_codec.bits == 3 and v_codec.group == D)


def ws_prefix(qp: torch.Tensor, chunks, total_rows: int, k_codec, v_codec, *,
              out_dtype: torch.dtype | None = None, **kw):
    """`ws_prefix_parts` and its combine: (out float32 [1, Hkv, M, D] in V's storage domain —
    true space in out_dtype when given —, lse float32 [1, Hkv, M])."""
    from .triton_decode import combine_splits

    parts = ws_prefix_parts(qp, chunks, total_rows, k_codec, v_codec, **kw)
    return combine_splits(parts, tuple(qp.shape), v_codec, out_dtype)


def ws_prefix_parts(qp: torch.Tensor, chunks, total_rows: int, k_codec, v_codec, *, sm_scale: float,
                    max_split: int = 0, block_m: int = 0, block_n: int = 64, stages: int = 3,
                    consumer_regs: int = 0, maxnreg: int = 0, prefetch: bool = True,
                    pipe: bool = True, ping: bool = True, target_programs: int | None = None,
                    rec: list | None = None):
    """The cascade prefix pass on the warp-specialised kernel (check `ws_ok` first).
    qp [N, Hkv, M, D] in K's domain (N agents' query rows; any float dtype and strides, last dim
    contiguous), read in place: the partials' rows are [Hkv, N * M] (all agents of a KV head side
    by side, `combine_splits(..., heads_major=True)`); chunks: iterable of (k, v,
    kv_lens int32 [1], row0) as triton_decode.decode_prepared's, total_rows their rows in all
    (each row0 a multiple of the split length: the splits are planned over all rows, powers of two
    <= max_split when given). Returns the splits' partial results (`triton_decode.SplitParts`,
    rows [1, Hkv, M], V's storage domain). The rest tunes the launch (0 /
    None: the H200 defaults, docs/kernels_notes.md v11): row tile (64 up to 64 rows, else 128),
    key tile, stages, registers per consumer thread / per thread of the CTA, the producer's
    register prefetch, the consumers' S / PV overlap, their ping-pong (128-row tiles), programs. rec: the pass's plan (`WsPlan`;
    None for a chunked prefix, or where launches are not planned) is appended to it."""
    from .triton_codec import asm_strings, cdiv
    from .triton_decode import SplitParts, _strides, num_programs_target, plan_split_len

    N, Hkv, MG, D = qp.shape
    M = N * MG  # query rows per KV head
    dev = qp.device
    block_m = block_m or (64 if M <= 64 else 128)
    n_mt = cdiv(M, block_m)
    # H200 sweep (v11): 128-row tiles — 12 warps at 168 registers, one CTA per SM; 64-row tiles
    # (up to 16 agents) — 8 warps at 128 registers, two CTAs per SM (100 vs 126 us at 8 agents)
    two = block_m == 64
    maxnreg = maxnreg or (128 if two else 168)
    consumer_regs = consumer_regs or CONSUMER_REGS.get(block_m, CONSUMER_REGS[128])
    target = target_programs or num_programs_target(dev) // (2 if two else 4)
    split_len = plan_split_len(total_rows, Hkv * n_mt, target, block_n, max_split)
    n_splits = max(1, cdiv(total_rows, split_len))
    o_part = torch.empty(Hkv * M * n_splits * D, dtype=torch.float32, device=dev)
    l_part = torch.empty(Hkv * M * n_splits, dtype=torch.float32, device=dev)
    ka, va = unpacked(asm_strings(k_codec)[0]), [unpacked(a) for a in asm_strings(v_codec)]
    if qp.stride(-1) != 1:
        raise ValueError("the query rows' last dim must be contiguous")
    plan, n_launch, planned = rec is not None, 0, None
    for kp, vp, lens, row0 in chunks:
        n_launch += 1
        if row0 % split_len:
            raise ValueError(f"a chunk starts at row {row0}, inside a split of {split_len} keys: "
                             "chunk rows must be a multiple of the split length")
        kc, ks, kcs, kss = _strides(kp, False)
        vc, vs, vcs, vss = _strides(vp, False)
        if any(x % 4 for x in (*kcs[1:], *vcs[1:], kc.data_ptr(), vc.data_ptr())):
            raise ValueError("the warp-specialised prefix pass reads codes as 4-byte words: "
                             "their strides and base must be multiples of 4 bytes")
        rows = kp.codes.shape[2]
        planned = cached_launch(
            _ws_prefix_kernel, (Hkv, max(1, cdiv(rows, split_len)), n_mt), qp, kc, ks, vc, vs, lens, o_part, l_part,
            kcs[1] // 4, kcs[2] // 4, kss[1], kss[2], vcs[1] // 4, vcs[2] // 4, vss[1], vss[2],
            qp.stride(0), qp.stride(1), qp.stride(2), MG,
            M, split_len, n_splits, row0 // split_len, sm_scale * 1.4426950408889634,
            D=D, BLOCK_M=block_m, BLOCK_N=block_n, NBUF=stages, KA=ka,
            VA0=va[0], VA1=va[1], VA2=va[2], VA3=va[3], VA4=va[4], VA5=va[5], VA6=va[6],
            VA7=va[7], CREG=consumer_regs, PREFETCH=bool(prefetch), PIPE=pipe,
            EVEN=rows % block_n == 0, PING=bool(ping) and block_m == 128, num_warps=4,
            maxnreg=maxnreg, plan=8 if plan else 0)
    if rec is not None:  # one launch (an unchunked prefix) is a plan of the whole pass
        rec.append(WsPlan(planned, o_part.numel(), l_part.numel(), n_splits)
                   if planned is not None and n_launch == 1 else None)
    return SplitParts(o_part, l_part, n_splits)


class WsPlan(NamedTuple):
    """A planned prefix pass: launch(qp, k codes, k scales, v codes, v norms, kv_lens, o_part,
    l_part) and the sizes of its partials."""

    launch: object  # launch.Planned
    o_numel: int
    l_numel: int
    n_splits: int
