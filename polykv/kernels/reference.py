"""Pure-torch ground truth for every kernel in this package (DESIGN §4).

Everything here decodes the packed K/V with the codec (float32, true space) and runs plain softmax
attention; the Triton kernels must agree with these functions on the same packed data.

Conventions
    q        [B, Hq, n_q, D] true space (f16 / bf16 / f32)
    k, v     Packed with leading dims [B, Hkv, S_cap]
    kv_lens  int [B] valid lengths (default S_cap)
    causal   query j of sequence b sits at position kv_lens[b] - n_q + j and sees keys at positions
             <= it; causal=False: every valid key is visible (a shared prefix)
    window   W: additionally only keys at positions > qpos - W
    kv_start int [B] (decode): rows before kv_start[b] are left padding, never keys
    k_innerq float32 [Hkv, D]: keys were stored as K * s, queries use q / s
    returns  out [B, Hq, n_q, D] in q.dtype, lse float32 [B, Hq, n_q] (natural log of
             sum exp(score * sm_scale)); a query that sees no key gets out 0 and lse -inf.
"""

from __future__ import annotations

import math

import torch

from ..codecs import Codec, Packed, get_codec


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
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing visible
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe[..., None])  # exp(-inf) = 0
    out = torch.einsum("bhqk,bhkd->bhqd", p, vd)
    return out.to(q.dtype), lse.float()


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
                          sm_scale: float | None = None, k_innerq: torch.Tensor | None = None):
    """q [N, Hq, n_q, D]; prefix Packed leading [1, Hkv, P] (shared, no mask); suffix Packed leading
    [N, Hkv, S_cap] with suffix_lens [N] (0 allowed), causal. Merged by LSE."""
    out_p, lse_p = attention_decode_ref(q, prefix_k, prefix_v, k_codec, v_codec, causal=False,
                                        sm_scale=sm_scale, k_innerq=k_innerq)
    out_s, lse_s = attention_decode_ref(q, suffix_k, suffix_v, k_codec, v_codec,
                                        kv_lens=suffix_lens, causal=True, sm_scale=sm_scale,
                                        k_innerq=k_innerq)
    out, lse = merge_attention_ref(out_p.float(), lse_p, out_s.float(), lse_s)
    return out.to(q.dtype), lse
