"""Public kernel entry points: Triton on CUDA tensors, the torch reference elsewhere.

    POLYKV_FORCE_REFERENCE=1 (or force_reference(True)) -> always the reference.
    POLYKV_TRITON_ON_CPU=1                               -> Triton kernels on CPU tensors through
                                                            the Triton interpreter (tests; the
                                                            interpreter needs TRITON_INTERPRET=1 set
                                                            before triton is first imported).
Triton is imported lazily, on the first call that uses it; without triton every call takes the
reference path.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import NamedTuple

import torch

from ..codecs import Packed, get_codec
from . import reference as ref
from .reference import RecentSegment, as_codec

_FORCE: bool | None = None


def force_reference(flag: bool | None = True) -> None:
    """Force (True) / forbid forcing (False) the reference path; None restores the env default."""
    global _FORCE
    _FORCE = flag


def _env_is_one(name: str):
    """A reader of whether environment variable `name` is "1", as `os.environ` holds it now. On
    CPython's os.environ it looks in the mapping's own dict under the encoded key (~35 ns; a
    `os.environ.get` costs ~1 µs, and every attention call asks: issue F, host time per call);
    elsewhere it asks `os.environ.get`."""
    env = os.environ
    data, encode = getattr(env, "_data", None), getattr(env, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return lambda: env.get(name, "0") == "1"
    key, one = encode(name), env.encodevalue("1")
    return lambda: data.get(key) == one


_FORCE_ENV = _env_is_one("POLYKV_FORCE_REFERENCE")
_CPU_ENV = _env_is_one("POLYKV_TRITON_ON_CPU")


def _forced() -> bool:
    if _FORCE is not None:
        return _FORCE
    return _FORCE_ENV()


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether triton is installed (looked up once: every attention call asks)."""
    return importlib.util.find_spec("triton") is not None


def _interp() -> bool:
    """CPU tensors take the Triton path only when asked (POLYKV_TRITON_ON_CPU=1): the interpreter is
    for tests, far too slow to be a default even where TRITON_INTERPRET is set."""
    return _CPU_ENV()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a call on these tensors takes the Triton path: all on CUDA, or all on the CPU with
    the interpreter asked for (`_interp`); never when forced to the reference."""
    n_cuda = 0
    for t in tensors:
        n_cuda += t.is_cuda
    if n_cuda == len(tensors):
        return not _forced() and triton_available()
    return not n_cuda and _interp() and not _forced() and triton_available()


_MODS = None


def _k():
    """The Triton kernel modules, imported on first use. Triton decides interpreter vs compiled at
    decoration time (and reads TRITON_INTERPRET again while interpreting), so with
    POLYKV_TRITON_ON_CPU=1 TRITON_INTERPRET=1 is set before the import and left set."""
    global _MODS
    if _MODS is None:
        if (os.environ.get("POLYKV_TRITON_ON_CPU", "0") == "1"
                and os.environ.get("TRITON_INTERPRET", "0") != "1"):
            os.environ["TRITON_INTERPRET"] = "1"
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            _fix_interpreter()
        from . import triton_cascade, triton_decode, triton_dequant, triton_quantize
        _MODS = (triton_decode, triton_cascade, triton_quantize, triton_dequant)
    return _MODS


_FIXED = False


def _fix_interpreter() -> None:
    """Triton 3.6's interpreter turns scalar tensors into ints with int(ndarray), which numpy >= 2.4
    refuses for its 1-element arrays (loop bounds read from memory). Patch that one conversion."""
    global _FIXED
    if _FIXED:
        return
    import numpy as np
    from triton.runtime import interpreter as it

    orig = getattr(it, "_patch_lang_tensor", None)
    if orig is None:
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    it._patch_lang_tensor = patched
    _FIXED = True


def _prep_q(q: torch.Tensor, k_codec, k_innerq, hkv: int, rec: list | None = None) -> torch.Tensor:
    """q [B, Hq, n_q, D] -> [B, Hkv, group*n_q, D] contiguous in K's storage domain (q / s, rotated
    once when K is turbo: float32, one launch, `triton_decode.prep_q_triton`). Without either it
    stays in q's dtype (a view when q is contiguous): the kernels convert q on load, so a q8_0 / f16
    K costs no preparation launch. Triton paths only (callers checked `use_triton`)."""
    B, Hq, n_q, D = q.shape
    if _rotates_q(k_codec, k_innerq):
        return _k()[0].prep_q_triton(q, k_codec, k_innerq, hkv, rec=rec)
    return q.reshape(B, hkv, (Hq // hkv) * n_q, D).contiguous()


def _call_key(dec, kind: str, q: torch.Tensor, tensors: tuple, k_codec, v_codec, tune: dict,
              *args) -> tuple:
    """One key for a whole eager call (issue F: host time per call): what its planned launches
    depend on — q's and the other tensors' views (`triton_decode._tkey`), the codecs, the tuning
    and the call's other arguments."""
    ck = dec._codec_key
    # `triton_decode._tkey` inline (a call per tensor is a tenth of its cost)
    return (kind, q.device, (q.shape, q.stride(), q.dtype, q.data_ptr() & 63),
            *[None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 63)
              for t in tensors],
            k_codec if isinstance(k_codec, str) else ck(k_codec),
            v_codec if isinstance(v_codec, str) else ck(v_codec),
            _frozen(tune) if tune else (), *args)


