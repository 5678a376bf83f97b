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

import torch
import triton
import triton.language as tl

from ..codecs import Packed
from .triton_codec import asm_ok, asm_strings, codec_meta, load_tile, perm_cols, placeholder

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _load_q(Q, q_rows, rmask, g: tl.constexpr, GW: tl.constexpr, NPH: tl.constexpr,
            D: tl.constexpr):
    cols = g * GW + perm_cols(GW, NPH)
    ptr = Q + q_rows[:, None] * D + cols[None, :]
    return tl.load(ptr, mask=rmask[:, None], other=0.0).to(tl.float16)


@triton.jit
def _store_o(O, o_off, rmask, acc, g: tl.constexpr, GW: tl.constexpr, NPH: tl.constexpr):
    cols = g * GW + perm_cols(GW, NPH)
    tl.store(O + o_off[:, None] + cols[None, :], acc, mask=rmask[:, None])


@triton.jit
def _norm(SCALES, srow_off, nmask, g: tl.constexpr):
    return tl.load(SCALES + srow_off + g, mask=nmask, other=0.0).to(tl.float32)


@triton.jit
def _kdot(q, KC, KS, KCENT, k_off, ks_off, nmask, g: tl.constexpr, BLOCK_N: tl.constexpr,
          D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
          GW: tl.constexpr, NPH: tl.constexpr, DEC: tl.constexpr,
          A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
          A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr):
    k = load_tile(KC, KS, KCENT, k_off, ks_off, nmask, g, BLOCK_N, D, KIND, BITS, G, GW, NPH,
                  DEC, A0, A1, A2, A3, A4, A5, A6, A7)
    s = tl.dot(q, tl.trans(k))
    if KIND == 3:
        s = s * _norm(KS, ks_off, nmask, g)[None, :]
    return s


@triton.jit
def _pv(acc, alpha, p, VC, VS, VCENT, v_off, vs_off, nmask, g: tl.constexpr,
        BLOCK_N: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
        G: tl.constexpr, GW: tl.constexpr, NPH: tl.constexpr, DEC: tl.constexpr,
        A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
        A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr):
    v = load_tile(VC, VS, VCENT, v_off, vs_off, nmask, g, BLOCK_N, D, KIND, BITS, G, GW, NPH,
                  DEC, A0, A1, A2, A3, A4, A5, A6, A7)
    if KIND == 3:  # fold the per-token norm into P: the V tile is centroids only
        pd = (p * _norm(VS, vs_off, nmask, g)[None, :]).to(tl.float16)
    else:
        pd = p.to(tl.float16)
    return acc * alpha[:, None] + tl.dot(pd, v)


