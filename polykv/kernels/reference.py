"""Pure-torch ground truth for every kernel in this package (DESIGN §4); `cascade_attention_ref`
is also the pool's CPU path (`polykv.pool.attention.cascade_attention` where no Triton kernel runs).

Everything here decodes the packed K/V with the codec (float32, true space; the cascade reads turbo
codecs in their storage domain, see Cascade) and runs plain softmax attention; the Triton kernels
must agree with these functions on the same packed data.

Conventions
    q        [B, Hq, n_q, D] true space (f16 / bf16 / f32)
    k, v     Packed with leading dims [B, Hkv, S_cap]
    kv_lens  int [B] valid lengths (default S_cap)
    GQA      query head h reads KV head h // (Hq / Hkv) (repeat_interleave order)
    causal   query j of sequence b sits at position kv_lens[b] - n_q + j and sees keys at positions
             <= it; causal=False: every valid key is visible (a shared prefix)
    window   W: additionally only keys at positions > qpos - W
    kv_start int [B] (decode): rows before kv_start[b] are left padding, never keys
    k_innerq float32 [Hkv, D]: keys were stored as K * s, queries use q / s
    returns  out [B, Hq, n_q, D] in q.dtype, lse float32 [B, Hq, n_q] (natural log of
             sum exp(score * sm_scale)); a query that sees no key gets out 0 and lse -inf.

Cascade (`cascade_attention_ref`: N agents over one shared prefix, merged by LSE)
    q            [N, Hq, n_q, D]; query j of agent n sits at suffix position
                 suffix_lens[n] - n_q + j (positions < 0 are left padding, rows unspecified)
    prefix_k/v   Packed leading [1, Hkv, P] (P = 0 legal), shared: decoded once per call into one
                 [Hkv, P, D] workspace for all agents, never copied per agent; without a window
                 every prefix row is visible to every query
    suffix_k/v   Packed leading [N, Hkv, S_cap], dense (paged callers gather first:
                 `dispatch.gather_pages`); suffix_lens int [N] (0 legal), causal within the suffix
    window       W, for sliding-window layers, on absolute positions: prefix row i sits at
                 prefix_start + i, suffix row j at prefix_end + j (prefix_end defaults to
                 prefix_start + P; a sliding layer keeps only the last W-1 document rows); a query
                 at absolute position a sees keys at positions in (a - W, a]
    domain       a turbo codec is read in its storage domain: q / s rotated once, rows are
                 centroid x norm (no inverse rotation per row), the merged output inverse-rotated
                 once (the rotation is orthogonal: the true-space result up to float rounding)
    memory       agents are taken in chunks (and one agent's query rows too, for a long prompt) so
                 that one score block holds at most _SCORE_BUDGET float32 elements; each agent
                 chunk's suffix rows are decoded once
    returns      as above: out [N, Hq, n_q, D] (q.dtype; merged in float32, cast once), lse
                 float32 [N, Hq, n_q]; a query that sees no key gets out 0 and lse -inf
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..codecs import Codec, Packed, get_codec

_SCORE_BUDGET = 1 << 23  # float32 elements of one cascade score block (32 MiB), whatever N is


def as_codec(codec, head_dim: int) -> Codec:
    """Accept a Codec or a type name."""
    return get_codec(codec, head_dim) if isinstance(codec, str) else codec


def _innerq_q(q: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """q [B, Hq, n, D] float32 -> q / s with s [Hkv, D] repeated over each GQA group."""
    if s is None:
        return q
    s = s.to(device=q.device, dtype=torch.float32)
    s = s.repeat_interleave(q.shape[1] // s.shape[0], 0)
    return q / s[None, :, None, :]


def quantize_ref(x: torch.Tensor, codec, innerq: torch.Tensor | None = None) -> Packed:
    """The codec's encode. innerq s [Hkv, D] scales x [B, Hkv, T, D] as x * s first."""
    codec = as_codec(codec, x.shape[-1])
    if innerq is not None:
        x = x.float() * innerq.to(device=x.device, dtype=torch.float32)[None, :, None, :]
    return codec.encode(x)