def _frozen(tune: dict) -> tuple:
    """A tuning dict as a hashable key; nested dicts (`prefix_tune`, `ws`) frozen too."""
    return tuple((k, _frozen(v) if isinstance(v, dict) else v) for k, v in tune.items())


def _rotates_q(k_codec, k_innerq) -> bool:
    return k_innerq is not None or getattr(k_codec, "rotated", False)


def _plain_rows(q: torch.Tensor, qp: torch.Tensor, k_codec, k_innerq, hkv: int) -> torch.Tensor:
    """The query rows a recent window's q8_0 segment reads (q's dtype, not rotated): `_prep_q`'s
    qp itself when K left q plain — no second copy of q per layer (a verify step's q is strided,
    so each preparation is a copy launch) — else q's own rows."""
    return _prep_q(q, None, None, hkv) if _rotates_q(k_codec, k_innerq) else qp


_FULL_LENS: dict = {}


def _full_lens(B: int, S: int, device) -> torch.Tensor:
    """int32 [B] filled with S, one per (B, S, device): no fill launch per call."""
    key = (B, S, device)
    t = _FULL_LENS.get(key)
    if t is None:
        t = _FULL_LENS[key] = torch.full((B,), S, dtype=torch.int32, device=device)
    return t


def attention_decode(q: torch.Tensor, k: Packed, v: Packed, k_codec, v_codec, *,
                     kv_lens: torch.Tensor | None = None, causal: bool = True,
                     sm_scale: float | None = None, window: int | None = None,
                     k_innerq: torch.Tensor | None = None, kv_start: torch.Tensor | None = None,
                     **tune):
    """Attention of q [B, Hq, n_q, D] over packed K/V (leading [B, Hkv, S_cap]).
    kv_start int [B]: rows before it are left padding (never keys). Returns out [B, Hq, n_q, D]
    (q.dtype) and lse float32 [B, Hq, n_q]. See reference.py."""
    if not use_triton(q, k.codes, v.codes):
        return ref.attention_decode_ref(q, k, v, k_codec, v_codec, kv_lens=kv_lens, causal=causal,
                                        sm_scale=sm_scale, window=window, k_innerq=k_innerq,
                                        kv_start=kv_start)
    dec = _k()[0]
    B, Hq, n_q, D = q.shape
    hkv, S = k.codes.shape[1], k.codes.shape[2]
    lens = (_full_lens(B, S, q.device) if kv_lens is None
            else kv_lens.to(device=q.device, dtype=torch.int32).contiguous())
    key = None
    if dec._plannable(q.device):  # one key for the whole call (issue F: host time per call)
        key = _call_key(dec, "decode", q, (k.codes, k.scales, v.codes, v.scales, lens, k_innerq, kv_start),
                        k_codec, v_codec, tune, causal, sm_scale, window)
        plan = dec._CALLS.get(key)
        if plan is not None:
            return plan(q, k, v, lens, k_innerq, kv_start)
    kc, vc = as_codec(k_codec, D), as_codec(v_codec, D)
    if Hq % hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={hkv}")
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    rec = [] if key is not None else None
    qp = _prep_q(q, kc, k_innerq, hkv, rec)
    out_shape = (B, Hq, n_q, D)
    out, lse = dec.decode_prepared(qp, n_q, k, v, kc, vc, lens, causal=causal, window=window,
                                   sm_scale=sm_scale, kv_start=kv_start, out_dtype=q.dtype,
                                   out_shape=out_shape, rec=rec, **tune)
    if key is not None:
        plan = dec.CallPlan.of(rec, tuple(qp.shape), out_shape, q.dtype, _rotates_q(kc, k_innerq),
                               q.device)
        if plan is not None:
            dec._remember(key, plan, dec._CALLS)
    return out, lse


