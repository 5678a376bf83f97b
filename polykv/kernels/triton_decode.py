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
from .triton_codec import codec_meta, load_tile, sub_values

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _load_q(Q, q_rows, rmask, K: tl.constexpr, PER: tl.constexpr, C: tl.constexpr,
            D: tl.constexpr, DT: tl.constexpr):
    c = tl.arange(0, C)
    ptr = Q + q_rows[:, None] * D + c[None, :] * PER + K
    return tl.load(ptr, mask=rmask[:, None], other=0.0).to(DT)


@triton.jit
def _store_o(O, o_off, rmask, acc, K: tl.constexpr, PER: tl.constexpr, C: tl.constexpr):
    c = tl.arange(0, C)
    tl.store(O + o_off[:, None] + c[None, :] * PER + K, acc, mask=rmask[:, None])


@triton.jit
def _decode_kernel(
        Q, KC, KS, VC, VS, KCENT, VCENT, KV_LENS, O_PART, L_PART,
        skb, skh, sks, sksb, sksh, skss,
        svb, svh, svs, svsb, svsh, svss,
        HKV, M_TOTAL, N_Q, SPLIT_LEN, N_SPLITS, qk_scale, WINDOW,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_PER: tl.constexpr,
        V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_PER: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_BF16: tl.constexpr,
        LUT: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    DT: tl.constexpr = tl.bfloat16 if DOT_BF16 else tl.float16
    CK: tl.constexpr = D // K_PER
    CV: tl.constexpr = D // V_PER

    kv_len = tl.load(KV_LENS + b)
    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, kv_len)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M_TOTAL
    q_rows = pid_bh.to(tl.int64) * M_TOTAL + rows
    qpos = kv_len - N_Q + rows % N_Q

    q0 = _load_q(Q, q_rows, rmask, 0, K_PER, CK, D, DT)
    if K_PER > 1:
        q1 = _load_q(Q, q_rows, rmask, 1, K_PER, CK, D, DT)
    if K_PER > 2:
        q2 = _load_q(Q, q_rows, rmask, 2, K_PER, CK, D, DT)
        q3 = _load_q(Q, q_rows, rmask, 3, K_PER, CK, D, DT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, CV], tl.float32)
    acc1 = tl.zeros([BLOCK_M, CV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, CV], tl.float32)
    acc3 = tl.zeros([BLOCK_M, CV], tl.float32)

    kbase = b.to(tl.int64) * skb + h.to(tl.int64) * skh
    ksbase = b.to(tl.int64) * sksb + h.to(tl.int64) * sksh
    vbase = b.to(tl.int64) * svb + h.to(tl.int64) * svh
    vsbase = b.to(tl.int64) * svsb + h.to(tl.int64) * svsh

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        on = offs_n.to(tl.int64)
        # ---- scores
        kb0, kb1, ksc = load_tile(KC, KS, kbase + on * sks, ksbase + on * skss, nmask, CK,
                                  K_KIND, K_BITS, K_G)
        k0 = sub_values(kb0, kb1, ksc, KCENT, 0, CK, K_KIND, K_BITS, K_G, LUT).to(DT)
        s = tl.dot(q0, tl.trans(k0))
        if K_PER > 1:
            k1 = sub_values(kb0, kb1, ksc, KCENT, 1, CK, K_KIND, K_BITS, K_G, LUT).to(DT)
            s += tl.dot(q1, tl.trans(k1))
        if K_PER > 2:
            k2 = sub_values(kb0, kb1, ksc, KCENT, 2, CK, K_KIND, K_BITS, K_G, LUT).to(DT)
            s += tl.dot(q2, tl.trans(k2))
            k3 = sub_values(kb0, kb1, ksc, KCENT, 3, CK, K_KIND, K_BITS, K_G, LUT).to(DT)
            s += tl.dot(q3, tl.trans(k3))
        s = s * qk_scale
        vis = nmask[None, :] & rmask[:, None]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (offs_n[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(vis, s, float("-inf"))
        # ---- online softmax
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        pd = p.to(DT)
        # ---- values
        vb0, vb1, vsc = load_tile(VC, VS, vbase + on * svs, vsbase + on * svss, nmask, CV,
                                  V_KIND, V_BITS, V_G)
        v0 = sub_values(vb0, vb1, vsc, VCENT, 0, CV, V_KIND, V_BITS, V_G, LUT).to(DT)
        acc0 = acc0 * alpha[:, None] + tl.dot(pd, v0)
        if V_PER > 1:
            v1 = sub_values(vb0, vb1, vsc, VCENT, 1, CV, V_KIND, V_BITS, V_G, LUT).to(DT)
            acc1 = acc1 * alpha[:, None] + tl.dot(pd, v1)
        if V_PER > 2:
            v2 = sub_values(vb0, vb1, vsc, VCENT, 2, CV, V_KIND, V_BITS, V_G, LUT).to(DT)
            acc2 = acc2 * alpha[:, None] + tl.dot(pd, v2)
            v3 = sub_values(vb0, vb1, vsc, VCENT, 3, CV, V_KIND, V_BITS, V_G, LUT).to(DT)
            acc3 = acc3 * alpha[:, None] + tl.dot(pd, v3)

    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    prow = q_rows * N_SPLITS + pid_s
    tl.store(L_PART + prow, lse, mask=rmask)
    o_off = prow * D
    _store_o(O_PART, o_off, rmask, acc0 * inv[:, None], 0, V_PER, CV)
    if V_PER > 1:
        _store_o(O_PART, o_off, rmask, acc1 * inv[:, None], 1, V_PER, CV)
    if V_PER > 2:
        _store_o(O_PART, o_off, rmask, acc2 * inv[:, None], 2, V_PER, CV)
        _store_o(O_PART, o_off, rmask, acc3 * inv[:, None], 3, V_PER, CV)


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
    return {64: 64, 128: 64, 256: 32, 512: 16}.get(d, 16)


def _dummy(device):
    return torch.zeros(1, dtype=torch.float32, device=device)


_SMS: dict = {}


def num_programs_target(device) -> int:
    if device.type == "cuda":
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in _SMS:
            _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
        return 4 * _SMS[key]
    return 4  # interpreter: keep the program count small but exercise several splits


def decode_prepared(qp: torch.Tensor, n_q: int, k: Packed, v: Packed, k_codec, v_codec,
                    kv_lens: torch.Tensor, *, causal: bool, window: int | None, sm_scale: float,
                    block_m_max: int = 64, target_programs: int | None = None,
                    num_warps: int | None = None, num_stages: int = 2, block_n: int | None = None,
                    lut: str = "select"):
    """qp: float32 [B, Hkv, M, D] contiguous, already in K's storage domain (rotated / InnerQ-
    divided), rows r = head_in_group * n_q + j. k, v: Packed leading [B or 1, Hkv, S_cap].
    Returns out float32 [B, Hkv, M, D] in V's storage domain, lse float32 [B, Hkv, M]."""
    B, Hkv, M, D = qp.shape
    dev = qp.device
    km, vm = codec_meta(k_codec), codec_meta(v_codec)
    S = k.codes.shape[2]
    kc, ks, kcs, kss = _strides(k, k.codes.shape[0] == 1 and B > 1)
    vc, vs, vcs, vss = _strides(v, v.codes.shape[0] == 1 and B > 1)
    kcent = k_codec.tables(dev)[0] if km["KIND"] == 3 else _dummy(dev)
    vcent = v_codec.tables(dev)[0] if vm["KIND"] == 3 else _dummy(dev)
    bf16 = False  # fp16 operands: bf16 K/V values convert exactly within fp16 range
    BLOCK_M = max(16, min(block_m_max, triton.next_power_of_2(M)))
    n_mt = triton.cdiv(M, BLOCK_M)
    # measured on H200 (docs/kernels_notes.md v3): decode tiles (<= 16 rows) like BLOCK_N 128 at
    # head_dim <= 128; the 128-row cascade prefix tile likes 64
    BLOCK_N = block_n or (128 if BLOCK_M <= 16 and D <= 128 else _block_n(D))
    if num_warps is None:
        num_warps = 8 if BLOCK_M >= 64 else 4
    target = target_programs or num_programs_target(dev)
    max_splits = max(1, triton.cdiv(S, BLOCK_N))
    n_splits = max(1, min(max_splits, triton.cdiv(target, B * Hkv * n_mt)))
    split_len = triton.cdiv(triton.cdiv(S, n_splits), BLOCK_N) * BLOCK_N
    n_splits = max(1, triton.cdiv(S, split_len))
    o_part = torch.empty(B * Hkv * M * n_splits * D, dtype=torch.float32, device=dev)
    l_part = torch.empty(B * Hkv * M * n_splits, dtype=torch.float32, device=dev)
    grid = (B * Hkv, n_splits, n_mt)
    _decode_kernel[grid](
        qp, kc, ks, vc, vs, kcent, vcent, kv_lens, o_part, l_part,
        *kcs, *kss, *vcs, *vss,
        Hkv, M, n_q, split_len, n_splits, sm_scale * LOG2E, int(window or 0),
        D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        K_KIND=km["KIND"], K_BITS=km["BITS"], K_G=km["G"], K_PER=km["PER"],
        V_KIND=vm["KIND"], V_BITS=vm["BITS"], V_G=vm["G"], V_PER=vm["PER"],
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, DOT_BF16=bf16, LUT=lut == "select",
        num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(B, Hkv, M, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B, Hkv, M, dtype=torch.float32, device=dev)
    _combine_kernel[(B * Hkv * M,)](o_part, l_part, out, lse, n_splits, D=D,
                                    NS_P2=triton.next_power_of_2(n_splits))
    return out, lse