def ring_step_ref(ring_k: Packed, ring_v: Packed, k: torch.Tensor, v: torch.Tensor,
                  rows: torch.Tensor, seg_rows: torch.Tensor, real: torch.Tensor,
                  seg_k: Packed, seg_v: Packed) -> None:
    """One forward's rows of a q8_0 recent window (polykv.pool.ring): k, v [G, Hkv, n_q, D] (true
    space) are encoded to q8_0 and stored at ring rows `rows` int64 [G, n_q] of ring_k / ring_v
    (Packed leading [Hkv, ring_rows]; duplicates only at a scratch row); seg_k / seg_v (Packed
    leading [G, Hkv, W]) get the segment: row W - n_q + j is column j's encoding where real bool
    [G, n_q], every other row i is ring row seg_rows[g, i] as it was before this forward's stores.
    In a decode or verify step (R - 1 + n_q <= C: the segment's positions on distinct ring rows,
    every real column stored) that is the ring read back after the stores; a long feed (a prompt
    joining: the ring wraps) overwrites segment rows that it still reads."""
    H = k.shape[1]
    flat = rows.reshape(-1)
    new = real[:, None, :, None]  # [G, 1, n_q, 1]: the real columns among the segment's last n_q rows
    for ring, seg, x in ((ring_k, seg_k, k), (ring_v, seg_v, v)):
        enc = quantize_ref(x, get_codec("q8_0", x.shape[-1]))
        for r, sg, e in ((ring.codes, seg.codes, enc.codes), (ring.scales, seg.scales, enc.scales)):
            old = r[:, seg_rows].permute(1, 0, 2, 3)  # [G, Hkv, W, *], before the stores
            n_q = e.shape[2]
            sg[:, :, : -n_q].copy_(old[:, :, : -n_q])
            sg[:, :, -n_q:].copy_(torch.where(new, e.to(r.dtype), old[:, :, -n_q:]))
            r[:, flat] = e.permute(1, 0, 2, 3).reshape(H, flat.numel(), -1).to(r.dtype)


