"""Attention over a shared compressed prefix plus per-agent compressed suffixes (pure torch).

`cascade_torch` is the pool's CPU path; `cascade_attention` picks `polykv.kernels.dispatch` when it
runs a Triton kernel (full-attention layers) and `cascade_torch` otherwise (CPU, sliding-window layers,
which the kernel contract does not cover, or when dispatch cannot be imported).

Shapes (the kernel contract of `dispatch.cascade_attention`):
    q            [N, Hq, n_q, D]   N agents, n_q queries each (left-padded: real queries are last)
    prefix_k/v   Packed leading [1, Hkv, P]     one copy, read once per call for all agents
    suffix_k/v   Packed leading [N, Hkv, S_cap] per-agent private rows
    suffix_lens  int [N] valid suffix rows per agent (0 legal); query j of agent n sits at suffix
                 position suffix_lens[n] - n_q + j and sees the whole prefix plus its own suffix rows
                 at positions <= it
    k_innerq     float32 [Hkv, D] or None: keys were stored as K*s, queries use q/s
    returns      out [N, Hq, n_q, D] (q.dtype), lse float32 [N, Hq, n_q] (natural log)

Turbo codecs are read in the rotated domain: q is rotated once, keys/values are centroid x norm (no
inverse rotation per row), and the merged output is inverse-rotated once.
"""

from __future__ import annotations

import math

import torch

from ..codecs import Codec, Packed
from ..kernels.reference import merge_attention_ref

_SCORE_BUDGET = 1 << 23  # float32 elements of one score block (32 MiB)


def _decode(codec: Codec, p: Packed, rotated: bool) -> torch.Tensor:
    return (codec.decode_rotated(p) if rotated else codec.decode(p)).float()


def _masked_softmax_av(scores: torch.Tensor, visible: torch.Tensor | None, v: torch.Tensor,
                       eq: str) -> tuple[torch.Tensor, torch.Tensor]:
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe[..., None])
    return torch.einsum(eq, p, v), lse


