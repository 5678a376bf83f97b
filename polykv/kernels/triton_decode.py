"""Fused split-KV decode attention over packed K/V (flash-decoding), any K type x V type.

One program = one (sequence, KV head, key split, row tile). Its rows are all q heads of the KV
head's GQA group times all n_q queries (row r = head_in_group * n_q + j), so each K/V tile is read
from memory once per step for the whole group. K/V bytes are decoded in registers (triton_codec
sub-column layout) and fed to tl.dot; q arrives already rotated (and divided by the InnerQ scale)
when K is turbo, and the output leaves in V's storage domain (the caller unrotates once).

Stage 2 (`_combine_kernel`) merges the splits by log-sum-exp.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..codecs import Packed
from ..codecs.rotation import rotation_matrix
from . import launch as launch_mod
from .launch import launch as cached_launch
from .triton_codec import (_codec_key, asm_ok, asm_strings, cdiv, codec_meta, load_tile, next_pow2,
                           perm_cols, phase_meta, phase_ok, phase_tile, placeholder)

try:  # griddepcontrol (programmatic dependent launch), sm_90+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL never enabled (pdl_ok)
    gdc_launch_dependents = gdc_wait = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _load_q(Q, q_off, rmask, g: tl.constexpr, GW: tl.constexpr, NPH: tl.constexpr,
            D: tl.constexpr):
    """Columns of group g (in the K tiles' order) of the query rows starting at elements q_off."""
    cols = g * GW + perm_cols(GW, NPH)
    ptr = Q + q_off[:, None] + cols[None, :]
    return tl.load(ptr, mask=rmask[:, None], other=0.0).to(tl.float16)


@triton.jit
def _store_o(O, o_off, rmask, acc, g: tl.constexpr, GW: tl.constexpr, NPH: tl.constexpr):
    cols = g * GW + perm_cols(GW, NPH)
    tl.store(O + o_off[:, None] + cols[None, :], acc, mask=rmask[:, None])


@triton.jit
def _norm(SCALES, srow_off, srow0, nvalid, nmask, g: tl.constexpr, PAIRS: tl.constexpr):
    """float32 [BN] turbo norms of the tile's rows (group g); srow_off int64 [BN] their offsets,
    srow0 the first one, nvalid how many rows are keys (the first ones: nmask). PAIRS (the host checked: one norm per row, stride 1, even offsets, even
    capacity): read as int32 pairs of fp16 — a 4-byte load Triton pipelines through cp.async,
    where a 2-byte load of one norm per row stays a synchronous load in the loop (ncu v9: the
    prefix pass's top stall)."""
    if PAIRS:
        BN: tl.constexpr = nmask.shape[0]
        i2 = tl.arange(0, BN // 2)
        w = tl.load(SCALES.to(tl.pointer_type(tl.int32)) + srow0 // 2 + i2,
                    mask=2 * i2 < nvalid, other=0)
        lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        n = tl.where(nmask, tl.reshape(tl.join(lo, hi), [BN]).to(tl.float32), 0.0)
    else:
        n = tl.load(SCALES + srow_off + g, mask=nmask, other=0.0).to(tl.float32)
    return n


@triton.jit
def _kdot(q, KC, KS, KCENT, k_off, ks_off, ks0, nvalid, nmask, g: tl.constexpr, BLOCK_N: tl.constexpr,
          D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
          GW: tl.constexpr, NPH: tl.constexpr, DEC: tl.constexpr,
          A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
          A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr, PAIRS: tl.constexpr = False):
    k = load_tile(KC, KS, KCENT, k_off, ks_off, nmask, g, BLOCK_N, D, KIND, BITS, G, GW, NPH,
                  DEC, A0, A1, A2, A3, A4, A5, A6, A7)
    s = tl.dot(q, tl.trans(k))
    if KIND == 3:
        s = s * _norm(KS, ks_off, ks0, nvalid, nmask, g, PAIRS)[None, :]
    return s


@triton.jit
def _pv(acc, alpha, p, VC, VS, VCENT, v_off, vs_off, vs0, nvalid, nmask, g: tl.constexpr,
        BLOCK_N: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
        G: tl.constexpr, GW: tl.constexpr, NPH: tl.constexpr, DEC: tl.constexpr,
        A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
        A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr, PAIRS: tl.constexpr = False):
    v = load_tile(VC, VS, VCENT, v_off, vs_off, nmask, g, BLOCK_N, D, KIND, BITS, G, GW, NPH,
                  DEC, A0, A1, A2, A3, A4, A5, A6, A7)
    if KIND == 3:  # fold the per-token norm into P: the V tile is centroids only
        pd = (p * _norm(VS, vs_off, vs0, nvalid, nmask, g, PAIRS)[None, :]).to(tl.float16)
    else:
        pd = p.to(tl.float16)
    return acc * alpha[:, None] + tl.dot(pd, v)


@triton.jit
def _split_bounds(KV_LENS, KV_START, QSHIFT, b, pid_s, SPLIT_LEN, BLOCK_N: tl.constexpr,
                  HAS_START: tl.constexpr, HAS_QSHIFT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  N_Q, WINDOW):
    """(kv_len, kv_start, start, end, q_end) of split pid_s of sequence b. Left padding
    (HAS_START): rows before kv_start are not keys, the loop starts at the tile that holds it
    (kv_start = 0 else). The queries sit at q_end - N_Q .. q_end - 1: q_end = kv_len, or with
    HAS_QSHIFT kv_len + QSHIFT[b] (keys that end before the queries: a sliding-window layer's
    shared prefix, its agent's suffix rows in between). With a window the loop starts at the tile
    of the first query's first visible key."""
    kv_len = tl.load(KV_LENS + b)
    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, kv_len)
    kv_start = 0
    if HAS_START:
        kv_start = tl.load(KV_START + b)
        start = tl.maximum(start, (kv_start // BLOCK_N) * BLOCK_N)
    q_end = kv_len
    if HAS_QSHIFT:
        q_end += tl.load(QSHIFT + b)
    if HAS_WINDOW:
        first = tl.maximum(q_end - N_Q - WINDOW + 1, 0)
        start = tl.maximum(start, (first // BLOCK_N) * BLOCK_N)
    return kv_len, kv_start, start, end, q_end


@triton.jit
def _first_row(PT, PT_STRIDE, b, n0, PAGE: tl.constexpr):
    """int64 storage row of sequence row n0: through the page table when PAGE > 0."""
    if PAGE > 0:
        page = tl.load(PT + b.to(tl.int64) * PT_STRIDE + n0 // PAGE).to(tl.int64)
        r = page * PAGE + (n0 % PAGE)
    else:
        r = tl.cast(n0, tl.int64)
    return r


@triton.jit
def _row_index(PT, PT_STRIDE, b, n0, offs_n, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 [BLOCK_N] storage rows of sequence rows n0 + i: through the page table when PAGE > 0
    (a tile never straddles a page: PAGE % BLOCK_N == 0), else the rows themselves."""
    if PAGE > 0:
        on = _first_row(PT, PT_STRIDE, b, n0, PAGE) + tl.arange(0, BLOCK_N).to(tl.int64)
    else:
        on = offs_n.to(tl.int64)
    return on


@triton.jit
def _query_rows(pid_bh, pid_m, BLOCK_M: tl.constexpr, M_TOTAL, N_Q, q_end):
    """Row tile pid_m of a (sequence, KV head): (valid mask, global q row int64, the query's
    position in the sequence) — row r = head_in_group * n_q + j sits at q_end - n_q + j."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M_TOTAL
    q_rows = pid_bh.to(tl.int64) * M_TOTAL + rows
    qpos = q_end - N_Q + rows % N_Q
    return rmask, q_rows, qpos


@triton.jit
def _store_split_lse(m_i, l_i, L_PART, q_rows, rmask, N_SPLITS, split):
    """End of a split: store its log-sum-exp (natural log; -inf for rows that saw no key) and
    return (1 / l per row, 0 where empty; the rows' partial-output row index)."""
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    prow = q_rows * N_SPLITS + split
    tl.store(L_PART + prow, lse, mask=rmask)
    return inv, prow


@triton.jit
def _decode_kernel(
        Q, KC, KS, VC, VS, KCENT, VCENT, KV_LENS, KV_START, PT, O_PART, L_PART, QSHIFT,
        skb, skh, sks, sksb, sksh, skss,
        svb, svh, svs, svsb, svsh, svss,
        HKV, M_TOTAL, N_Q, SPLIT_LEN, N_SPLITS, SPLIT0, qk_scale, WINDOW, PT_STRIDE,
        Q_SBH, Q_BLK, Q_SBLK,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_GW: tl.constexpr,
        K_NPH: tl.constexpr, K_DEC: tl.constexpr,
        V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_GW: tl.constexpr,
        V_NPH: tl.constexpr, V_DEC: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_START: tl.constexpr,
        HAS_QSHIFT: tl.constexpr,
        KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr,
        KA4: tl.constexpr, KA5: tl.constexpr, KA6: tl.constexpr, KA7: tl.constexpr,
        VA0: tl.constexpr, VA1: tl.constexpr, VA2: tl.constexpr, VA3: tl.constexpr,
        VA4: tl.constexpr, VA5: tl.constexpr, VA6: tl.constexpr, VA7: tl.constexpr,
        K_PAIRS: tl.constexpr = False, V_PAIRS: tl.constexpr = False,
        K_SROW: tl.constexpr = 1, V_SROW: tl.constexpr = 1):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    NGK: tl.constexpr = D // K_GW
    NGV: tl.constexpr = D // V_GW

    kv_len, kv_start, start, end, q_end = _split_bounds(
        KV_LENS, KV_START, QSHIFT, b, pid_s, SPLIT_LEN, BLOCK_N, HAS_START, HAS_QSHIFT, HAS_WINDOW,
        N_Q, WINDOW)

    rmask, q_rows, qpos = _query_rows(pid_bh, pid_m, BLOCK_M, M_TOTAL, N_Q, q_end)
    # q's rows of (sequence, KV head) pid_bh start at pid_bh * Q_SBH and come in blocks of Q_BLK
    # consecutive rows, Q_SBLK apart (the cascade's prefix pass: each agent's rows, read in place)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_off = (pid_bh.to(tl.int64) * Q_SBH + (rows // Q_BLK).to(tl.int64) * Q_SBLK
             + (rows % Q_BLK).to(tl.int64) * D)

    # q in the K tiles' column order (triton_codec.perm_cols), loaded once per program
    q0 = _load_q(Q, q_off, rmask, 0, K_GW, K_NPH, D)
    if NGK > 1:
        q1 = _load_q(Q, q_off, rmask, 1, K_GW, K_NPH, D)
    if NGK > 2:
        q2 = _load_q(Q, q_off, rmask, 2, K_GW, K_NPH, D)
        q3 = _load_q(Q, q_off, rmask, 3, K_GW, K_NPH, D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, V_GW], tl.float32)
    acc1 = tl.zeros([BLOCK_M, V_GW], tl.float32)
    acc2 = tl.zeros([BLOCK_M, V_GW], tl.float32)
    acc3 = tl.zeros([BLOCK_M, V_GW], tl.float32)

    kbase = b.to(tl.int64) * skb + h.to(tl.int64) * skh
    ksbase = b.to(tl.int64) * sksb + h.to(tl.int64) * sksh
    vbase = b.to(tl.int64) * svb + h.to(tl.int64) * svh
    vsbase = b.to(tl.int64) * svsb + h.to(tl.int64) * svsh

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        on = _row_index(PT, PT_STRIDE, b, n0, offs_n, PAGE, BLOCK_N)
        k_off = kbase + on * sks
        # K_SROW / V_SROW: every row's scales start at a multiple of that many elements (the
        # host checked), so a q8_0 row of scales is one vector load Triton can pipeline
        ks_off = tl.multiple_of(ksbase + on * skss, K_SROW)
        nvalid = end - n0
        ks0 = ksbase
        vs0 = vsbase
        if K_PAIRS or V_PAIRS:  # the tile's first storage row
            on0 = _first_row(PT, PT_STRIDE, b, n0, PAGE)
            ks0 += on0
            vs0 += on0
        # ---- scores
        s = _kdot(q0, KC, KS, KCENT, k_off, ks_off, ks0, nvalid, nmask, 0, BLOCK_N, D, K_KIND, K_BITS, K_G,
                  K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7, K_PAIRS)
        if NGK > 1:
            s += _kdot(q1, KC, KS, KCENT, k_off, ks_off, ks0, nvalid, nmask, 1, BLOCK_N, D, K_KIND, K_BITS,
                       K_G, K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7, K_PAIRS)
        if NGK > 2:
            s += _kdot(q2, KC, KS, KCENT, k_off, ks_off, ks0, nvalid, nmask, 2, BLOCK_N, D, K_KIND, K_BITS,
                       K_G, K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7, K_PAIRS)
            s += _kdot(q3, KC, KS, KCENT, k_off, ks_off, ks0, nvalid, nmask, 3, BLOCK_N, D, K_KIND, K_BITS,
                       K_G, K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7, K_PAIRS)
        s = s * qk_scale
        vis = nmask[None, :] & rmask[:, None]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (offs_n[None, :] > qpos[:, None] - WINDOW)
        if HAS_START:
            vis = vis & (offs_n[None, :] >= kv_start)
        s = tl.where(vis, s, float("-inf"))
        # ---- online softmax
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        # ---- values
        v_off = vbase + on * svs
        vs_off = tl.multiple_of(vsbase + on * svss, V_SROW)
        acc0 = _pv(acc0, alpha, p, VC, VS, VCENT, v_off, vs_off, vs0, nvalid, nmask, 0, BLOCK_N, D, V_KIND,
                   V_BITS, V_G, V_GW, V_NPH, V_DEC, VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7, V_PAIRS)
        if NGV > 1:
            acc1 = _pv(acc1, alpha, p, VC, VS, VCENT, v_off, vs_off, vs0, nvalid, nmask, 1, BLOCK_N, D,
                       V_KIND, V_BITS, V_G, V_GW, V_NPH, V_DEC,
                       VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7, V_PAIRS)
        if NGV > 2:
            acc2 = _pv(acc2, alpha, p, VC, VS, VCENT, v_off, vs_off, vs0, nvalid, nmask, 2, BLOCK_N, D,
                       V_KIND, V_BITS, V_G, V_GW, V_NPH, V_DEC,
                       VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7, V_PAIRS)
            acc3 = _pv(acc3, alpha, p, VC, VS, VCENT, v_off, vs_off, vs0, nvalid, nmask, 3, BLOCK_N, D,
                       V_KIND, V_BITS, V_G, V_GW, V_NPH, V_DEC,
                       VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7, V_PAIRS)

    inv, prow = _store_split_lse(m_i, l_i, L_PART, q_rows, rmask, N_SPLITS, SPLIT0 + pid_s)
    o_off = prow * D
    _store_o(O_PART, o_off, rmask, acc0 * inv[:, None], 0, V_GW, V_NPH)
    if NGV > 1:
        _store_o(O_PART, o_off, rmask, acc1 * inv[:, None], 1, V_GW, V_NPH)
    if NGV > 2:
        _store_o(O_PART, o_off, rmask, acc2 * inv[:, None], 2, V_GW, V_NPH)
        _store_o(O_PART, o_off, rmask, acc3 * inv[:, None], 3, V_GW, V_NPH)


@triton.jit
def _splits_max(L, row, NS, NS_P2: tl.constexpr, NS_CH: tl.constexpr, m):
    """max(m, the LSE of `row`'s NS splits) — L float32 [rows * NS], read NS_P2 at a time."""
    s = tl.arange(0, NS_P2)
    for c in tl.static_range(0, NS_CH * NS_P2, NS_P2):
        m = tl.maximum(m, tl.max(tl.load(L + row * NS + c + s, mask=c + s < NS,
                                         other=float("-inf")), 0))
    return m


@triton.jit
def _splits_weight(L, row, NS, NS_P2: tl.constexpr, NS_CH: tl.constexpr, m_safe):
    """sum of exp(lse - m_safe) over `row`'s NS splits (0 for absent ones)."""
    s = tl.arange(0, NS_P2)
    tot = 0.0
    for c in tl.static_range(0, NS_CH * NS_P2, NS_P2):
        tot += tl.sum(tl.exp(tl.load(L + row * NS + c + s, mask=c + s < NS,
                                     other=float("-inf")) - m_safe), 0)
    return tot


@triton.jit
def _splits_sum(O, L, row, NS, NS_P2: tl.constexpr, NS_CH: tl.constexpr, m_safe, d,
                D: tl.constexpr, acc):
    """acc + the columns d of `row`'s NS split outputs (O float32 [rows * NS, D]), each weighted
    by exp(lse - m_safe): [NS_P2, len(d)] tiles, NS_CH of them."""
    s = tl.arange(0, NS_P2)
    for c in tl.static_range(0, NS_CH * NS_P2, NS_P2):
        mask = c + s < NS
        w = tl.exp(tl.load(L + row * NS + c + s, mask=mask, other=float("-inf")) - m_safe)
        o = tl.load(O + (row * NS + c + s)[:, None] * D + d[None, :], mask=mask[:, None], other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    return acc


@triton.jit
def _combine_kernel(PO, PL, SO, SL, TO, TL, OUT, LSE, ROT, HKV, M, N_AGENTS, NSP, NSS, NST,
                    OUT_NQ, OUT_HQ, D: tl.constexpr, NSP_P2: tl.constexpr, NSS_P2: tl.constexpr,
                    NST_P2: tl.constexpr, G: tl.constexpr, HAS_S: tl.constexpr,
                    HAS_T: tl.constexpr, UNROT: tl.constexpr, NSP_CH: tl.constexpr = 1,
                    NSS_CH: tl.constexpr = 1, NST_CH: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Merge the splits of output row r (one program per row) by log-sum-exp: the splits of a
    first pass P (PO / PL), whose row for r = (n * HKV + h) * M + mm is (h * N_AGENTS + n) * M + mm
    (the cascade's prefix pass keeps all agents of a KV head side by side; HKV = 1 makes it r), and
    with HAS_S those of a second pass S (SO / SL) at row r — every split's LSE weight first, then
    the outputs in [NSP_P2, G] / [NSS_P2, G] tiles (NSP_P2, NSS_P2: at most COMBINE_CHUNK splits
    per tile; NSP_CH / NSS_CH tiles, unrolled: a [splits, G] tile never outgrows the registers).
    With UNROT the row goes from V's storage domain back to true space (y_g = o_g @ M^T per group
    of G, ROT = M float32 [G, G]); with HAS_T the splits of a third pass T (TO / TL, row r) over
    other keys, already in true space (a recent window's q8_0 segment), join after that; stored
    in OUT's dtype: the whole epilogue of a decode or cascade call in one launch. OUT_NQ > 1: OUT
    token-major (`_out_row`), LSE in r's order. PDL: launched
    as a programmatic dependent of the split pass (`pdl_ok`), so
    it waits for that pass's results here."""
    if PDL:
        gdc_wait()
    r = tl.program_id(0).to(tl.int64)
    n = r // (HKV * M)
    h = (r // M) % HKV
    pr = (h * N_AGENTS + n) * M + r % M
    orow = _out_row(r, OUT_NQ, OUT_HQ)
    m = _splits_max(PL, pr, NSP, NSP_P2, NSP_CH, float("-inf"))
    if HAS_S:
        m = _splits_max(SL, r, NSS, NSS_P2, NSS_CH, m)
    if HAS_T:
        m = _splits_max(TL, r, NST, NST_P2, NST_CH, m)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = _splits_weight(PL, pr, NSP, NSP_P2, NSP_CH, m_safe)  # absent splits weigh 0
    if HAS_S:
        tot += _splits_weight(SL, r, NSS, NSS_P2, NSS_CH, m_safe)
    if HAS_T:
        tot += _splits_weight(TL, r, NST, NST_P2, NST_CH, m_safe)
    den = tl.where(tot > 0, tot, 1.0)
    gi = tl.arange(0, G)
    if UNROT:
        mt = tl.load(ROT + gi[None, :] * G + gi[:, None])  # mt[i, j] = M[j, i]
    for g in tl.static_range(D // G):
        d = g * G + gi
        acc = _splits_sum(PO, PL, pr, NSP, NSP_P2, NSP_CH, m_safe, d, D, tl.zeros([G], tl.float32))
        if HAS_S:
            acc = _splits_sum(SO, SL, r, NSS, NSS_P2, NSS_CH, m_safe, d, D, acc)
        out = acc / den
        if UNROT:  # true space: y_g = o_g @ M^T, per rotation group
            out = tl.sum(out[:, None] * mt, 0)
        if HAS_T:
            out += _splits_sum(TO, TL, r, NST, NST_P2, NST_CH, m_safe, d, D,
                               tl.zeros([G], tl.float32)) / den
        tl.store(OUT + orow * D + d, out.to(OUT.dtype.element_ty))
    tl.store(LSE + r, tl.where(tot > 0, m_safe + tl.log(den), float("-inf")))


@triton.jit
def _out_row(r, OUT_NQ, OUT_HQ):
    """Where output row r = (b * Hq + hq) * OUT_NQ + t ([B, Hq, n_q] order, Hq = OUT_HQ) is
    stored: row (b * OUT_NQ + t) * OUT_HQ + hq, token-major ([B, n_q, Hq]: a verify step's
    attention output as the model reshapes it, [B, n_q, Hq * D], in place); r itself at OUT_NQ 1."""
    rq = r // OUT_NQ
    return (rq // OUT_HQ * OUT_NQ + r % OUT_NQ) * OUT_HQ + rq % OUT_HQ


@triton.jit
def _splits_tile_max(L, prow, rmask, NS, SC: tl.constexpr, NT: tl.constexpr, m):
    """max(m, the LSE of rows prow's NS splits): NT [BLOCK_R, SC] tiles of L float32 [rows * NS]."""
    s = tl.arange(0, SC)
    for c in tl.static_range(0, NT * SC, SC):
        mask = rmask[:, None] & (c + s < NS)[None, :]
        m = tl.maximum(m, tl.max(tl.load(L + prow[:, None] * NS + c + s[None, :], mask=mask,
                                         other=float("-inf")), 1))
    return m


@triton.jit
def _splits_tile_sum(O, L, prow, rmask, NS, SC: tl.constexpr, NT: tl.constexpr, m_safe, d,
                     D: tl.constexpr, acc, tot):
    """(acc + columns d of rows prow's NS split outputs weighted by exp(lse - m_safe), tot + those
    weights): NT [BLOCK_R, SC, len(d)] tiles of O float32 [rows * NS, D], unrolled (every tile's
    loads in flight at once)."""
    s = tl.arange(0, SC)
    for c in tl.static_range(0, NT * SC, SC):
        mask = rmask[:, None] & (c + s < NS)[None, :]
        split = prow[:, None] * NS + c + s[None, :]
        w = tl.exp(tl.load(L + split, mask=mask, other=float("-inf")) - m_safe[:, None])
        o = tl.load(O + split[:, :, None] * D + d[None, None, :], mask=mask[:, :, None], other=0.0)
        acc += tl.sum(o * w[:, :, None], 1)
        tot += tl.sum(w, 1)
    return acc, tot


@triton.jit
def _combine_rows_kernel(PO, PL, SO, SL, TO, TL, OUT, LSE, ROT, HKV, M, N_AGENTS, R, NSP, NSS, NST,
                         OUT_NQ, OUT_HQ, D: tl.constexpr, BLOCK_R: tl.constexpr, SC: tl.constexpr,
                         NTP: tl.constexpr, NTS: tl.constexpr, NTT: tl.constexpr,
                         DC: tl.constexpr, HAS_S: tl.constexpr, HAS_T: tl.constexpr,
                         UNROT: tl.constexpr, PDL: tl.constexpr = False):
    """`_combine_kernel` for BLOCK_R output rows per program (program_id(0)) and DC output
    columns (program_id(1)): the same merge (rows mapped the same way, splits read SC at a time
    for all BLOCK_R rows: NTP / NTS / NTT tiles of the three passes), and with UNROT the rows go
    back to true space as one tensor-core product per program, out[:, cols] = o @ ROT^T[:, cols]
    (ROT float32 [D, D], the per-group rotation on the diagonal: `block_rotation`), at fp32
    accuracy (3 x tf32). Many rows (a cascade over many agents) read the rotation once per
    BLOCK_R rows instead of once per row (H200, kernels_notes v17)."""
    if PDL:
        gdc_wait()
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = r < R
    n = r // (HKV * M)
    h = (r // M) % HKV
    pr = (h * N_AGENTS + n) * M + r % M
    m = _splits_tile_max(PL, pr, rmask, NSP, SC, NTP, tl.full([BLOCK_R], float("-inf"), tl.float32))
    if HAS_S:
        m = _splits_tile_max(SL, r, rmask, NSS, SC, NTS, m)
    if HAS_T:
        m = _splits_tile_max(TL, r, rmask, NST, SC, NTT, m)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d = tl.arange(0, D)
    cols = tl.program_id(1) * DC + tl.arange(0, DC)  # the output columns this program writes
    acc, tot = _splits_tile_sum(PO, PL, pr, rmask, NSP, SC, NTP, m_safe, d, D,
                                tl.zeros([BLOCK_R, D], tl.float32), tl.zeros([BLOCK_R], tl.float32))
    if HAS_S:
        acc, tot = _splits_tile_sum(SO, SL, r, rmask, NSS, SC, NTS, m_safe, d, D, acc, tot)
    if HAS_T:  # true space: only this program's columns, joined after the unrotation
        acc_t, tot = _splits_tile_sum(TO, TL, r, rmask, NST, SC, NTT, m_safe, cols, D,
                                      tl.zeros([BLOCK_R, DC], tl.float32), tot)
    den = tl.where(tot > 0, tot, 1.0)
    out = acc / den[:, None]
    if UNROT:
        mt = tl.load(ROT + cols[None, :] * D + d[:, None])  # mt[i, j] = ROT[j, i]
        out = tl.dot(out, mt, input_precision="tf32x3")
    if HAS_T:
        out += acc_t / den[:, None]
    orow = _out_row(r, OUT_NQ, OUT_HQ)
    tl.store(OUT + orow[:, None] * D + cols[None, :], out.to(OUT.dtype.element_ty), mask=rmask[:, None])
    if tl.program_id(1) == 0:
        tl.store(LSE + r, tl.where(tot > 0, m_safe + tl.log(den), float("-inf")), mask=rmask)


#: The combine's row-block kernel (`_combine_rows_kernel`) from this many output rows on (fewer:
#: one program per row, `_combine_kernel`), BLOCK_R rows per program, D / COMBINE_COL_PROGRAMS
#: output columns per program when it unrotates (H200 sweep: kernels_notes v17).
COMBINE_BLOCK_MIN_ROWS = 512
COMBINE_BLOCK_R = 16
COMBINE_COL_PROGRAMS = 2
COMBINE_TILE = 8192  # float32 elements of one [BLOCK_R, SC, D] tile of split outputs
COMBINE_WARPS = 4

#: Splits per [splits, G] tile of the combine (more are read in chunks of this many): 128 is the
#: 64k decode's split count (one tile, as before chunking); a full-attention layer with one KV head
#: plans up to 512 splits, whose single tile spilled (Gemma-3 shapes: 36 us per combine).
COMBINE_CHUNK = 128


def _strides(p: Packed, bcast_b: bool):
    c = p.codes
    if c.stride(-1) != 1:
        raise ValueError("packed codes must be contiguous in the last dim")
    cs = (0 if bcast_b else c.stride(0), c.stride(1), c.stride(2))
    if p.scales is None:
        return c, c, cs, (0, 0, 0)
    s = p.scales
    if s.stride(-1) != 1:
        raise ValueError("packed scales must be contiguous in the last dim")
    ss = (0 if bcast_b else s.stride(0), s.stride(1), s.stride(2))
    return c, s, cs, ss


def _scale_layout(p: Packed, ss: tuple) -> tuple[bool, int]:
    """(PAIRS, SROW) of the tile kernel for a packed tensor's scales, strides ss (elements):
    PAIRS — one fp16 factor per row, rows contiguous, even offsets and capacity (read as int32
    pairs); SROW — every row's factors start at a multiple of this many elements (its row width
    when the strides and the base allow, else 1), so a row of q8_0 block scales is one vector."""
    s = p.scales
    if s is None or s.element_size() != 2:
        return False, 1
    row = s.shape[-1]
    aligned = lambda n: all(x % n == 0 for x in ss) and s.data_ptr() % (2 * n) == 0
    pairs = row == 1 and ss[2] == 1 and all(x % 2 == 0 for x in ss[:2]) and s.shape[2] % 2 == 0 \
        and s.data_ptr() % 4 == 0
    srow = row if row & (row - 1) == 0 and aligned(row) else 1
    return pairs, srow


def _block_n(d: int) -> int:
    return {64: 64, 128: 64, 256: 32, 512: 32}.get(d, 32)


_SMS: dict = {}


def num_programs_target(device) -> int:
    if device.type == "cuda":
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in _SMS:
            _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
        return 4 * _SMS[key]
    return 4  # interpreter: keep the program count small but exercise several splits


# impl="auto": the phase kernel for up to this many rows per KV head (decode: a GQA group times
# n_q); the tile kernel above (the cascade prefix: 8 agents, 32 rows, 177 us tile vs 187 us phase)
PHASE_MAX_ROWS = 16

_ASM_BROKEN: set = set()  # (k kind/bits, v kind/bits) whose inline-asm build failed here


_PDL: dict = {}


def pdl_ok(dev: torch.device) -> bool:
    """Whether kernels on this device launch as programmatic dependents of the kernel before them
    (CUDA sm_90+, compiled, POLYKV_PDL not 0): the split pass and its combine then overlap their
    launch with the previous kernel's tail instead of waiting for it to drain."""
    if dev.type != "cuda" or gdc_wait is None or _interpreting():
        return False
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _PDL:
        import os
        _PDL[key] = (torch.cuda.get_device_capability(key)[0] >= 9
                     and os.environ.get("POLYKV_PDL", "1") != "0")
    return _PDL[key]


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class SplitParts(NamedTuple):
    """What a split-KV pass leaves before its log-sum-exp combine: o float32 [rows * n_splits * D]
    (normalised within each split), lse float32 [rows * n_splits] (natural log), row-major over
    (row, split); rows in the pass's own [B, Hkv, M] order."""

    o: torch.Tensor
    lse: torch.Tensor
    n_splits: int


def _tkey(t: torch.Tensor | None):
    """A plan key's view of a tensor: shape, strides, dtype and the low pointer bits (Triton
    specialises on 16-byte alignment; the tile kernel's factor loads on up to 64)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 63)


_PLANS: dict = {}
"""Planned launches of eager calls (CUDA, launch cache on), keyed on everything but the tensors'
contents: a repeated call (a decode step per layer) skips the launch arithmetic and Triton's
dispatch (issue F: host time per eager call)."""


def _plannable(dev: torch.device) -> bool:
    """Whether calls on this device keep plans (compiled CUDA kernels, launch cache on)."""
    return dev.type == "cuda" and launch_mod.enabled


def _remember(key, plan, store: dict | None = None) -> None:
    """store[key] = plan (store: _PLANS by default), the store started over when full."""
    store = _PLANS if store is None else store
    if len(store) >= launch_mod.MAX_ENTRIES:
        store.clear()
    store[key] = plan


def _aligned(n: int) -> int:
    """n float32 elements rounded up to 64 bytes: each partial starts aligned, as a fresh buffer
    would (the launches were specialised on it)."""
    return -(-n // 16) * 16


class _DecodePlan(NamedTuple):
    launch: launch_mod.Planned
    o_numel: int
    l_numel: int
    n_splits: int
    kcent: torch.Tensor
    vcent: torch.Tensor
    pt: torch.Tensor  # the page-table argument of unpaged launches (a placeholder)

    def __call__(self, qp: torch.Tensor, k: Packed, v: Packed, kv_lens: torch.Tensor,
                 kv_start: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                 parts: tuple | None = None, q_shift: torch.Tensor | None = None) -> SplitParts:
        """The planned split pass on these tensors (decode_parts' arguments, already int32 on the
        device), one launch; parts: its (o, lse) partial buffers (float32, o_numel / l_numel;
        tensors or their device addresses), else fresh ones."""
        if parts is None:
            dev = qp.device
            parts = (torch.empty(self.o_numel, dtype=torch.float32, device=dev),
                     torch.empty(self.l_numel, dtype=torch.float32, device=dev))
        o_part, l_part = parts
        self.launch(qp, k.codes, k.codes if k.scales is None else k.scales, v.codes,
                    v.codes if v.scales is None else v.scales, self.kcent, self.vcent, kv_lens,
                    kv_lens if kv_start is None else kv_start,
                    self.pt if page_table is None else page_table, o_part, l_part,
                    kv_lens if q_shift is None else q_shift)
        return SplitParts(o_part, l_part, self.n_splits)


def decode_prepared(qp: torch.Tensor, n_q: int, k: Packed, v: Packed, k_codec, v_codec,
                    kv_lens: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                    out_shape: tuple | None = None, rec: list | None = None, **kw):
    """`decode_parts` and its combine (`combine_splits`): returns out float32 [B, Hkv, M, D] in
    V's storage domain and lse float32 [B, Hkv, M]; with out_dtype, out is in true space
    (unrotated) and that dtype; with out_shape, out [*out_shape] and lse [*out_shape[:-1]] (the
    same rows). rec: a list the plans of both launches are appended to (`CallPlan`)."""
    parts = decode_parts(qp, n_q, k, v, k_codec, v_codec, kv_lens, rec=rec, **kw)
    return combine_splits(parts, tuple(qp.shape), v_codec, out_dtype, out_shape=out_shape, rec=rec)


def decode_parts(qp: torch.Tensor, n_q: int, k: Packed, v: Packed, k_codec, v_codec,
                 kv_lens: torch.Tensor, *, causal: bool, window: int | None, sm_scale: float,
                 block_m_max: int = 64, target_programs: int | None = None,
                 num_warps: int | None = None, num_stages: int = 2, block_n: int | None = None,
                 dec: str = "auto", impl: str = "auto", maxnreg: int | None = None,
                 page_table: torch.Tensor | None = None, page_size: int = 0,
                 kv_start: torch.Tensor | None = None, q_shift: torch.Tensor | None = None,
                 vector_factors: bool = True, split_len: int | None = None,
                 max_split: int = 0, chunks=None, total_rows: int = 0, pdl: bool = True,
                 rec: list | None = None) -> SplitParts:
    """The split-KV pass (stage 1) of a decode call. qp: [B, Hkv, M, D] contiguous (any float
    dtype), already in K's storage domain (rotated / InnerQ-divided), rows r = head_in_group * n_q
    + j; or [B, Hkv, NB, MB, D], the M = NB * MB rows of a KV head as NB blocks of MB contiguous
    rows at any spacing (the cascade's prefix pass: every agent's rows of a KV head, viewed in
    place), which the tile kernel reads as they lie and the phase kernel after a copy.
    k, v: Packed leading [B or 1, Hkv, S_cap].
    dec: "asm" (PTX byte-permute lookup, CUDA only), "select" (plain Triton), "auto" (asm where it
    applies and builds). impl: "phase" (_phase_decode_kernel), "tile" (_decode_kernel), "auto"
    (phase where both codecs allow it: phase_ok). maxnreg: a register cap per thread (tuning).
    vector_factors: the tile kernel reads the per-row factors (turbo norms as int32 pairs, q8_0 /
    q4_0 block scales as one vector per row) with loads Triton pipelines, where the layout allows
    (_scale_layout); False: plain per-element loads (A/B timing). split_len: keys per split
    (a multiple of the key tile; default `plan_split_len`, powers of two <= max_split if given).
    chunks, total_rows: the keys as an iterable of chunks (k, v, kv_lens, row0) of total_rows rows
    instead (k, v and kv_lens None; B == 1, no page table), consumed lazily — one launch per chunk
    as it arrives (the host tier's streamed prefix: the next chunk's buffer is refilled once this
    one's launch is queued). Chunk c holds rows [row0, row0 + its rows), kv_lens int32 [1] its row
    count; every row0 must be a multiple of the split length, so each split lies in one chunk: the
    splits are planned over all rows and merged in one combine — the values of one call over the
    joined rows, bit for bit. page_table int32 [B, max_pages] (with
    page_size): k, v are a page pool (leading [1, Hkv, rows]) and row n of sequence b lives at
    page_table[b, n // page_size] * page_size + n % page_size. kv_start int32 [B]: rows before it
    are left padding, never keys. q_shift int32 [B]: sequence b's queries sit q_shift[b] rows
    after its last key (at kv_len + q_shift - n_q + j; default 0), for the causal and window
    masks — keys that end before the queries (`dispatch.cascade_attention`'s windowed prefix).
    pdl: the phase kernel launches as a programmatic dependent where the device allows (`pdl_ok`);
    False for a pass queued right behind another split pass (a windowed cascade's second and third
    passes: launched early, they start beside the running pass and slow it, BENCHMARKS §5.17).
    Returns the splits' partial results (`SplitParts`; rows
    [B, Hkv, M], V's storage domain). rec: the launch's plan (`_DecodePlan`, None where this call
    is not planned) is appended to it."""
    B, Hkv, D = qp.shape[0], qp.shape[1], qp.shape[-1]
    dev = qp.device
    if qp.dim() == 5:  # blocked rows: the tile kernel reads them in place, the phase kernel a copy
        M = qp.shape[2] * qp.shape[3]
        impl = _resolve_impl(impl, M, k_codec, v_codec)
        if impl != "tile" or _row_blocks(qp) is None:
            qp = qp.reshape(B, Hkv, M, D).contiguous()
    else:
        M = qp.shape[2]
    plan_key = None
    if (chunks is None and _plannable(dev)
            and all(t is None or (t.dtype == torch.int32 and t.device == dev)
                    for t in (page_table, kv_start, q_shift))):
        plan_key = ("decode", dev.index, _tkey(qp), n_q, _tkey(k.codes), _tkey(k.scales), _tkey(v.codes),
                    _tkey(v.scales), _codec_key(k_codec), _codec_key(v_codec), _tkey(kv_lens), causal,
                    window, sm_scale, _tkey(page_table), page_size, _tkey(kv_start), _tkey(q_shift),
                    block_m_max,
                    target_programs, num_warps, num_stages, block_n, dec, impl, maxnreg,
                    vector_factors, split_len, max_split, pdl)
        p = _PLANS.get(plan_key)
        if p is not None:
            if rec is not None:
                rec.append(p)
            return p(qp, k, v, kv_lens, kv_start, page_table, q_shift=q_shift)
    impl = _resolve_impl(impl, M, k_codec, v_codec)
    phase = impl == "phase"
    q_blocks = None if phase else _row_blocks(qp)
    if not phase and q_blocks is None:
        raise ValueError(f"query rows of shape {tuple(qp.shape)} and strides {qp.stride()}: "
                         "each row block must be contiguous")
    km, vm = ((phase_meta(k_codec), phase_meta(v_codec)) if phase
              else (codec_meta(k_codec), codec_meta(v_codec)))
    if chunks is None:
        chunks = [(k, v, kv_lens, 0)]
        S = k.codes.shape[2] if page_table is None else page_table.shape[1] * page_size
    elif B != 1 or page_table is not None or total_rows <= 0:
        raise ValueError("chunked keys need one sequence (B == 1), no page table and total_rows")
    else:
        S = int(total_rows)
    kcent = k_codec.tables(dev)[0] if km["KIND"] == 3 else placeholder(dev)
    vcent = v_codec.tables(dev)[0] if vm["KIND"] == 3 else placeholder(dev)
    # the phase kernel puts the rows on the mma's N (8 is its smallest tile); the tile kernel on M
    BLOCK_M = max(8 if phase else 16, min(block_m_max, next_pow2(M)))
    n_mt = cdiv(M, BLOCK_M)
    extra = {} if maxnreg is None else {"maxnreg": int(maxnreg)}
    if phase:
        # H200 v5 sweep (docs/kernels_notes.md): one warp per program for the decode rows
        n_min = 16
        # fewer keys than a 64-row tile (a recent window's 8-row segment): the smallest power of
        # two that holds them, so a one-warp program decodes 16 rows instead of 64 masked ones
        BLOCK_N = block_n or min(64, max(n_min, next_pow2(S)))
        num_warps = num_warps or (1 if BLOCK_M <= 16 else 4)
    else:
        BLOCK_N = block_n or (128 if BLOCK_M <= 16 and D <= 128 else _block_n(D))
        num_warps = num_warps or 4  # v4 sweep: 4 beat 8 for the 16-row decode and the cascade
        # every byte chunk [BLOCK_N, W] must give each thread >= 4 elements (no replicated tiny
        # tiles; the inline-asm lookup packs 4): raise BLOCK_N where a chunk would be too small
        w_min = min(km["GW"] // km["NPH"], vm["GW"] // vm["NPH"])
        n_min = next_pow2(cdiv(4 * 32 * num_warps, w_min))
        BLOCK_N = max(BLOCK_N, n_min)
    paged = page_table is not None
    if paged:  # one page per tile: the tile shrinks to the page, never below the layout minimum
        if page_size % max(16, n_min):
            raise ValueError(f"page_size {page_size} is not a multiple of the row tile this codec "
                             f"pair needs ({max(16, n_min)} rows)")
        BLOCK_N = math.gcd(BLOCK_N, page_size)
        page_table = page_table.to(device=dev, dtype=torch.int32)
        pt_stride = page_table.stride(0)
    else:
        page_table, pt_stride = placeholder(dev, torch.int32), 0  # never read
    # one-warp programs: 8 per SM, one full wave (H200 v5 sweep at 64k: 68 us at 8 per SM, 99-108
    # us at 10-13 per SM, 91 us at 4 per SM)
    target = target_programs or num_programs_target(dev) * (2 if phase and num_warps == 1 else 1)
    if split_len is None:
        split_len = plan_split_len(S, B * Hkv * n_mt, target, BLOCK_N, max_split)
        if not phase and D == 64 and BLOCK_M == 64 and split_len <= 2 * BLOCK_N:
            # splits of one or two key tiles: every program sets up, reads its query rows and
            # writes a partial for 64-128 keys. Half the row tile doubles the keys per split
            # (BENCHMARKS §5.18, H100, SmolLM2's cascade at a 2k prefix, 192 / 288 / 480 rows:
            # 39.4 / 48.0 / 47.4 us vs 51.2 / 60.7 / 55.8; at 16k, splits of 4+ tiles, 64 rows win)
            BLOCK_M, n_mt = 32, cdiv(M, 32)
            split_len = plan_split_len(S, B * Hkv * n_mt, target, BLOCK_N, max_split)
    elif split_len % BLOCK_N:
        raise ValueError(f"split_len {split_len} is not a multiple of the key tile ({BLOCK_N})")
    n_splits = max(1, cdiv(S, split_len))
    o_part = torch.empty(B * Hkv * M * n_splits * D, dtype=torch.float32, device=dev)
    l_part = torch.empty(B * Hkv * M * n_splits, dtype=torch.float32, device=dev)
    key = (km["KIND"], km["BITS"], vm["KIND"], vm["BITS"], impl)
    use_asm = (dec != "select" and dev.type == "cuda" and not _interpreting()
               and key not in _ASM_BROKEN)
    if dec == "asm" and not use_asm and key not in _ASM_BROKEN and dev.type == "cuda":
        raise RuntimeError("dec='asm' needs compiled CUDA (not the interpreter)")
    if phase:
        # q8_0 too: int8 -> fp16 by the 0x6400 magic (PRMT + HSUB2, full-rate integer pipes),
        # not I2F (a conversion unit at a fraction of the ALU rate); turbo8 has no PTX lookup
        k_dec = int(use_asm and km["KIND"] in (1, 2, 3) and not (km["KIND"] == 3 and km["BITS"] == 8))
        v_dec = int(use_asm and vm["KIND"] in (1, 2, 3) and not (vm["KIND"] == 3 and vm["BITS"] == 8))
    else:
        k_dec = int(use_asm and asm_ok(k_codec, BLOCK_N, num_warps))
        v_dec = int(use_asm and asm_ok(v_codec, BLOCK_N, num_warps))
    ka = asm_strings(k_codec) if k_dec else ("",) * 8
    va = asm_strings(v_codec) if v_dec else ("",) * 8

    def codec_args(pre, m, d, packed, ss):
        if phase:
            return {f"{pre}_KIND": m["KIND"], f"{pre}_BITS": m["BITS"], f"{pre}_G": m["G"],
                    f"{pre}_NG": D // m["GW"], f"{pre}_NPH": m["NPH"], f"{pre}_NSB": m["NSB"],
                    f"{pre}_PW": m["PW"], f"{pre}_DEC": d}
        pairs, srow = _scale_layout(packed, ss)
        return {f"{pre}_KIND": m["KIND"], f"{pre}_BITS": m["BITS"], f"{pre}_G": m["G"],
                f"{pre}_GW": m["GW"], f"{pre}_NPH": m["NPH"], f"{pre}_DEC": d,
                f"{pre}_PAIRS": pairs and m["KIND"] == 3 and vector_factors,
                f"{pre}_SROW": srow if vector_factors else 1}

    kernel = _phase_decode_kernel if phase else _decode_kernel

    def launch(part, kd, vd, ka, va):
        kp, vp, lens, row0 = part
        if row0 % split_len:
            raise ValueError(f"a chunk starts at row {row0}, inside a split of {split_len} keys: "
                             "chunk rows must be a multiple of the split length")
        kc, ks, kcs, kss = _strides(kp, kp.codes.shape[0] == 1 and B > 1)
        vc, vs, vcs, vss = _strides(vp, vp.codes.shape[0] == 1 and B > 1)
        rows = S if paged else kp.codes.shape[2]
        return cached_launch(
            kernel, (B * Hkv, max(1, cdiv(rows, split_len)), n_mt), qp, kc, ks, vc, vs, kcent, vcent, lens,
            lens if kv_start is None else kv_start.to(device=dev, dtype=torch.int32),
            page_table, o_part, l_part,
            lens if q_shift is None else q_shift.to(device=dev, dtype=torch.int32),
            *kcs, *kss, *vcs, *vss,
            Hkv, M, n_q, split_len, n_splits, row0 // split_len, sm_scale * LOG2E,
            int(window or 0), pt_stride, *(() if phase else q_blocks),
            D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE=int(page_size) if paged else 0,
            **codec_args("K", km, kd, kp, kss), **codec_args("V", vm, vd, vp, vss),
            CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_START=kv_start is not None,
            HAS_QSHIFT=q_shift is not None, KA0=ka[0], KA1=ka[1], KA2=ka[2], KA3=ka[3], KA4=ka[4], KA5=ka[5], KA6=ka[6],
            KA7=ka[7], VA0=va[0], VA1=va[1], VA2=va[2], VA3=va[3], VA4=va[4], VA5=va[5],
            VA6=va[6], VA7=va[7], num_warps=num_warps, num_stages=num_stages, **extra,
            **({"PDL": True, "launch_pdl": True} if phase and pdl and pdl_ok(dev) else {}),
            plan=13 if plan_key is not None else 0)

    for i, part in enumerate(chunks):
        if i == 0 and (k_dec or v_dec) and dec == "auto":
            try:
                planned = launch(part, k_dec, v_dec, ka, va)
            except ValueError:
                raise
            except Exception:  # an asm build problem on this toolchain: plain Triton from now on
                if torch.cuda.is_current_stream_capturing():
                    raise
                _ASM_BROKEN.add(key)
                k_dec, v_dec, ka, va = 0, 0, ("",) * 8, ("",) * 8
                planned = launch(part, k_dec, v_dec, ka, va)
        else:
            planned = launch(part, k_dec, v_dec, ka, va)
    p = None
    if plan_key is not None and planned is not None:
        p = _DecodePlan(planned, o_part.numel(), l_part.numel(), n_splits, kcent, vcent, page_table)
        _remember(plan_key, p)
    if rec is not None:
        rec.append(p)
    return SplitParts(o_part, l_part, n_splits)


def _resolve_impl(impl: str, M: int, k_codec, v_codec) -> str:
    """decode_parts' kernel: impl, or for "auto" (H200 v5 sweep) the phase kernel for
    decode-sized row tiles where both codecs allow it, the tile kernel for the cascade."""
    if impl != "auto":
        return impl
    return "phase" if M <= PHASE_MAX_ROWS and phase_ok(k_codec) and phase_ok(v_codec) else "tile"


def _row_blocks(qp: torch.Tensor) -> tuple[int, int, int] | None:
    """The tile kernel's view of query rows qp [B, Hkv, M, D] or [B, Hkv, NB, MB, D] (NB blocks of
    MB rows per KV head, e.g. the cascade's agents): (elements between consecutive (sequence, KV
    head) pairs, rows per block, elements between blocks), or None where the rows are not laid out
    so (a block's rows must be contiguous, the (sequence, KV head) pairs evenly spaced)."""
    B, Hkv, D = qp.shape[0], qp.shape[1], qp.shape[-1]
    if qp.dim() == 4:
        qp = qp.unsqueeze(2)
    _, _, NB, MB, _ = qp.shape
    s = qp.stride()
    if s[4] != 1 or (MB > 1 and s[3] != D) or (B > 1 and s[0] != Hkv * s[1]):
        return None
    return s[1], MB, s[2] if NB > 1 else 0


def plan_split_len(S: int, groups: int, target: int, block_n: int, max_split: int = 0) -> int:
    """Keys per split: enough splits of S keys that groups x splits programs reach `target`, a
    multiple of block_n. max_split (a power of two >= block_n): a power of two instead, rounded
    up (fewer splits, at most 2x) and at most max_split, so that the splits tile any chunking of
    the keys at multiples of max_split rows (the host tier's prefix chunks: the streamed cascade
    computes the very splits of the resident one)."""
    n_splits = max(1, min(cdiv(S, block_n), cdiv(target, groups)))
    split_len = cdiv(cdiv(S, n_splits), block_n) * block_n
    if max_split:
        split_len = max(block_n, min(max_split, next_pow2(split_len)))
    return split_len


def combine_outputs(shape: tuple, dtype: torch.dtype, dev, out_shape: tuple | None = None,
                    tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty (out, lse) a combine of rows [B, Hkv, M, D] (shape) writes: out [*out_shape]
    (default shape) in dtype and lse float32 [*out_shape[:-1]]; with tokens > 1 (the rows' n_q)
    out is [B, Hq, tokens, D] as the view of a [B, tokens, Hq, D] buffer, where the combine stores
    token-major (`_out_row`), and lse [B, Hq, tokens]."""
    B, Hkv, M, D = shape
    if tokens > 1:
        out_shape = (B, Hkv * M // tokens, tokens, D)
    out_shape = out_shape or shape
    if tokens > 1:
        out = torch.empty((B, tokens, out_shape[1], D), dtype=dtype, device=dev).permute(0, 2, 1, 3)
    else:
        out = torch.empty(out_shape, dtype=dtype, device=dev)
    return out, torch.empty(out_shape[:-1], dtype=torch.float32, device=dev)


def like(shape: tuple, dtype: torch.dtype, dev) -> torch.Tensor:
    """A template of a planned call's fresh buffers: `torch.empty_like(like(...))` is a contiguous
    tensor of that shape, dtype and device. One element expanded (it holds no memory of the
    shape's size); empty_like skips parsing a shape, a dtype and a device per call (host time:
    ~1.0 against ~2.5 µs on this project's CPU for an output's empty)."""
    return torch.empty(1, dtype=dtype, device=dev).expand(shape)


def combine_splits(parts: SplitParts, shape: tuple, v_codec, out_dtype: torch.dtype | None = None,
                   *, second: SplitParts | None = None, third: SplitParts | None = None,
                   heads_major: bool = False, out_shape: tuple | None = None, tokens: int = 1,
                   rec: list | None = None):
    """Stage 2 in one launch: merge every split of `parts` (and of `second`, a second pass over
    other keys of the same rows) by log-sum-exp into out [*shape] = [B, Hkv, M, D] (float32, V's
    storage domain; with out_dtype: true space, that dtype) and lse float32 [B, Hkv, M].
    parts' rows are in shape's order, or with heads_major in [Hkv, B, M] order (the cascade's
    prefix pass: all agents of a KV head side by side); second's rows in shape's order.
    third: a pass over yet other keys whose outputs are in true space already (a recent window's
    q8_0 segment), rows in shape's order; needs true-space output (out_dtype) where V is rotated.
    out_shape: out allocated as [*out_shape] and lse as [*out_shape[:-1]] instead, the same
    row-major rows (the caller's [B, Hq, n_q, D]: no reshape per call). tokens > 1 (the rows'
    n_q): out is that [B, Hq, tokens, D] as a view of a token-major [B, tokens, Hq, D] buffer
    (`combine_outputs`) — lse as with out_shape. rec: the launch's plan (None where not planned) is
    appended to it."""
    B, Hkv, M, D = shape
    dev = parts.o.device
    unrot = out_dtype is not None and getattr(v_codec, "rotated", False)
    if third is not None and out_dtype is None and getattr(v_codec, "rotated", False):
        raise ValueError("a true-space third pass needs true-space output (out_dtype)")
    out, lse = combine_outputs(shape, out_dtype or torch.float32, dev, out_shape, tokens)
    s, t = second or parts, third or parts  # never read without their passes
    plan_key = None
    if _plannable(dev):  # parts, out, lse: fresh allocations (aligned)
        plan_key = ("combine", dev.index, tuple(shape), tuple(out.shape), parts.n_splits,
                    second and second.n_splits, third and third.n_splits, _codec_key(v_codec),
                    out_dtype, heads_major, tokens)
        planned = _PLANS.get(plan_key)
        if planned is not None:
            planned(parts.o, parts.lse, s.o, s.lse, t.o, t.lse, out, lse)
            if rec is not None:
                rec.append(planned)
            return out, lse
    rows = B * Hkv * M
    nsp, nss, nst = parts.n_splits, second.n_splits if second else 1, third.n_splits if third else 1
    br = COMBINE_BLOCK_R
    sc = max(1, COMBINE_TILE // (br * D))  # [BLOCK_R, SC, D] float32 tiles
    if (rows >= COMBINE_BLOCK_MIN_ROWS and D in (64, 128, 256)
            and cdiv(nsp, sc) + cdiv(nss, sc) + cdiv(nst, sc) <= 64):
        # many rows (a cascade over many agents): BLOCK_R rows per program, the rotation read
        # once per block and applied on the tensor cores; the split tiles unrolled (<= 64)
        dc = D // COMBINE_COL_PROGRAMS if unrot else D
        kernel, grid, counts = _combine_rows_kernel, (cdiv(rows, br), D // dc), (rows, nsp, nss, nst)
        rot = block_rotation(v_codec.group, D, dev) if unrot else placeholder(dev)
        meta = dict(BLOCK_R=br, SC=sc, NTP=cdiv(nsp, sc), NTS=cdiv(nss, sc), NTT=cdiv(nst, sc),
                    DC=dc, num_warps=COMBINE_WARPS)
    else:
        kernel, grid, counts = _combine_kernel, (rows,), (nsp, nss, nst)
        rot = rotation_matrix(v_codec.group, dev) if unrot else placeholder(dev)
        p2 = lambda n: min(COMBINE_CHUNK, next_pow2(n))  # noqa: E731
        meta = dict(NSP_P2=p2(nsp), NSS_P2=p2(nss), NST_P2=p2(nst), NSP_CH=cdiv(nsp, COMBINE_CHUNK),
                    NSS_CH=cdiv(nss, COMBINE_CHUNK), NST_CH=cdiv(nst, COMBINE_CHUNK),
                    G=v_codec.group if unrot else D)
    if rows:
        planned = cached_launch(
            kernel, grid, parts.o, parts.lse, s.o, s.lse, t.o, t.lse, out, lse, rot,
            *((Hkv, M, B) if heads_major else (1, 1, 1)), *counts,
            tokens, Hkv * M // tokens if tokens > 1 else 1, D=D, HAS_S=second is not None,
            HAS_T=third is not None, UNROT=unrot, **meta,
            **({"PDL": True, "launch_pdl": True} if pdl_ok(dev) else {}),
            plan=8 if plan_key is not None else 0)
        if planned is not None:
            _remember(plan_key, planned)
        if rec is not None:
            rec.append(planned)
    return out, lse


@triton.jit
def _prep_q_kernel(Q, S, OUT, ROT, R, HQ, NQ, GQA, sqb, sqh, sqn, D: tl.constexpr,
                   BLOCK_R: tl.constexpr, DC: tl.constexpr, HAS_S: tl.constexpr,
                   ROTATE: tl.constexpr, PDL: tl.constexpr = False):
    # BLOCK_R rows r = (b * HQ + hq) * NQ + j of q [B, HQ, NQ, D] (any strides, last dim 1) ->
    # float32 rows of OUT in the same order ([B, Hkv, GQA * NQ, D] contiguous), divided by the
    # InnerQ scales of the row's KV head and rotated by ROT (block-diagonal M: y = x @ M); with
    # ROTATE, program_id(1) picks the DC output columns this program writes (a decode call has
    # 2-4 row blocks: one program per row block made the preparation a serial chain of dots).
    # PDL (pdl_ok): waits for q's producer, and lets the split pass launch behind it at once
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = r < R
    hq = (r // NQ) % HQ
    d = tl.arange(0, D)
    x = tl.load(Q + ((r // (HQ * NQ)) * sqb + hq * sqh + (r % NQ) * sqn)[:, None] + d[None, :],
                mask=rmask[:, None], other=0.0).to(tl.float32)
    if HAS_S:
        x = x / tl.load(S + (hq // GQA)[:, None] * D + d[None, :])
    if ROTATE:  # on the tensor cores at fp32 accuracy (3 x tf32)
        cols = tl.program_id(1) * DC + tl.arange(0, DC)
        y = tl.dot(x, tl.load(ROT + d[:, None] * D + cols[None, :]), input_precision="tf32x3")
        tl.store(OUT + r[:, None] * D + cols[None, :], y, mask=rmask[:, None])
    else:
        tl.store(OUT + r[:, None] * D + d[None, :], x, mask=rmask[:, None])


_BLOCK_ROT: dict = {}


def block_rotation(group: int, D: int, device) -> torch.Tensor:
    """float32 [D, D]: the per-group rotation M repeated on the diagonal, so x @ it rotates every
    group of a row at once; one per (group, D, device)."""
    key = (group, D, str(device))
    t = _BLOCK_ROT.get(key)
    if t is None:
        t = _BLOCK_ROT[key] = torch.block_diag(*[rotation_matrix(group, device)] * (D // group))
    return t


def prep_q_triton(q: torch.Tensor, k_codec, k_innerq: torch.Tensor | None, hkv: int,
                  rec: list | None = None) -> torch.Tensor:
    """q [B, Hq, n_q, D] -> float32 [B, Hkv, group * n_q, D] contiguous in K's storage domain
    (q / s with InnerQ s [Hkv, D], then rotated when K is a rotated codec) in one launch — the torch
    ops it replaces were four to five launches per attention call. rec: the launch's plan (None
    where not planned) is appended to it."""
    B, Hq, n_q, D = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    dev = q.device
    out = torch.empty(B, hkv, (Hq // hkv) * n_q, D, dtype=torch.float32, device=dev)
    s = (k_innerq.to(device=dev, dtype=torch.float32).contiguous() if k_innerq is not None
         else placeholder(dev))
    plan_key = None
    if _plannable(dev):
        plan_key = ("prep_q", dev.index, _tkey(q), _tkey(s), _codec_key(k_codec), hkv)
        planned = _PLANS.get(plan_key)
        if planned is not None:
            planned(q, s, out)
            if rec is not None:
                rec.append(planned)
            return out
    rotated = getattr(k_codec, "rotated", False)
    R = B * Hq * n_q
    if R:
        planned = cached_launch(
            _prep_q_kernel, (cdiv(R, 16), D // min(D, 32) if rotated else 1), q, s, out,
            block_rotation(k_codec.group, D, dev) if rotated else placeholder(dev),
            R, Hq, n_q, Hq // hkv, q.stride(0), q.stride(1), q.stride(2), D=D, BLOCK_R=16,
            DC=min(D, 32), HAS_S=k_innerq is not None, ROTATE=rotated,
            **({"PDL": True, "launch_pdl": True} if pdl_ok(dev) else {}), plan=3 if plan_key else 0)
        if planned is not None:
            _remember(plan_key, planned)
    else:
        planned = None
    if rec is not None:
        rec.append(planned)
    return out


class CallPlan(NamedTuple):
    """One eager decode call (`dispatch.attention_decode`) as its planned launches, kept under one
    key of the whole call (`_CALLS`): a repeated call builds that key, allocates its buffers and
    launches — no per-launch keys, no launch arithmetic (issue F: host time per eager call).
    prep: the turbo-K query preparation (q, s, out) or None (q is viewed as the query rows)."""

    prep: launch_mod.Planned | None
    split: _DecodePlan
    combine: launch_mod.Planned
    qp_shape: tuple  # [B, Hkv, M, D]
    likes: tuple  # `like` templates of qp (float32; None without prep), out [B, Hq, n_q, D], lse

    @classmethod
    def of(cls, rec: list, qp_shape: tuple, out_shape: tuple, out_dtype: torch.dtype,
           prep: bool, dev) -> "CallPlan | None":
        """The call plan of a full-path call whose launches recorded `rec` (prep, split, combine,
        or split, combine); None if one of them was not planned."""
        if len(rec) != 2 + prep or any(p is None for p in rec):
            return None
        likes = (like(qp_shape, torch.float32, dev) if prep else None, like(out_shape, out_dtype, dev),
                 like(out_shape[:-1], torch.float32, dev))
        return cls(rec[0] if prep else None, rec[-2], rec[-1], qp_shape, likes)

    def __call__(self, q: torch.Tensor, k: Packed, v: Packed, lens: torch.Tensor,
                 s: torch.Tensor | None, kv_start: torch.Tensor | None):
        """What the full path computes for these tensors (the same launches, buffers and order):
        (out [*out_shape] out_dtype, lse float32 [*out_shape[:-1]])."""
        qp_like, out_like, lse_like = self.likes
        parts = self.split(planned_rows(self.prep, q, s, self.qp_shape, qp_like), k, v, lens, kv_start)
        out, lse = torch.empty_like(out_like), torch.empty_like(lse_like)
        self.combine(parts.o, parts.lse, parts.o, parts.lse, parts.o, parts.lse, out, lse)
        return out, lse


def planned_rows(prep: launch_mod.Planned | None, q: torch.Tensor, s: torch.Tensor | None,
                 qp_shape: tuple, qp_like: torch.Tensor | None = None) -> torch.Tensor:
    """A planned call's query rows [*qp_shape] in K's domain, as `prep_q_triton` (prep: its
    planned launch; qp_like: the rows' `like` template, float32) or dispatch's plain view of q
    (prep None) make them — for the planned launches, which take their address only: a contiguous
    q (prep None) is returned as it is, its memory being those rows (host time: no view per
    call)."""
    if prep is None:
        return q if q.is_contiguous() else q.reshape(qp_shape).contiguous()
    dev = q.device
    qp = torch.empty_like(qp_like)
    prep(q if q.stride(-1) == 1 else q.contiguous(),
         placeholder(dev) if s is None else s.to(device=dev, dtype=torch.float32).contiguous(), qp)
    return qp


_CALLS: dict = {}
"""Planned eager calls, keyed by dispatch: attention_decode's `CallPlan`s and cascade_attention's
planned calls."""


# ----------------------------------------------------------------------------- v5: phase tiles

@triton.jit
def _zeros_tuple(N: tl.constexpr, BM: tl.constexpr, W: tl.constexpr):
    z = (tl.zeros([BM, W], tl.float32),)
    for _ in tl.static_range(N - 1):
        z = z + (tl.zeros([BM, W], tl.float32),)
    return z


@triton.jit
def _tile_factors(S, off, nmask, KIND: tl.constexpr, N: tl.constexpr):
    """The per-row factors of one key tile, fp16 [BLOCK_N] each, as a tuple: element 1 + i is
    factor i of row n at S + off[n] + i, i < N (KIND 1 / 2: q8_0 / q4_0 block scales; 3: turbo
    group norms; 0: none). Element 0 is an unused zero vector: a loop-carried tuple of one
    element would come back from the loop as a bare tensor."""
    f = (tl.zeros(off.shape, tl.float16),)
    if KIND != 0:
        for i in tl.static_range(N):
            f = f + (tl.load(S + off + i, mask=nmask, other=0.0),)
    return f


@triton.jit
def _phase_decode_kernel(
        Q, KC, KS, VC, VS, KCENT, VCENT, KV_LENS, KV_START, PT, O_PART, L_PART, QSHIFT,
        skb, skh, sks, sksb, sksh, skss,
        svb, svh, svs, svsb, svsh, svss,
        HKV, M_TOTAL, N_Q, SPLIT_LEN, N_SPLITS, SPLIT0, qk_scale, WINDOW, PT_STRIDE,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_NG: tl.constexpr,
        K_NPH: tl.constexpr, K_NSB: tl.constexpr, K_PW: tl.constexpr, K_DEC: tl.constexpr,
        V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_NG: tl.constexpr,
        V_NPH: tl.constexpr, V_NSB: tl.constexpr, V_PW: tl.constexpr, V_DEC: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_START: tl.constexpr,
        HAS_QSHIFT: tl.constexpr,
        KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr,
        KA4: tl.constexpr, KA5: tl.constexpr, KA6: tl.constexpr, KA7: tl.constexpr,
        VA0: tl.constexpr, VA1: tl.constexpr, VA2: tl.constexpr, VA3: tl.constexpr,
        VA4: tl.constexpr, VA5: tl.constexpr, VA6: tl.constexpr, VA7: tl.constexpr,
        PDL: tl.constexpr = False):
    """Same contract as _decode_kernel, computed transposed: scores sT [BLOCK_N keys, BLOCK_M rows]
    = K_tile @ q^T and out^T [D, rows] += V_tile^T @ P^T, so the query rows sit on the mma's
    small N dimension (a GQA group of 4 pads to 8, not 16) and the decoded K / V tiles are the A
    operand. K and V are read as phase tiles (triton_codec.phase_tile): each tile is decoded in
    registers straight into the operand layout. q / output columns in natural order.
    PDL: launched as a programmatic dependent (`pdl_ok`): waits for the previous kernel's writes
    before its first load, and lets the combine that follows launch at once."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    K_NP: tl.constexpr = K_NG * K_NPH * K_NSB
    V_NP: tl.constexpr = V_NG * V_NPH * V_NSB

    kv_len, kv_start, start, end, q_end = _split_bounds(
        KV_LENS, KV_START, QSHIFT, b, pid_s, SPLIT_LEN, BLOCK_N, HAS_START, HAS_QSHIFT, HAS_WINDOW,
        N_Q, WINDOW)

    rmask, q_rows, qpos = _query_rows(pid_bh, pid_m, BLOCK_M, M_TOTAL, N_Q, q_end)

    # q^T phases [K_PW, BLOCK_M] fp16, loaded once
    kw = tl.arange(0, K_PW)
    qs = (tl.load(Q + q_rows[None, :] * D + kw[:, None], mask=rmask[None, :],
                  other=0.0).to(tl.float16),)
    for fp in tl.static_range(1, K_NP):
        qs = qs + (tl.load(Q + q_rows[None, :] * D + (fp * K_PW + kw)[:, None],
                           mask=rmask[None, :], other=0.0).to(tl.float16),)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    accs = _zeros_tuple(V_NP, V_PW, BLOCK_M)

    kbase = b.to(tl.int64) * skb + h.to(tl.int64) * skh
    ksbase = b.to(tl.int64) * sksb + h.to(tl.int64) * sksh
    vbase = b.to(tl.int64) * svb + h.to(tl.int64) * svh
    vsbase = b.to(tl.int64) * svsb + h.to(tl.int64) * svsh

    # the per-row factors (block scales, norms) are 2-byte loads too narrow for Triton's cp.async
    # pipeline: each tile's are loaded one iteration ahead, into registers, so their memory
    # latency overlaps the previous tile's work instead of stalling every tile
    K_NF: tl.constexpr = K_NG if K_KIND == 3 else K_NP
    V_NF: tl.constexpr = V_NG if V_KIND == 3 else V_NP
    offs_f = start + tl.arange(0, BLOCK_N)
    on_f = _row_index(PT, PT_STRIDE, b, tl.maximum(tl.minimum(start, end - 1), 0), offs_f, PAGE, BLOCK_N)
    kf = _tile_factors(KS, ksbase + on_f * skss, offs_f < end, K_KIND, K_NF)
    vf = _tile_factors(VS, vsbase + on_f * svss, offs_f < end, V_KIND, V_NF)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        on = _row_index(PT, PT_STRIDE, b, n0, offs_n, PAGE, BLOCK_N)
        m2 = nmask[:, None]
        kf_t = kf
        vf_t = vf
        offs_f = offs_n + BLOCK_N
        on_f = _row_index(PT, PT_STRIDE, b, tl.minimum(n0 + BLOCK_N, end - 1), offs_f, PAGE, BLOCK_N)
        kf = _tile_factors(KS, ksbase + on_f * skss, offs_f < end, K_KIND, K_NF)
        vf = _tile_factors(VS, vsbase + on_f * svss, offs_f < end, V_KIND, V_NF)
        # ---- scores: per phase dot; factor per scale block (q8_0/q4_0) or per group (turbo)
        k_row = (kbase + on * sks)[:, None]
        s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for g in tl.static_range(K_NG):
            sg = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for ph in tl.static_range(K_NPH):
                for sb in tl.static_range(K_NSB):
                    kt = phase_tile(KC, KCENT, k_row, m2, g, ph, sb, D, K_KIND, K_BITS, K_G, K_PW,
                                    K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7)
                    kq = qs[(g * K_NPH + ph) * K_NSB + sb]
                    if K_KIND == 1 or K_KIND == 2:
                        sc = kf_t[1 + (g * K_NPH + ph) * K_NSB + sb].to(tl.float32)
                        s += tl.dot(kt, kq) * sc[:, None]
                    else:
                        sg = tl.dot(kt, kq, sg)
            if K_KIND == 3:
                s += sg * kf_t[1 + g].to(tl.float32)[:, None]
            elif K_KIND == 0:
                s += sg
        s = s * qk_scale
        vis = nmask[:, None] & rmask[None, :]
        if CAUSAL:
            vis = vis & (offs_n[:, None] <= qpos[None, :])
        if HAS_WINDOW:
            vis = vis & (offs_n[:, None] > qpos[None, :] - WINDOW)
        if HAS_START:
            vis = vis & (offs_n[:, None] >= kv_start)
        s = tl.where(vis, s, float("-inf"))
        # ---- online softmax over keys (axis 0)
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        # ---- values: the factor folds into P (per group for turbo, per block for q8_0/q4_0)
        v_row = (vbase + on * svs)[None, :]
        m2t = nmask[None, :]
        for i in tl.static_range(V_NP):
            vg = i // (V_NPH * V_NSB)
            vph = (i // V_NSB) % V_NPH
            vsb = i % V_NSB
            if V_KIND == 3:
                if i % (V_NPH * V_NSB) == 0:  # once per group
                    pg = (p * vf_t[1 + i // (V_NPH * V_NSB)].to(tl.float32)[:, None]).to(tl.float16)
                pb = pg
            elif V_KIND == 0:
                pb = p.to(tl.float16)
            else:
                pb = (p * vf_t[1 + i].to(tl.float32)[:, None]).to(tl.float16)
            vt = phase_tile(VC, VCENT, v_row, m2t, vg, vph, vsb, D, V_KIND, V_BITS, V_G, V_PW,
                            V_DEC, VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7, TRANS=True)
            accs = accs[:i] + (tl.dot(vt, pb, accs[i] * alpha[None, :]),) + accs[i + 1:]

    inv, prow = _store_split_lse(m_i, l_i, L_PART, q_rows, rmask, N_SPLITS, SPLIT0 + pid_s)
    vw = tl.arange(0, V_PW)
    for fp in tl.static_range(V_NP):
        tl.store(O_PART + (prow * D)[None, :] + (fp * V_PW + vw)[:, None],
                 accs[fp] * inv[None, :], mask=rmask[None, :])
