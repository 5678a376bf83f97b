"""Cascade attention: N agents over one shared compressed prefix plus private suffixes.

Prefix pass: every agent's queries of one KV head group become rows of a single tile
(N * group * n_q rows, in row tiles of up to 64: H200 v4 sweep, 306 us vs 359 us for 128), so each
prefix K/V tile is read from memory once per row tile per step, not once per agent; three pipeline
stages at head_dim <= 128 (H200 v9 sweep, 64k: 32 agents 292.5 -> 269.9 us, 8 agents 177.9 ->
168.2); on Hopper the warp-specialised pass (gluon_prefix). Suffix pass: the decode kernel with
per-agent lengths (causal). Both passes leave their splits uncombined; one epilogue launch
(`triton_decode.combine_splits`) merges every split of both by log-sum-exp, maps the rows back from
V's storage domain and writes the caller's dtype (it replaced two split combines, the LSE merge, an
fp32 rotation GEMM and a cast: five launches per layer and call). `_merge_kernel` remains for
`dispatch.merge_attention`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..codecs import Packed
from .gluon_prefix import WsPlan, ws_ok, ws_prefix_parts
from .launch import Planned
from .launch import launch as cached_launch
from .triton_decode import PHASE_MAX_ROWS, _aligned, _DecodePlan, combine_outputs, combine_splits, decode_parts


@triton.jit
def _merge_kernel(OA, LA, OB, LB, OUT, LSE, HKV, M, soa_n, soa_h, soa_m, sla_n, sla_h, sla_m,
                  D: tl.constexpr):
    # row r of OB / OUT (contiguous [N, HKV, M]); A is read through its strides, so the prefix
    # pass's [HKV, N, M] layout needs no transposing copy
    r = tl.program_id(0).to(tl.int64)
    n = r // (HKV * M)
    h = (r // M) % HKV
    mm = r % M
    la = tl.load(LA + n * sla_n + h * sla_h + mm * sla_m)
    lb = tl.load(LB + r)
    m = tl.maximum(la, lb)
    ms = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - ms)
    wb = tl.exp(lb - ms)
    tot = wa + wb
    den = tl.where(tot > 0, tot, 1.0)
    d = tl.arange(0, D)
    oa = tl.load(OA + n * soa_n + h * soa_h + mm * soa_m + d).to(tl.float32)
    ob = tl.load(OB + r * D + d).to(tl.float32)
    out = (oa * wa + ob * wb) / den
    tl.store(OUT + r * D + d, out.to(OUT.dtype.element_ty))
    tl.store(LSE + r, tl.where(tot > 0, ms + tl.log(den), float("-inf")))


def merge_triton(out_a, lse_a, out_b, lse_b, out_dtype=None):
    """LSE merge of two partial attentions [..., D] / [...]. A 4D out_a [N, H, M, D] / lse_a
    [N, H, M] may be any strided view (last dim of out_a contiguous); b is made contiguous."""
    D = out_a.shape[-1]
    if (out_a.dim() == 4 and out_a.shape == out_b.shape and out_a.stride(-1) == 1
            and lse_a.dtype == torch.float32):
        N, H, M = out_a.shape[:3]
        oa, la = out_a, lse_a
        soa, sla = out_a.stride()[:3], lse_a.stride()
    else:
        oa = out_a.contiguous()
        la = lse_a.float().contiguous()
        H, M = 1, max(1, la.numel())
        soa, sla = (0, 0, D), (0, 0, 1)
    ob = out_b.contiguous()
    lb = lse_b.float().contiguous()
    out = torch.empty(out_b.shape, dtype=out_dtype or out_a.dtype, device=out_a.device)
    lse = torch.empty(lse_b.shape, dtype=torch.float32, device=out_a.device)
    R = lb.numel()
    if R:
        cached_launch(_merge_kernel, (R,), oa, la, ob, lb, out, lse, H, M, *soa, *sla, D=D)
    return out, lse


_PREFIX_LENS: dict = {}


def _prefix_lens(P: int, device) -> torch.Tensor:
    """int32 [1] holding P, one per (P, device): no fill kernel per call."""
    key = (P, str(device))
    t = _PREFIX_LENS.get(key)
    if t is None:
        t = _PREFIX_LENS[key] = torch.full((1,), P, dtype=torch.int32, device=device)
    return t


def cascade_prepared(qp: torch.Tensor, n_q: int, prefix_k: Packed | None, prefix_v: Packed | None,
                     suffix_k: Packed, suffix_v: Packed, suffix_lens: torch.Tensor, k_codec,
                     v_codec, *, sm_scale: float, prefix_block_m: int = 64,
                     suffix_pages: torch.Tensor | None = None, page_size: int = 0,
                     prefix_chunks=None, prefix_rows: int = 0, prefix_max_split: int = 16384,
                     prefix_tune: dict | None = None, out_dtype: torch.dtype | None = None,
                     recent: tuple | None = None, rec: list | None = None, **kw):
    """qp float32 [N, Hkv, M, D] in K's storage domain. suffix_pages int32 [N, max_pages]: the
    suffixes are a page pool (see decode_prepared). prefix_chunks, prefix_rows: the prefix as an
    iterable of chunks (k, v, row0) of prefix_rows rows in all (prefix_k / prefix_v None), consumed
    one launch at a time (decode_prepared's chunks), each row0 a multiple of the prefix pass's
    split length: the values of the joined prefix, bit for bit. The prefix pass's splits are
    powers of two of at most prefix_max_split rows, whole or chunked, so chunks that start at
    multiples of prefix_max_split always qualify. Returns (out, lse): out [N, Hkv, M, D] float32 in
    V's storage domain and lse float32 [N, Hkv, M]; with out_dtype, true space in that dtype as
    [N, Hq, n_q, D] (a token-major buffer's view where n_q > 1: `triton_decode.combine_outputs`) and lse
    [N, Hq, n_q] (`triton_decode.combine_splits`). recent: a recent window's segment (qr, k, v, codec, lens,
    window, kv_start) — query rows [N, Hkv, M, D] for its q8_0 keys, Packed leading [N, Hkv, W],
    int32 [N] lengths (W) and kv_start — as a third split pass (causal, windowed) in true space,
    joined by the same combine (needs out_dtype). kw tunes every pass, prefix_tune (over kw) the
    prefix pass alone.
    rec: the call's plan (`CascadePasses`, None where a pass is not planned) is appended to it."""
    N, Hkv, M, D = qp.shape
    if prefix_chunks is None:
        prefix_chunks, prefix_rows = [(prefix_k, prefix_v, 0)], prefix_k.codes.shape[2]
    chunks = ((k, v, _prefix_lens(k.codes.shape[2], qp.device), int(row0))
              for k, v, row0 in prefix_chunks)
    # H200, 64k prefix (kernels_notes v9/v10): 3 pipeline stages; 168 registers = 3 tile-kernel
    # programs per SM (the vector factor loads of v10 alone build at 213 = 2 per SM)
    tile = {"num_stages": 3, "maxnreg": 168} if N * M > PHASE_MAX_ROWS else {"num_stages": 3}
    tune = {**kw, **(prefix_tune or {})}
    sub = [] if rec is not None else None
    # power-of-two splits (<= prefix_max_split): the same splits whether whole or in chunks
    if tune.get("impl", "auto") in ("auto", "ws") and ws_ok(qp, k_codec, v_codec):
        # Hopper: the warp-specialised pass (decode in a producer warp group, wgmma in consumers),
        # reading every agent's rows of a KV head in place
        prefix = ws_prefix_parts(qp, chunks, prefix_rows, k_codec, v_codec, sm_scale=sm_scale,
                                 max_split=prefix_max_split, rec=sub, **tune.get("ws", {}))
    else:
        tune.pop("ws", None)
        # all agents' rows of a KV head side by side, read in place: [1, Hkv, N, M, D]
        qc = qp.permute(1, 0, 2, 3).unsqueeze(0)
        if sub is not None:
            sub.append(None)  # the tile kernel's prefix pass is not planned
        prefix = decode_parts(qc, n_q, None, None, k_codec, v_codec, None,
                              causal=False, window=None, sm_scale=sm_scale,
                              chunks=chunks, total_rows=prefix_rows,
                              **{"block_m_max": prefix_block_m,
                                 "max_split": prefix_max_split,
                                 **(tile if D <= 128 and qp.is_cuda else {}), **tune})
    suffix = None
    if suffix_k.codes.shape[2] and (suffix_pages is None or suffix_pages.shape[1]):
        suffix = decode_parts(qp, n_q, suffix_k, suffix_v, k_codec, v_codec,
                              lens_i32(suffix_lens, qp.device), causal=True,
                              window=None, sm_scale=sm_scale, page_table=suffix_pages,
                              page_size=page_size, rec=sub, **kw)
    third = None
    if recent is not None:
        qr, rk, rv, rc, rlens, rwin, rstart = recent
        third = decode_parts(qr, n_q, rk, rv, rc, rc, rlens, causal=True, window=rwin,
                             sm_scale=sm_scale, kv_start=rstart, rec=sub, **kw)
    # true-space output for a model: token-major where there are several query columns, so the
    # model's [N, n_q, Hq * D] reshape of it is a view, not a copy kernel per layer
    tokens = n_q if out_dtype is not None else 1
    out, lse = combine_splits(prefix, (N, Hkv, M, D), v_codec, out_dtype, second=suffix,
                              third=third, heads_major=True, tokens=tokens, rec=sub)
    if rec is not None:
        ok = all(p is not None for p in sub)
        rec.append(CascadePasses.of(sub[0], sub[1] if suffix is not None else None,
                                    sub[-2] if third is not None else None, sub[-1],
                                    (N, Hkv, M, D), out_dtype, _prefix_lens(prefix_rows, qp.device),
                                    tokens)
                   if ok else None)
    return out, lse


class CascadePasses(NamedTuple):
    """A cascade call's planned passes (`cascade_prepared`): the warp-specialised prefix pass,
    the suffix pass (None: no suffix rows, no pass), a recent window's segment pass (None: no
    window) and the combine."""

    prefix: WsPlan
    suffix: _DecodePlan | None
    recent: _DecodePlan | None
    combine: Planned
    shape: tuple  # qp's [N, Hkv, M, D]
    out_dtype: torch.dtype | None
    prefix_lens: torch.Tensor  # int32 [1]: the prefix's rows
    part_numel: int  # float32 elements of every pass's (o, lse) partials, in one allocation
    part_offsets: tuple  # byte offset of each partial in it (multiples of 64)
    tokens: int  # > 1: the combine stores token-major (`triton_decode.combine_outputs`)

    @classmethod
    def of(cls, prefix: WsPlan, suffix: "_DecodePlan | None", recent: "_DecodePlan | None",
           combine: Planned, shape: tuple, out_dtype, prefix_lens: torch.Tensor,
           tokens: int = 1) -> "CascadePasses":
        # each partial starts 64-byte aligned, as a fresh buffer would (the launches were
        # specialised on it)
        sizes = [_aligned(n) for p in (prefix, suffix, recent) if p is not None
                 for n in (p.o_numel, p.l_numel)]
        offsets = tuple(4 * sum(sizes[:i]) for i in range(len(sizes)))
        if prefix_lens.is_cuda:
            side_stream(prefix_lens.device)  # made now, not inside a capture
        return cls(prefix, suffix, recent, combine, shape, out_dtype, prefix_lens, sum(sizes), offsets,
                   tokens)

    def __call__(self, qp: torch.Tensor, prefix_k: Packed, prefix_v: Packed, suffix_k: Packed,
                 suffix_v: Packed, suffix_lens: torch.Tensor, suffix_pages: torch.Tensor | None,
                 out_shape: tuple | None = None, recent: tuple | None = None, likes: tuple = ()):
        """What `cascade_prepared` computes for these tensors (the same launches and values);
        out_shape: out [*out_shape] and lse [*out_shape[:-1]], the same rows (the caller's
        [N, Hq, n_q, D]: no reshape per call). suffix_lens: any integer dtype and device.
        recent: (qr, k, v, lens, kv_start) of the planned segment pass (`cascade_prepared`'s
        recent without codec and window), given exactly when the plan has one. likes: `like`
        templates of out and lse (one query column), else `combine_outputs` makes them."""
        dev = qp.device
        w, s, r = self.prefix, self.suffix, self.recent
        # the passes' partials in one allocation, handed to the launches as addresses (host time:
        # no view per partial, no pointer query per launch); `buf` holds it until the launches
        # are queued (freed after, stream-ordered, as any temporary)
        buf = torch.empty(self.part_numel, dtype=torch.float32, device=dev)
        at = buf.data_ptr()
        parts = [at + off for off in self.part_offsets]
        o_p, l_p = parts[0], parts[1]
        # captured into a CUDA graph, the suffix pass is a branch beside the prefix pass (neither
        # reads the other's output): its small programs run on the SMs the prefix pass leaves
        # free instead of after it (H200: kernels_notes v16). Eager calls stay on one stream — a
        # fork and a join cost host time, and an eager call is host-bound anyway.
        fork = ((s is not None or r is not None) and dev.type == "cuda"
                and torch.cuda.is_current_stream_capturing())
        if fork:
            main, side = torch.cuda.current_stream(dev), side_stream(dev)
            side.wait_stream(main)
        w.launch(qp, prefix_k.codes, prefix_k.scales, prefix_v.codes, prefix_v.scales,
                 self.prefix_lens, o_p, l_p)
        if fork:
            with torch.cuda.stream(side):
                sides = self._side_passes(qp, suffix_k, suffix_v, suffix_lens, suffix_pages, recent, parts, dev)
            main.wait_stream(side)
        else:
            sides = self._side_passes(qp, suffix_k, suffix_v, suffix_lens, suffix_pages, recent, parts, dev)
        if likes:
            out, lse = torch.empty_like(likes[0]), torch.empty_like(likes[1])
        else:
            out, lse = combine_outputs(self.shape, self.out_dtype or torch.float32, dev, out_shape,
                                       self.tokens)
        self.combine(o_p, l_p, *sides, out, lse)
        return out, lse

    def _side_passes(self, qp, suffix_k, suffix_v, suffix_lens, suffix_pages, recent, parts, dev) -> tuple:
        """The suffix and recent-window passes (those planned) into their partials: the combine's
        (o_s, l_s, o_t, l_t), the prefix pass's partials in place of a pass not run (never read)."""
        s, r = self.suffix, self.recent
        o_s = o_t = parts[0]
        l_s = l_t = parts[1]
        if s is not None:
            s(qp, suffix_k, suffix_v, lens_i32(suffix_lens, dev), page_table=suffix_pages,
              parts=parts[2:4])
            o_s, l_s = parts[2], parts[3]
        if r is not None:
            qr, rk, rv, rlens, rstart = recent
            r(qr, rk, rv, rlens, kv_start=rstart, parts=parts[-2:])
            o_t, l_t = parts[-2], parts[-1]
        return o_s, l_s, o_t, l_t


_SIDE: dict = {}


def side_stream(dev: torch.device) -> "torch.cuda.Stream":
    """One side stream per CUDA device for captured branches (created once, outside any capture:
    `CascadePasses.of` asks for it when the plan is made)."""
    st = _SIDE.get(dev)
    if st is None:
        st = _SIDE[dev] = torch.cuda.Stream(dev)
    return st


def lens_i32(lens: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """lens as int32, contiguous, on dev: itself when it already is (no dispatch: host time)."""
    if lens.dtype is torch.int32 and lens.device == dev and lens.is_contiguous():
        return lens
    return lens.to(device=dev, dtype=torch.int32).contiguous()