@triton.jit
def _decode_kernel(
        Q, KC, KS, VC, VS, KCENT, VCENT, KV_LENS, KV_START, PT, O_PART, L_PART,
        skb, skh, sks, sksb, sksh, skss,
        svb, svh, svs, svsb, svsh, svss,
        HKV, M_TOTAL, N_Q, SPLIT_LEN, N_SPLITS, qk_scale, WINDOW, PT_STRIDE,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_GW: tl.constexpr,
        K_NPH: tl.constexpr, K_DEC: tl.constexpr,
        V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_GW: tl.constexpr,
        V_NPH: tl.constexpr, V_DEC: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_START: tl.constexpr,
        KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr,
        KA4: tl.constexpr, KA5: tl.constexpr, KA6: tl.constexpr, KA7: tl.constexpr,
        VA0: tl.constexpr, VA1: tl.constexpr, VA2: tl.constexpr, VA3: tl.constexpr,
        VA4: tl.constexpr, VA5: tl.constexpr, VA6: tl.constexpr, VA7: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    NGK: tl.constexpr = D // K_GW
    NGV: tl.constexpr = D // V_GW

    kv_len = tl.load(KV_LENS + b)
    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, kv_len)
    if HAS_START:  # left padding: rows before kv_start are not keys of this sequence
        kv_start = tl.load(KV_START + b)
        start = tl.maximum(start, (kv_start // BLOCK_N) * BLOCK_N)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M_TOTAL
    q_rows = pid_bh.to(tl.int64) * M_TOTAL + rows
    qpos = kv_len - N_Q + rows % N_Q

    # q in the K tiles' column order (triton_codec.perm_cols), loaded once per program
    q0 = _load_q(Q, q_rows, rmask, 0, K_GW, K_NPH, D)
    if NGK > 1:
        q1 = _load_q(Q, q_rows, rmask, 1, K_GW, K_NPH, D)
    if NGK > 2:
        q2 = _load_q(Q, q_rows, rmask, 2, K_GW, K_NPH, D)
        q3 = _load_q(Q, q_rows, rmask, 3, K_GW, K_NPH, D)

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
        if PAGE > 0:  # paged rows: a tile never straddles a page (PAGE % BLOCK_N == 0)
            page = tl.load(PT + b.to(tl.int64) * PT_STRIDE + n0 // PAGE).to(tl.int64)
            on = page * PAGE + (n0 % PAGE) + tl.arange(0, BLOCK_N).to(tl.int64)
        else:
            on = offs_n.to(tl.int64)
        k_off = kbase + on * sks
        ks_off = ksbase + on * skss
        # ---- scores
        s = _kdot(q0, KC, KS, KCENT, k_off, ks_off, nmask, 0, BLOCK_N, D, K_KIND, K_BITS, K_G,
                  K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7)
        if NGK > 1:
            s += _kdot(q1, KC, KS, KCENT, k_off, ks_off, nmask, 1, BLOCK_N, D, K_KIND, K_BITS,
                       K_G, K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7)
        if NGK > 2:
            s += _kdot(q2, KC, KS, KCENT, k_off, ks_off, nmask, 2, BLOCK_N, D, K_KIND, K_BITS,
                       K_G, K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7)
            s += _kdot(q3, KC, KS, KCENT, k_off, ks_off, nmask, 3, BLOCK_N, D, K_KIND, K_BITS,
                       K_G, K_GW, K_NPH, K_DEC, KA0, KA1, KA2, KA3, KA4, KA5, KA6, KA7)
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
        vs_off = vsbase + on * svss
        acc0 = _pv(acc0, alpha, p, VC, VS, VCENT, v_off, vs_off, nmask, 0, BLOCK_N, D, V_KIND,
                   V_BITS, V_G, V_GW, V_NPH, V_DEC, VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7)
        if NGV > 1:
            acc1 = _pv(acc1, alpha, p, VC, VS, VCENT, v_off, vs_off, nmask, 1, BLOCK_N, D,
                       V_KIND, V_BITS, V_G, V_GW, V_NPH, V_DEC,
                       VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7)
        if NGV > 2:
            acc2 = _pv(acc2, alpha, p, VC, VS, VCENT, v_off, vs_off, nmask, 2, BLOCK_N, D,
                       V_KIND, V_BITS, V_G, V_GW, V_NPH, V_DEC,
                       VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7)
            acc3 = _pv(acc3, alpha, p, VC, VS, VCENT, v_off, vs_off, nmask, 3, BLOCK_N, D,
                       V_KIND, V_BITS, V_G, V_GW, V_NPH, V_DEC,
                       VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7)

    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    prow = q_rows * N_SPLITS + pid_s
    tl.store(L_PART + prow, lse, mask=rmask)
    o_off = prow * D
    _store_o(O_PART, o_off, rmask, acc0 * inv[:, None], 0, V_GW, V_NPH)
    if NGV > 1:
        _store_o(O_PART, o_off, rmask, acc1 * inv[:, None], 1, V_GW, V_NPH)
    if NGV > 2:
        _store_o(O_PART, o_off, rmask, acc2 * inv[:, None], 2, V_GW, V_NPH)
        _store_o(O_PART, o_off, rmask, acc3 * inv[:, None], 3, V_GW, V_NPH)


@triton.jit
def _combine_kernel(O_PART, L_PART, OUT, LSE, N_SPLITS, D: tl.constexpr, NS_P2: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, NS_P2)
    smask = sp < N_SPLITS
    lse = tl.load(L_PART + r * N_SPLITS + sp, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty splits
    tot = tl.sum(w, 0)
    d = tl.arange(0, D)
    o = tl.load(O_PART + (r * N_SPLITS + sp)[:, None] * D + d[None, :], mask=smask[:, None],
                other=0.0)
    den = tl.where(tot > 0, tot, 1.0)
    out = tl.sum(o * w[:, None], 0) / den
    tl.store(OUT + r * D + d, out)
    tl.store(LSE + r, tl.where(tot > 0, m_safe + tl.log(den), float("-inf")))


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


_ASM_BROKEN: set = set()  # (k kind/bits, v kind/bits) whose inline-asm build failed here


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def decode_prepared(qp: torch.Tensor, n_q: int, k: Packed, v: Packed, k_codec, v_codec,
                    kv_lens: torch.Tensor, *, causal: bool, window: int | None, sm_scale: float,
                    block_m_max: int = 64, target_programs: int | None = None,
                    num_warps: int | None = None, num_stages: int = 2, block_n: int | None = None,
                    dec: str = "auto", lut: str | None = None,
                    page_table: torch.Tensor | None = None, page_size: int = 0,
                    kv_start: torch.Tensor | None = None):
    """qp: float32 [B, Hkv, M, D] contiguous, already in K's storage domain (rotated / InnerQ-
    divided), rows r = head_in_group * n_q + j. k, v: Packed leading [B or 1, Hkv, S_cap].
    dec: "asm" (PTX byte-permute lookup, CUDA only), "select" (plain Triton), "auto" (asm where it
    applies and builds). page_table int32 [B, max_pages] (with page_size): k, v are a page pool
    (leading [1, Hkv, rows]) and row n of sequence b lives at page_table[b, n // page_size] *
    page_size + n % page_size. kv_start int32 [B]: rows before it are left padding, never keys.
    Returns out float32 [B, Hkv, M, D] in V's storage domain, lse
    float32 [B, Hkv, M]."""
    B, Hkv, M, D = qp.shape
    dev = qp.device
    km, vm = codec_meta(k_codec), codec_meta(v_codec)
    S = k.codes.shape[2] if page_table is None else page_table.shape[1] * page_size
    kc, ks, kcs, kss = _strides(k, k.codes.shape[0] == 1 and B > 1)
    vc, vs, vcs, vss = _strides(v, v.codes.shape[0] == 1 and B > 1)
    kcent = k_codec.tables(dev)[0] if km["KIND"] == 3 else placeholder(dev)
    vcent = v_codec.tables(dev)[0] if vm["KIND"] == 3 else placeholder(dev)
    BLOCK_M = max(16, min(block_m_max, triton.next_power_of_2(M)))
    n_mt = triton.cdiv(M, BLOCK_M)
    BLOCK_N = block_n or (128 if BLOCK_M <= 16 and D <= 128 else _block_n(D))
    if num_warps is None:
        num_warps = 4  # H200 v4 sweep: 4 beat 8 for the 16-row decode and the 64/128-row cascade
    # every byte chunk [BLOCK_N, W] must give each thread >= 4 elements (no replicated tiny tiles;
    # the inline-asm lookup packs 4): raise BLOCK_N where a chunk would be too small
    w_min = min(km["GW"] // km["NPH"], vm["GW"] // vm["NPH"])
    n_min = triton.next_power_of_2(triton.cdiv(4 * 32 * num_warps, w_min))
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
        page_table, pt_stride = kv_lens, 0
    target = target_programs or num_programs_target(dev)
    max_splits = max(1, triton.cdiv(S, BLOCK_N))
    n_splits = max(1, min(max_splits, triton.cdiv(target, B * Hkv * n_mt)))
    split_len = triton.cdiv(triton.cdiv(S, n_splits), BLOCK_N) * BLOCK_N
    n_splits = max(1, triton.cdiv(S, split_len))
    o_part = torch.empty(B * Hkv * M * n_splits * D, dtype=torch.float32, device=dev)
    l_part = torch.empty(B * Hkv * M * n_splits, dtype=torch.float32, device=dev)
    grid = (B * Hkv, n_splits, n_mt)
    key = (km["KIND"], km["BITS"], vm["KIND"], vm["BITS"])
    use_asm = (dec != "select" and dev.type == "cuda" and not _interpreting()
               and key not in _ASM_BROKEN)
    if dec == "asm" and not use_asm and key not in _ASM_BROKEN and dev.type == "cuda":
        raise RuntimeError("dec='asm' needs compiled CUDA (not the interpreter)")
    k_dec = int(use_asm and asm_ok(k_codec, BLOCK_N, num_warps))
    v_dec = int(use_asm and asm_ok(v_codec, BLOCK_N, num_warps))
    ka = asm_strings(k_codec) if k_dec else ("",) * 8
    va = asm_strings(v_codec) if v_dec else ("",) * 8

    def launch(kd, vd, ka, va):
        _decode_kernel[grid](
            qp, kc, ks, vc, vs, kcent, vcent, kv_lens,
            kv_lens if kv_start is None else kv_start.to(device=dev, dtype=torch.int32),
            page_table, o_part, l_part,
            *kcs, *kss, *vcs, *vss,
            Hkv, M, n_q, split_len, n_splits, sm_scale * LOG2E, int(window or 0), pt_stride,
            D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE=int(page_size) if paged else 0,
            K_KIND=km["KIND"], K_BITS=km["BITS"], K_G=km["G"], K_GW=km["GW"], K_NPH=km["NPH"],
            K_DEC=kd,
            V_KIND=vm["KIND"], V_BITS=vm["BITS"], V_G=vm["G"], V_GW=vm["GW"], V_NPH=vm["NPH"],
            V_DEC=vd,
            CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_START=kv_start is not None,
            KA0=ka[0], KA1=ka[1], KA2=ka[2], KA3=ka[3], KA4=ka[4], KA5=ka[5], KA6=ka[6],
            KA7=ka[7], VA0=va[0], VA1=va[1], VA2=va[2], VA3=va[3], VA4=va[4], VA5=va[5],
            VA6=va[6], VA7=va[7], num_warps=num_warps, num_stages=num_stages)

    if (k_dec or v_dec) and dec == "auto":
        try:
            launch(k_dec, v_dec, ka, va)
        except Exception:  # an asm build problem on this toolchain: plain Triton from now on
            if torch.cuda.is_current_stream_capturing():
                raise
            _ASM_BROKEN.add(key)
            launch(0, 0, ("",) * 8, ("",) * 8)
    else:
        launch(k_dec, v_dec, ka, va)
    out = torch.empty(B, Hkv, M, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B, Hkv, M, dtype=torch.float32, device=dev)
    _combine_kernel[(B * Hkv * M,)](o_part, l_part, out, lse, n_splits, D=D,
                                    NS_P2=triton.next_power_of_2(n_splits))
    return out, lse