#: Prefix chunks that start at multiples of this many rows give `cascade_attention` the values of
#: the whole prefix, bit for bit (the kernels' prefix splits are powers of two up to it).
PREFIX_CHUNK_ALIGN = 16384


def cascade_attention(q: torch.Tensor, prefix_k: Packed | None, prefix_v: Packed | None,
                      suffix_k: Packed, suffix_v: Packed, suffix_lens: torch.Tensor, k_codec,
                      v_codec, *, sm_scale: float | None = None,
                      k_innerq: torch.Tensor | None = None,
                      suffix_pages: torch.Tensor | None = None, page_size: int = 0,
                      prefix_chunks=None, prefix_rows: int = 0, window: int | None = None,
                      prefix_start: int = 0, prefix_end: int | None = None,
                      recent: RecentSegment | None = None, **tune):
    """q [N, Hq, n_q, D]: every agent sees the whole shared prefix (Packed leading [1, Hkv, P]) and
    its own suffix (Packed leading [N, Hkv, S_cap], suffix_lens [N], causal; 0 is legal).
    suffix_pages int32 [N, max_pages] with page_size: the suffix Packed is a page pool (leading
    [1, Hkv, rows]) and agent n's row j lives at suffix_pages[n, j // page_size] * page_size +
    j % page_size. prefix_chunks, prefix_rows: the prefix as an iterable of consecutive chunks
    (k, v, row0) of prefix_rows rows in all instead (prefix_k / prefix_v None; the host tier's
    streamed prefix, consumed chunk by chunk; each row0 a multiple of PREFIX_CHUNK_ALIGN): the
    kernels compute the very splits of the joined prefix (`cascade_prepared`), the reference joins
    the chunks — the values of one call over the joined prefix, bit for bit, on either path.
    window (a sliding-window layer): each query sees the keys of the last `window` positions,
    its own included; prefix row i sits at position prefix_start + i and suffix row j at
    prefix_end + j (default prefix_end: prefix_start + P), so a query's window may reach back
    into the shared prefix (`_windowed_cascade`; not with prefix_chunks).
    recent: a recent window's segment (`reference.RecentSegment`, R = recent.window; the prefix
    whole) merged in by LSE — on the kernels a third split pass joined by the same combine
    (polykv.pool.ring: the window and the cascade in one epilogue). suffix_lens are then the
    lengths of the rows older than the segment (max(0, L - R)); with window (R < window), the
    prefix is seen from the agents' real lengths (`RecentSegment.lengths`) and the older rows
    within the window - R positions before each query's segment.
    Returns out [N, Hq, n_q, D] (q.dtype), lse float32 [N, Hq, n_q]."""
    if recent is not None and prefix_chunks is not None:
        raise ValueError("recent= joins a cascade over a whole prefix only (not prefix_chunks)")
    if recent is not None and window is not None and not 0 < recent.window < int(window):
        raise ValueError(f"a sliding layer's recent window R={recent.window} must be in "
                         f"[1, window={window})")
    if not use_triton(q, suffix_k.codes, *(() if prefix_k is None else (prefix_k.codes,))):
        if suffix_pages is not None:
            suffix_k, suffix_v = (gather_pages(p, suffix_pages, page_size) for p in (suffix_k, suffix_v))
        if prefix_chunks is not None:
            parts = list(prefix_chunks)
            prefix_k, prefix_v = (Packed.cat([c[i] for c in parts]) for i in (0, 1))
        return ref.cascade_attention_ref(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens,
                                         k_codec, v_codec, sm_scale=sm_scale, k_innerq=k_innerq,
                                         window=window, prefix_start=prefix_start,
                                         prefix_end=prefix_end, recent=recent)
    dec, cas = _k()[:2]
    N, Hq, n_q, D = q.shape
    hkv = suffix_k.codes.shape[1]
    if recent is not None and _rotates_q(recent.codec, None):
        raise ValueError("a recent segment's codec must read plain queries (q8_0)")
    if window is not None:
        if prefix_chunks is not None:
            raise ValueError("a windowed cascade takes the prefix whole (prefix_k / prefix_v), "
                             "not as prefix_chunks")
        return _windowed_cascade(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens,
                                 as_codec(k_codec, D), as_codec(v_codec, D), int(window),
                                 prefix_start, prefix_end, sm_scale=sm_scale, k_innerq=k_innerq,
                                 suffix_pages=suffix_pages, page_size=page_size, recent=recent,
                                 **tune)
    key = None
    if prefix_chunks is None and prefix_k is not None and dec._plannable(q.device):
        key = _call_key(dec, "cascade", q, (prefix_k.codes, prefix_k.scales, prefix_v.codes,
                                             prefix_v.scales, suffix_k.codes, suffix_k.scales,
                                             suffix_v.codes, suffix_v.scales, suffix_lens,
                                             suffix_pages, k_innerq,
                                             *((recent.k.codes, recent.k.scales, recent.v.codes,
                                                recent.v.scales, recent.kv_start) if recent else ())),
                        k_codec, v_codec, tune, page_size, sm_scale,
                        recent and (dec._codec_key(recent.codec), recent.window))
        plan = dec._CALLS.get(key)
        if plan is not None:
            return plan(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, k_innerq,
                        suffix_pages, recent)
    kc, vc = as_codec(k_codec, D), as_codec(v_codec, D)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    rec = [] if key is not None else None
    qp = _prep_q(q, kc, k_innerq, hkv, rec)
    tune.setdefault("prefix_max_split", PREFIX_CHUNK_ALIGN)
    seg = None
    if recent is not None:
        seg = (_plain_rows(q, qp, kc, k_innerq, hkv), recent.k, recent.v, as_codec(recent.codec, D),
               _full_lens(N, recent.k.codes.shape[2], q.device), int(recent.window),
               cas.lens_i32(recent.kv_start, q.device))
    out, lse = cas.cascade_prepared(qp, n_q, prefix_k, prefix_v, suffix_k, suffix_v,
                                    suffix_lens.to(device=q.device), kc, vc, sm_scale=sm_scale,
                                    suffix_pages=suffix_pages, page_size=page_size,
                                    prefix_chunks=prefix_chunks, prefix_rows=prefix_rows,
                                    out_dtype=q.dtype, recent=seg, rec=rec, **tune)
    out, lse = out.reshape(N, Hq, n_q, D), lse.reshape(N, Hq, n_q)
    if key is not None and all(p is not None for p in rec):
        dec._remember(key, _CascadeCall(rec[0] if len(rec) == 2 else None, rec[-1],
                                        tuple(qp.shape), (N, Hq, n_q, D)), dec._CALLS)
    return out, lse