def ring_indices_ref(slots, lens: torch.Tensor, page_rows: torch.Tensor, page_scratch: int, R: int,
                     C: int, scratch_row: int, off: torch.Tensor | None = None,
                     newest: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The ring rows of one forward of recent windows of R rows in rings of C (polykv.pool.ring):
    agent g (ring slot slots[g] — slots a slice of consecutive slots or integer [G] —, length
    L = lens[g] after the forward, n_q = page_rows.shape[1] columns written to page rows page_rows
    int64 [G, n_q], padding columns to page_scratch) reads the segment of W = R - 1 + n_q positions
    L - W + i, at ring rows gather int64 [G, W] = slot * C + (L - W + i) mod C, and stores column j
    (position L - n_q + j) at rows int64 [G, n_q]: that segment row where real (page row not the
    scratch) and among the newest C columns (j >= n_q - C), else at scratch_row; kv_start int32
    [G] = clamp(W - L, 0, W) (the segment rows before the agent's first); older int32 [G] =
    max(L - R, 0) (the rows before the window). off int64 [W] = i - W and newest bool [n_q] (None:
    every column) may be given precomputed (the pool caches them: each is a kernel in a captured
    step). Returns (gather, rows, kv_start, real bool [G, n_q], older)."""
    n_q = page_rows.shape[1]
    W = R - 1 + n_q
    dev = page_rows.device
    if off is None:
        off = torch.arange(W, device=dev) - W
        newest = None if C >= n_q else torch.arange(n_q, device=dev) >= n_q - C
    if isinstance(slots, slice):
        slots = torch.arange(slots.start or 0, slots.stop, device=dev)
    real = page_rows != page_scratch
    L = lens.to(device=dev, dtype=torch.int64)
    gather = (slots.to(dev) * C)[:, None] + (L[:, None] + off) % C
    keep = real if newest is None else real & newest
    rows = torch.where(keep, gather[:, R - 1:], scratch_row)
    kv_start = (W - L).clamp(0, W).to(torch.int32)
    older = (L - R).clamp_min(0).to(torch.int32)
    return gather, rows, kv_start, real, older


def dequantize_ref(p: Packed, codec, dtype: torch.dtype = torch.float16, *,
                   rotated: bool = False) -> torch.Tensor:
    """Packed -> dense [..., D] in `dtype`; true space, or the storage domain when rotated=True."""
    codec = as_codec(codec, _head_dim(p, codec))
    y = codec.decode_rotated(p) if rotated else codec.decode(p)
    return y.to(dtype)


def _head_dim(p: Packed, codec) -> int:
    if not isinstance(codec, str):
        return codec.head_dim
    raise ValueError("pass a Codec object (a name alone does not carry head_dim for packed input)")


def attention_decode_ref(q: torch.Tensor, k: Packed, v: Packed, k_codec, v_codec, *,
                         kv_lens: torch.Tensor | None = None, causal: bool = True,
                         sm_scale: float | None = None, window: int | None = None,
                         k_innerq: torch.Tensor | None = None,
                         kv_start: torch.Tensor | None = None):
    B, Hq, n_q, D = q.shape
    k_codec = as_codec(k_codec, D)
    v_codec = as_codec(v_codec, D)
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    group = Hq // Hkv
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    dev = q.device
    kd = k_codec.decode(k).float()  # stored keys (K * s when InnerQ), [B, Hkv, S, D]
    vd = v_codec.decode(v).float()
    if kd.shape[0] != B:
        kd = kd.expand(B, -1, -1, -1)
        vd = vd.expand(B, -1, -1, -1)
    kd = kd.repeat_interleave(group, 1)
    vd = vd.repeat_interleave(group, 1)
    qf = _innerq_q(q.float(), k_innerq)
    scores = torch.einsum("bhqd,bhkd->bhqk", qf, kd) * sm_scale  # [B, Hq, n_q, S]
    if kv_lens is None:
        lens = torch.full((B,), S, dtype=torch.long, device=dev)
    else:
        lens = kv_lens.to(device=dev, dtype=torch.long)
    kpos = torch.arange(S, device=dev)
    visible = kpos[None, None, :] < lens[:, None, None]  # [B, 1, S]
    qpos = lens[:, None] - n_q + torch.arange(n_q, device=dev)[None, :]  # [B, n_q]
    visible = visible.expand(B, n_q, S)
    if causal:
        visible = visible & (kpos[None, None, :] <= qpos[:, :, None])
    if window is not None:
        visible = visible & (kpos[None, None, :] > qpos[:, :, None] - int(window))
    if kv_start is not None:  # left padding: rows before kv_start[b] are not keys
        visible = visible & (kpos[None, None, :] >= kv_start.to(device=dev, dtype=torch.long)[:, None, None])
    out, lse = _softmax_av(scores, visible[:, None], vd, "bhqk,bhkd->bhqd")
    return out.to(q.dtype), lse.float()


def _softmax_av(scores: torch.Tensor, visible: torch.Tensor | None, v: torch.Tensor,
                eq: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax(scores) @ v (einsum `eq`) and the LSE; rows with no visible key: out 0,
    lse -inf."""
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing visible
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe[..., None])  # exp(-inf) = 0
    return torch.einsum(eq, p, v), lse


class RecentSegment(NamedTuple):
    """A recent window's segment for `dispatch.cascade_attention(recent=)`: k, v Packed leading
    [N, Hkv, W] in `codec` (q8_0: its queries need no preparation), read causally with `window`
    (the window's R) and kv_start int32 [N] (rows before it are not keys) — what
    `attention_decode_ref(q, k, v, codec, codec, causal=True, window=window, kv_start=kv_start)`
    reads, merged by LSE with the cascade. W = R - 1 + n_q: row i is the agent's suffix position
    L - n_q - R + 1 + i (L its length), so kv_start = max(0, W - L) (polykv.pool.ring).
    real: the lengths L themselves, int32 [N] on kv_start's device, when the caller holds them
    (the pool: once per forward for every layer), else None (`lengths` derives them)."""

    k: Packed
    v: Packed
    codec: Codec
    window: int
    kv_start: torch.Tensor
    real: torch.Tensor | None = None

    def lengths(self, older: torch.Tensor) -> torch.Tensor:
        """The agents' suffix lengths L, int32 [N], from the lengths of their rows older than the
        window (older = max(0, L - R), what the cascade reads besides the segment): L = older + R
        where the segment is all keys (kv_start 0: L >= W >= R), W - kv_start where it starts
        later. Sliding-window layers place their queries against the prefix by L. `real` when
        given (four elementwise kernels fewer per sliding layer and step in a captured pool step)."""
        if self.real is not None:
            return self.real
        w = self.k.shape[2]
        older = older.to(device=self.kv_start.device, dtype=torch.int32)
        return torch.where(self.kv_start > 0, w - self.kv_start, older + self.window).to(torch.int32)


def merge_attention_ref(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                        lse_b: torch.Tensor):
    """Combine two normalized partial attentions over disjoint key sets by log-sum-exp."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    ms = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(la - ms)
    wb = torch.exp(lb - ms)
    tot = wa + wb
    lse = torch.where(tot > 0, ms + torch.log(tot), torch.full_like(m, float("-inf")))
    den = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = (out_a.float() * (wa / den)[..., None] + out_b.float() * (wb / den)[..., None])
    return out.to(out_a.dtype), lse


def cascade_attention_ref(q: torch.Tensor, prefix_k: Packed, prefix_v: Packed, suffix_k: Packed,
                          suffix_v: Packed, suffix_lens: torch.Tensor, k_codec, v_codec, *,
                          sm_scale: float | None = None, k_innerq: torch.Tensor | None = None,
                          window: int | None = None, prefix_start: int = 0,
                          prefix_end: int | None = None, recent: RecentSegment | None = None):
    """Every agent's queries against the shared prefix and its own suffix, merged by LSE (see
    Conventions: Cascade); with recent (a recent window's segment, `RecentSegment`) that segment's
    attention merged in too. Returns out [N, Hq, n_q, D] (q.dtype), lse float32 [N, Hq, n_q]."""
    if recent is not None:
        kw = dict(sm_scale=sm_scale, k_innerq=k_innerq, window=window, prefix_start=prefix_start,
                  prefix_end=prefix_end)
        if window is None:
            out, lse = cascade_attention_ref(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens,
                                             k_codec, v_codec, **kw)
        else:
            # a sliding layer: the prefix within the window of each query's real position (a
            # cascade without suffix rows, placed by the agents' lengths), then the suffix rows
            # older than the segment within the rest of the window (W - R)
            none = (slice(None), slice(None), slice(0, 0))
            out, lse = cascade_attention_ref(q, prefix_k, prefix_v, suffix_k.index(none),
                                             suffix_v.index(none), recent.lengths(suffix_lens),
                                             k_codec, v_codec, **kw)
            out_s, lse_s = attention_decode_ref(q, suffix_k, suffix_v, k_codec, v_codec,
                                                kv_lens=suffix_lens, causal=True, sm_scale=sm_scale,
                                                window=int(window) - recent.window, k_innerq=k_innerq)
            out, lse = merge_attention_ref(out, lse, out_s, lse_s)
        out_r, lse_r = attention_decode_ref(q, recent.k, recent.v, recent.codec, recent.codec,
                                            causal=True, sm_scale=sm_scale, window=recent.window,
                                            kv_start=recent.kv_start)
        return merge_attention_ref(out, lse, out_r, lse_r)
    N, Hq, n_q, D = q.shape
    kc, vc = as_codec(k_codec, D), as_codec(v_codec, D)
    Hkv, P = prefix_k.shape[1], prefix_k.shape[2]
    if prefix_k.shape[0] != 1:
        raise ValueError(f"the prefix is shared: leading [1, Hkv, P], got {tuple(prefix_k.shape)}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    S = suffix_k.shape[2] if suffix_k.shape[0] else 0
    g = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    dev = q.device
    qf = _innerq_q(q.float(), k_innerq)
    if kc.rotated:
        qf = kc.rotate(qf)
    qf = qf.reshape(N, Hkv, g * n_q, D) * scale  # rows of KV head h: its g query heads x n_q
    lens = suffix_lens.to(device=dev, dtype=torch.long)
    qpos = lens[:, None] - n_q + torch.arange(n_q, device=dev)[None, :]  # [N, n_q] suffix position
    qpos = qpos[:, None, :].expand(N, g, n_q).reshape(N, 1, g * n_q, 1)
    pend = prefix_start + P if prefix_end is None else int(prefix_end)

    kp = dequantize_ref(prefix_k, kc, torch.float32, rotated=kc.rotated)[0] if P else None
    vp = dequantize_ref(prefix_v, vc, torch.float32, rotated=vc.rotated)[0] if P else None
    kabs_p = prefix_start + torch.arange(P, device=dev)
    kidx_s = torch.arange(S, device=dev)
    out = torch.empty(N, Hkv, g * n_q, D, dtype=torch.float32, device=dev)
    lse = torch.empty(N, Hkv, g * n_q, dtype=torch.float32, device=dev)
    keys = max(P, S, 1)
    step = max(1, _SCORE_BUDGET // max(1, Hq * n_q * keys))
    for a in range(0, N, step):
        b = min(N, a + step)
        if S:
            ag = (slice(a, b),)
            ks = dequantize_ref(suffix_k.index(ag), kc, torch.float32, rotated=kc.rotated)
            vs = dequantize_ref(suffix_v.index(ag), vc, torch.float32, rotated=vc.rotated)
        # one agent's long prompt (n_q large) is split over its query rows as well
        rstep = max(1, _SCORE_BUDGET // max(1, (b - a) * Hkv * keys))
        for r0 in range(0, g * n_q, rstep):
            r1 = min(g * n_q, r0 + rstep)
            qc, qr = qf[a:b, :, r0:r1], qpos[a:b, :, r0:r1]
            if P:
                vis = None
                if window is not None:
                    qabs = pend + qr  # [n, 1, rows, 1]
                    vis = (kabs_p > qabs - int(window)) & (kabs_p <= qabs)
                o, l = _softmax_av(torch.einsum("nhqd,hkd->nhqk", qc, kp), vis, vp, "nhqk,hkd->nhqd")
            else:
                o = torch.zeros(b - a, Hkv, r1 - r0, D, device=dev)
                l = torch.full((b - a, Hkv, r1 - r0), float("-inf"), device=dev)
            if S:
                vis = (kidx_s < lens[a:b, None, None, None]) & (kidx_s <= qr)
                if window is not None:
                    vis = vis & (kidx_s > qr - int(window))
                o_s, l_s = _softmax_av(torch.einsum("nhqd,nhkd->nhqk", qc, ks), vis, vs,
                                       "nhqk,nhkd->nhqd")
                o, l = merge_attention_ref(o, l, o_s, l_s)
            out[a:b, :, r0:r1], lse[a:b, :, r0:r1] = o, l
    if vc.rotated:
        out = vc.unrotate(out)
    return out.reshape(N, Hq, n_q, D).to(q.dtype), lse.reshape(N, Hq, n_q)