def cascade_torch(q: torch.Tensor, prefix_k: Packed, prefix_v: Packed, suffix_k: Packed,
                  suffix_v: Packed, suffix_lens: torch.Tensor, k_codec: Codec, v_codec: Codec, *,
                  sm_scale: float | None = None, k_innerq: torch.Tensor | None = None,
                  window: int | None = None, prefix_start: int = 0,
                  prefix_end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cascade attention (see module doc). Extra, for sliding-window layers:

    window:       W, keys visible only at absolute positions > qpos_abs - W (transformers' rule)
    prefix_start: absolute position of prefix row 0 (a sliding layer keeps only the last W-1 rows)
    prefix_end:   absolute position of suffix row 0 (the document length); default prefix_start + P
    """
    N, Hq, n_q, D = q.shape
    Hkv, P = prefix_k.shape[1], prefix_k.shape[2]
    S = suffix_k.shape[2] if suffix_k.shape[0] else 0
    g = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    dev = q.device
    k_rot, v_rot = k_codec.rotated, v_codec.rotated
    qf = q.float()
    if k_innerq is not None:
        s = k_innerq.to(device=dev, dtype=torch.float32).repeat_interleave(g, 0)
        qf = qf / s[None, :, None, :]
    if k_rot:
        qf = k_codec.rotate(qf)
    qf = qf.reshape(N, Hkv, g * n_q, D) * scale  # heads h = kv*g + i (repeat_interleave order)
    lens = suffix_lens.to(device=dev, dtype=torch.long)
    qpos = lens[:, None] - n_q + torch.arange(n_q, device=dev)[None, :]  # [N, n_q] suffix position
    qpos_rows = qpos[:, None, :].expand(N, g, n_q).reshape(N, 1, g * n_q, 1)
    pend = prefix_start + P if prefix_end is None else int(prefix_end)

    # prefix: decoded once per call (workspace [Hkv, P, D], independent of N)
    kp = _decode(k_codec, prefix_k, k_rot)[0] if P else None
    vp = _decode(v_codec, prefix_v, v_rot)[0] if P else None
    # suffix rows of all agents (private storage, already bounded by the agents' own lengths)
    ks = _decode(k_codec, suffix_k, k_rot) if S else None
    vs = _decode(v_codec, suffix_v, v_rot) if S else None
    out = torch.empty(N, Hkv, g * n_q, D, dtype=torch.float32, device=dev)
    lse = torch.empty(N, Hkv, g * n_q, dtype=torch.float32, device=dev)
    step = max(1, _SCORE_BUDGET // max(1, Hq * n_q * max(P, S, 1)))
    kidx_p = torch.arange(P, device=dev)
    kidx_s = torch.arange(S, device=dev)
    for a in range(0, N, step):
        b = min(N, a + step)
        qc = qf[a:b]
        qr = qpos_rows[a:b]
        if P:
            sc = torch.einsum("nhqd,hkd->nhqk", qc, kp)
            vis = None
            if window is not None:
                qabs = pend + qr  # [n, 1, gq, 1]
                kabs = prefix_start + kidx_p
                vis = (kabs > qabs - int(window)) & (kabs <= qabs)
            o_p, l_p = _masked_softmax_av(sc, vis, vp, "nhqk,hkd->nhqd")
        else:
            o_p = torch.zeros(b - a, Hkv, g * n_q, D, device=dev)
            l_p = torch.full((b - a, Hkv, g * n_q), float("-inf"), device=dev)
        if S:
            sc = torch.einsum("nhqd,nhkd->nhqk", qc, ks[a:b])
            vis = (kidx_s < lens[a:b, None, None, None]) & (kidx_s <= qr)
            if window is not None:
                vis = vis & (kidx_s > qr - int(window))
            o_s, l_s = _masked_softmax_av(sc, vis, vs[a:b], "nhqk,nhkd->nhqd")
            o, l = merge_attention_ref(o_p, l_p, o_s, l_s)
        else:
            o, l = o_p, l_p
        out[a:b], lse[a:b] = o, l
    if v_rot:
        out = v_codec.unrotate(out)
    out = out.reshape(N, Hq, n_q, D)
    return out.to(q.dtype), lse.reshape(N, Hq, n_q)


_DISPATCH = None


def _dispatch_module():
    """`polykv.kernels.dispatch` when importable (else None: the torch path is used)."""
    global _DISPATCH
    if _DISPATCH is None:
        try:
            from ..kernels import dispatch as mod  # noqa: PLC0415
        except Exception:  # broken import: keep the torch path
            mod = False
        _DISPATCH = mod
    return _DISPATCH or None


def cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, k_codec, v_codec, *,
                      sm_scale=None, k_innerq=None, window=None, prefix_start=0, prefix_end=None,
                      backend: str = "auto"):
    """Route full-attention layers to `dispatch.cascade_attention` when it would run a Triton kernel
    (CUDA tensors, or the interpreter in tests) — or always with backend="dispatch"; everything else
    (CPU, sliding-window layers) runs `cascade_torch`, which decodes the prefix once per call for all
    agents (dispatch's CPU reference expands the prefix per agent, which the pool must not do)."""
    mod = _dispatch_module() if window is None and backend in ("auto", "dispatch") else None
    if backend == "dispatch" and mod is None:
        raise RuntimeError("polykv.kernels.dispatch.cascade_attention is not available here")
    if mod is not None and (backend == "dispatch" or mod.use_triton(q, prefix_k.codes)):
        return mod.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v,
                                     suffix_lens.to(device=q.device, dtype=torch.int32), k_codec,
                                     v_codec, sm_scale=sm_scale, k_innerq=k_innerq)
    return cascade_torch(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, k_codec, v_codec,
                         sm_scale=sm_scale, k_innerq=k_innerq, window=window,
                         prefix_start=prefix_start, prefix_end=prefix_end)


def prefill_attention(q: torch.Tensor, hist_k: torch.Tensor, hist_v: torch.Tensor,
                      new_k: torch.Tensor, new_v: torch.Tensor, *, scaling: float | None,
                      hist_start: int, pos0: int, window: int | None) -> torch.Tensor:
    """Document prefill (materialize path): a chunk's queries [1, Hq, C, D] at absolute positions
    pos0.. attend to decoded history rows (absolute positions hist_start..pos0-1) and the chunk's own
    dense K/V, causally (and within the window). Returns [1, C, Hq, D]."""
    C = q.shape[2]
    k = torch.cat([hist_k.to(q.dtype), new_k], dim=2)
    v = torch.cat([hist_v.to(q.dtype), new_v], dim=2)
    L = k.shape[2]
    kabs = torch.cat([torch.arange(hist_start, hist_start + hist_k.shape[2]),
                      torch.arange(pos0, pos0 + C)]).to(q.device)
    qabs = torch.arange(pos0, pos0 + C, device=q.device)
    mask = kabs[None, :] <= qabs[:, None]
    if window is not None:
        mask = mask & (kabs[None, :] > qabs[:, None] - int(window))
    assert mask.shape == (C, L)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[None, None], scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