#: A windowed prefix is read from a row that is a multiple of this: its views keep the alignment
#: (and so the compiled variant) of the whole prefix's tensors.
_WINDOW_ROW_ALIGN = 64


def _windowed_cascade(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, kc, vc, window: int,
                      prefix_start: int, prefix_end: int | None, *, sm_scale, k_innerq,
                      suffix_pages, page_size: int, recent: RecentSegment | None = None, **tune):
    """`cascade_attention` of a sliding-window layer on the kernels (issue G): two split passes
    and one combine. The prefix pass runs every agent as its own sequence over the shared prefix
    (batch stride 0: the rows are read per agent, at most window + n_q of them) with its queries
    placed after its suffix (`decode_parts` q_shift = the gap between prefix and suffix + its
    suffix length), so the window mask is the reference's; the suffix pass is the causal,
    windowed decode of each agent's suffix. Both read only the tiles a window reaches. recent:
    a third pass over the segment (window R, true space) in the same combine; the suffix pass
    then reads the older rows (suffix_lens) within window - R, and the prefix pass places the
    queries by the real lengths (`RecentSegment.lengths`). Only the first pass launches as a
    programmatic dependent: a pass launched early behind another runs beside it and slows both
    (BENCHMARKS §5.18: 62.7 -> 41.9 µs at 32 agents with a recent window)."""
    dec, cas = _k()[:2]
    N, Hq, n_q, D = q.shape
    hkv, P = suffix_k.codes.shape[1], prefix_k.codes.shape[2]
    dev = q.device
    pend = prefix_start + P if prefix_end is None else int(prefix_end)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    qp = _prep_q(q, kc, k_innerq, hkv)
    M = qp.shape[2]
    lens = cas.lens_i32(suffix_lens, dev)
    real, suffix_window = lens, window
    if recent is not None:
        real, suffix_window = recent.lengths(lens), window - int(recent.window)
    # the earliest query sits at pend - n_q (an empty suffix) or later: rows before its window
    # are never keys, so the pass reads the prefix from the aligned row below that window
    first = max(0, pend - n_q - window + 1 - prefix_start)
    r0 = min(P, first // _WINDOW_ROW_ALIGN * _WINDOW_ROW_ALIGN)
    pk, pv = (p.index((slice(None), slice(None), slice(r0, P))) for p in (prefix_k, prefix_v))
    gap = pend - prefix_start - P
    shift = real if gap == 0 else real + gap
    prefix = None
    if P - r0:
        # causal as well: a query placed before the prefix's end (a suffix shorter than n_q) sees
        # no later prefix row, as in the reference
        prefix = dec.decode_parts(qp, n_q, pk, pv, kc, vc, _full_lens(N, P - r0, dev), causal=True,
                                  window=window, sm_scale=sm_scale, q_shift=shift, **tune)
    suffix = None
    if suffix_k.codes.shape[2] and (suffix_pages is None or suffix_pages.shape[1]):
        suffix = dec.decode_parts(qp, n_q, suffix_k, suffix_v, kc, vc, lens, causal=True,
                                  window=suffix_window, sm_scale=sm_scale, page_table=suffix_pages,
                                  page_size=page_size, pdl=prefix is None, **tune)
    third = None
    if recent is not None:
        third = dec.decode_parts(_plain_rows(q, qp, kc, k_innerq, hkv), n_q, recent.k, recent.v,
                                 recent.codec, recent.codec,
                                 _full_lens(N, recent.k.codes.shape[2], dev), causal=True,
                                 window=int(recent.window), sm_scale=sm_scale,
                                 kv_start=cas.lens_i32(recent.kv_start, dev),
                                 pdl=prefix is None and suffix is None, **tune)
    shape, out_shape = (N, hkv, M, D), (N, Hq, n_q, D)
    if prefix is None and suffix is None:
        if third is None:  # no key anywhere: the reference's empty rows
            return (torch.zeros(out_shape, dtype=q.dtype, device=dev),
                    torch.full(out_shape[:-1], float("-inf"), device=dev))
        # the segment alone (no older row in any window): its q8_0 values are true space
        return dec.combine_splits(third, shape, recent.codec, q.dtype, out_shape=out_shape, tokens=n_q)
    first_pass, second = (prefix, suffix) if prefix is not None else (suffix, None)
    return dec.combine_splits(first_pass, shape, vc, q.dtype, second=second, third=third,
                              out_shape=out_shape, tokens=n_q)


class _CascadeCall:
    """A planned cascade call: the query preparation (turbo K; None: q viewed as rows) and the
    passes (`triton_cascade.CascadePasses`), one key for the whole call (issue F)."""

    __slots__ = ("prep", "passes", "qp_shape", "out_shape", "qp_like", "out_likes")

    def __init__(self, prep, passes, qp_shape: tuple, out_shape: tuple):
        self.prep, self.passes, self.qp_shape, self.out_shape = prep, passes, qp_shape, out_shape
        like, dev = _k()[0].like, passes.prefix_lens.device
        # `triton_decode.like` templates of the fresh buffers: qp (turbo K only), out and lse (one
        # query column: contiguous; several are token-major views that `combine_outputs` makes)
        self.qp_like = like(qp_shape, torch.float32, dev) if prep is not None else None
        self.out_likes = ((like(out_shape, passes.out_dtype or torch.float32, dev),
                           like(out_shape[:-1], torch.float32, dev)) if passes.tokens == 1 else ())

    def __call__(self, q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, s, suffix_pages,
                 recent: RecentSegment | None = None):
        dec = _k()[0]
        qp = dec.planned_rows(self.prep, q, s, self.qp_shape, self.qp_like)
        seg = None
        if recent is not None:  # its q8_0 keys read plain query rows: qp itself without a prep
            seg = (qp if self.prep is None else dec.planned_rows(None, q, None, self.qp_shape),
                   recent.k, recent.v,
                   _full_lens(q.shape[0], recent.k.codes.shape[2], q.device),
                   _k()[1].lens_i32(recent.kv_start, q.device))
        return self.passes(qp, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, suffix_pages,
                           self.out_shape, recent=seg, likes=self.out_likes)


def gather_pages(pool: Packed, table: torch.Tensor, page_size: int) -> Packed:
    """Paged rows -> dense: pool leading [1, Hkv, rows], table int [N, max_pages] -> Packed leading
    [N, Hkv, max_pages * page_size] (row j of sequence n = pool row table[n, j // page_size] *
    page_size + j % page_size). The reference side of every paged read."""
    dev = pool.codes.device
    t = table.to(device=dev, dtype=torch.long)
    rows = (t[:, :, None] * page_size + torch.arange(page_size, device=dev)).reshape(t.shape[0], -1)

    def take(x):
        return None if x is None else x[0][:, rows].transpose(0, 1)

    return Packed(take(pool.codes), take(pool.scales))


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor):
    """LSE merge of two partial attentions over disjoint keys (-inf on either side is fine)."""
    if not use_triton(out_a, out_b):
        return ref.merge_attention_ref(out_a, lse_a, out_b, lse_b)
    return _k()[1].merge_triton(out_a, lse_a, out_b, lse_b)


def _positions(positions, B: int, T: int, device) -> torch.Tensor:
    if isinstance(positions, int):
        positions = torch.full((B,), positions, dtype=torch.int64)
    positions = torch.as_tensor(positions, device=device).to(torch.int64)
    if positions.dim() == 1:
        positions = positions[:, None] + torch.arange(T, device=device)[None, :]
    return positions.reshape(B, T)


def quantize_into(dst: Packed, x: torch.Tensor, codec, positions, *,
                  innerq: torch.Tensor | None = None, **tune) -> None:
    """Encode x [B, Hkv, T, D] and write row (b, h, t) to dst (Packed leading [B, Hkv, S_cap]) at
    sequence position positions[b, t]; positions: int start for all, int [B] starts, or [B, T].
    innerq s [Hkv, D]: rows are stored as x * s."""
    B, H, T, D = x.shape
    codec = as_codec(codec, D)
    pos = _positions(positions, B, T, x.device)
    if use_triton(x, dst.codes):
        _k()[2].quantize_into_triton(dst, x, codec, pos, innerq, **tune)
        return
    pk = ref.quantize_ref(x, codec, innerq)
    bi = torch.arange(B, device=x.device)[:, None].expand(B, T)
    dst.codes[bi, :, pos] = pk.codes.permute(0, 2, 1, 3).to(dst.codes.dtype)
    if dst.scales is not None:
        dst.scales[bi, :, pos] = pk.scales.permute(0, 2, 1, 3)


class KVTarget(NamedTuple):
    """Where a step's K and V rows are written (`quantize_kv_into`'s destination): k / v Packed
    leading [B, Hkv, S_cap] (any batch stride: 0 for a page pool every sequence writes into) in
    k_codec / v_codec, row (b, t) at positions int64 [B, T]; keys stored as k * innerq."""

    k: Packed
    k_codec: object
    v: Packed
    v_codec: object
    positions: torch.Tensor
    innerq: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode k, v [B, Hkv, T, D] (true space) into the target."""
        quantize_kv_into(self.k, k, self.k_codec, self.v, v, self.v_codec, self.positions,
                         innerq=self.innerq)


def quantize_kv_into(dst_k: Packed, k: torch.Tensor, k_codec, dst_v: Packed, v: torch.Tensor,
                     v_codec, positions, *, innerq: torch.Tensor | None = None) -> None:
    """`quantize_into` of k [B, Hkv, T, D] into dst_k (InnerQ s: stored k * s) and of v into dst_v
    at the same positions: one launch on the kernels for a step's few rows
    (`triton_quantize.quantize_pair_triton`: T <= 16), two otherwise."""
    B, H, T, D = k.shape
    kc, vc = as_codec(k_codec, D), as_codec(v_codec, D)
    if use_triton(k, dst_k.codes):
        if _k()[2].quantize_pair_triton(dst_k, k, kc, dst_v, v, vc, _positions(positions, B, T, k.device),
                                        innerq):
            return
    quantize_into(dst_k, k, kc, positions, innerq=innerq)
    quantize_into(dst_v, v, vc, positions)


def ring_indices(slots, lens: torch.Tensor, page_rows: torch.Tensor, page_scratch: int, R: int, C: int,
                 scratch_row: int, off: torch.Tensor | None = None,
                 newest: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A forward's recent-window ring rows (`reference.ring_indices_ref` defines them: gather int64
    [G, W], rows int64 [G, n_q], kv_start int32 [G], real bool [G, n_q], older int32 [G]); slots a
    slice or integer [G], lens integer [G] and page_rows int64 [G, n_q], all on the ring's device.
    On the Triton path one launch (`triton_ring`); off / newest are the reference's precomputed
    constants, unused there."""
    if use_triton(page_rows):
        _k()
        from .triton_ring import ring_indices_triton

        return ring_indices_triton(slots, lens, page_rows.contiguous(), page_scratch, R, C, scratch_row)
    return ref.ring_indices_ref(slots, lens, page_rows, page_scratch, R, C, scratch_row, off, newest)


#: Columns x head_dim past which a long feed's ring step (`ring_step`, wraps=True) takes the torch
#: ops: the kernel holds the feed's [n_q, D] rows in registers, one program per agent and head.
RING_WRAP_MAX_ELEMENTS = 128 * 128


def ring_step(ring_k: Packed, ring_v: Packed, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              seg_rows: torch.Tensor, real: torch.Tensor,
              pages: KVTarget | None = None, wraps: bool = False, wide: tuple | None = None) -> tuple:
    """One forward's rows of a q8_0 recent window (`reference.ring_step_ref` defines it): stores
    k, v [G, Hkv, n_q, D] at ring rows `rows` [G, n_q] and returns the segment seg_rows [G, W] reads
    (the real columns' rows, the rest of the ring as before the stores) as (k, v) q8_0 Packed
    leading [G, Hkv, W]; with pages, also writes k, v to that target (`KVTarget.write`, the agents'
    pages). wraps: the stores may overwrite segment rows (R - 1 + n_q > C: a prompt's feed).
    wide: (idx int64 [J], pos int64 [G]: pos[idx[j]] = j, -1 for the other agents) — a split step's
    joining agents: returns (seg_k, seg_v, wide_k, wide_v), wide_* the segments of the agents idx
    ([J, Hkv, W]; written by the same launch on the kernels: no gathers). On the Triton path one
    launch for all of it (`triton_ring`), where the torch ops take about fourteen (a feed of more
    than RING_WRAP_MAX_ELEMENTS columns x head_dim: the torch ops)."""
    G, H, n_q, D = k.shape
    codec = get_codec("q8_0", D)

    def empty(n: int) -> Packed:
        shape = (n, H, seg_rows.shape[1])
        return Packed(torch.empty(*shape, codec.code_bytes, dtype=codec.code_dtype, device=k.device),
                      torch.empty(*shape, codec.n_scales, dtype=torch.float16, device=k.device))

    # every row is written: no zero fill (two memsets per tensor in a captured step)
    seg_k, seg_v = empty(G), empty(G)
    wide_k = wide_v = None
    if wide is not None:
        wide_k, wide_v = empty(wide[0].shape[0]), empty(wide[0].shape[0])
    if use_triton(k, ring_k.codes) and (not wraps or n_q * D <= RING_WRAP_MAX_ELEMENTS):
        _k()
        from .triton_ring import ring_step_triton

        if pages is not None:
            pages = pages._replace(k_codec=as_codec(pages.k_codec, D), v_codec=as_codec(pages.v_codec, D))
        if not ring_step_triton(ring_k, ring_v, k, v, rows, seg_rows, real, seg_k, seg_v, pages, wraps,
                                None if wide is None else (wide[1].contiguous(), wide_k, wide_v)):
            pages.write(k, v)  # more rows than one launch writes to the pages
    else:
        ref.ring_step_ref(ring_k, ring_v, k, v, rows, seg_rows, real, seg_k, seg_v)
        if wide is not None:
            for out, seg in ((wide_k, seg_k), (wide_v, seg_v)):
                out.codes.copy_(seg.codes.index_select(0, wide[0]))
                out.scales.copy_(seg.scales.index_select(0, wide[0]))
        if pages is not None:
            pages.write(k, v)
    return (seg_k, seg_v) if wide is None else (seg_k, seg_v, wide_k, wide_v)


def dequantize(p: Packed, codec, dtype: torch.dtype = torch.float16, *,
               rotated: bool = False) -> torch.Tensor:
    """Packed -> dense [..., D] in dtype (true space; storage domain when rotated=True)."""
    if use_triton(p.codes):
        return _k()[3].dequantize_triton(p, codec, dtype, rotated)
    return ref.dequantize_ref(p, codec, dtype, rotated=rotated)
