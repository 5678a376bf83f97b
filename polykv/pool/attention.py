"""Attention for the pool: the cascade over a shared compressed prefix plus per-agent compressed
suffixes (`cascade_attention`), and document prefill (`prefill_attention*`, materialize path).

`cascade_attention` runs `polykv.kernels.dispatch.cascade_attention` where a Triton kernel runs
(CUDA, or the interpreter in tests; sliding-window layers included) and otherwise (CPU, or when
dispatch cannot be imported) the one torch reference,
`polykv.kernels.reference.cascade_attention_ref`: the prefix decoded once per call for
all agents, never a dense copy per agent, bounded score memory, turbo codecs read in the rotated
domain. Shapes and rules: reference.py's Conventions (Cascade).
"""

from __future__ import annotations

import math

import torch

from ..codecs import Packed
from ..kernels.reference import cascade_attention_ref, merge_attention_ref

_DISPATCH = None


def _dispatch_module():
    """`polykv.kernels.dispatch` when importable (else None: the torch reference is used)."""
    global _DISPATCH
    if _DISPATCH is None:
        try:
            from ..kernels import dispatch as mod  # noqa: PLC0415
        except Exception:  # broken import: keep the torch reference
            mod = False
        _DISPATCH = mod
    return _DISPATCH or None


def cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, k_codec, v_codec, *,
                      sm_scale=None, k_innerq=None, window=None, prefix_start=0, prefix_end=None,
                      backend: str = "auto", suffix_pages=None, page_size: int = 0,
                      suffix_rows: int | None = None, prefix_chunks=None, prefix_rows: int = 0,
                      recent=None):
    """Cascade attention (reference.py's Conventions, Cascade) of q [N, Hq, n_q, D].

    Calls go to `dispatch.cascade_attention` when it would run a Triton kernel (CUDA tensors, or the
    interpreter in tests), or always with backend="dispatch" — sliding-window layers too (window /
    prefix_start / prefix_end: the kernels' windowed cascade); everything else (CPU) runs
    `cascade_attention_ref`.

    suffix_pages int32 [N, max_pages] / page_size: suffix_k / suffix_v are page pools (leading
    [1, Hkv, rows]); the kernels read them through the table, the reference gets the first
    `suffix_rows` rows of each agent gathered densely (default: every page).

    prefix_chunks, prefix_rows (full-attention layers; prefix_k / prefix_v None): the prefix as an
    iterable of chunks (k, v, row0) of prefix_rows rows, consumed one at a time: the kernels
    compute the splits of the joined prefix chunk by chunk, the reference joins the chunks — the
    values of the joined prefix, bit for bit (`dispatch.cascade_attention`).

    recent (`kernels.reference.RecentSegment`; full-attention layers, prefix whole): a recent
    window's segment merged in by LSE — on the kernels in the cascade's own combine."""
    mod = _dispatch_module() if backend in ("auto", "dispatch") else None
    if backend == "dispatch" and mod is None:
        raise RuntimeError("polykv.kernels.dispatch.cascade_attention is not available here")
    if mod is not None and (backend == "dispatch" or mod.use_triton(q, suffix_k.codes)):
        if window is not None and suffix_pages is not None and suffix_rows == 0:
            suffix_pages = suffix_pages[:, :0]  # lengths that place the queries, no suffix row
        return mod.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v,
                                     suffix_lens.to(device=q.device, dtype=torch.int32), k_codec,
                                     v_codec, sm_scale=sm_scale, k_innerq=k_innerq,
                                     suffix_pages=suffix_pages, page_size=page_size,
                                     prefix_chunks=prefix_chunks, prefix_rows=prefix_rows,
                                     window=window, prefix_start=prefix_start,
                                     prefix_end=prefix_end, recent=recent)
    if prefix_chunks is not None:
        parts = list(prefix_chunks)
        prefix_k, prefix_v = (Packed.cat([c[i] for c in parts]) for i in (0, 1))
    if suffix_pages is not None:
        from ..kernels.dispatch import gather_pages

        rows = suffix_pages.shape[1] * page_size if suffix_rows is None else int(suffix_rows)
        n_pages = -(-rows // page_size)
        suffix_k, suffix_v = (gather_pages(p, suffix_pages[:, :n_pages], page_size).index(
            (slice(None), slice(None), slice(0, rows))) for p in (suffix_k, suffix_v))
    return cascade_attention_ref(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lens, k_codec,
                                 v_codec, sm_scale=sm_scale, k_innerq=k_innerq, window=window,
                                 prefix_start=prefix_start, prefix_end=prefix_end, recent=recent)


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


# --- prefill without a [C, L] mask (split + LSE merge) ---------------------------------------------
# What a 32k-token prefill of a 4-layer Llama-3-8B-shape model (hidden 4096, Hq 32, Hkv 8, D 128,
# MLP 14336, bf16) must do, in chunks of C = 4096 (8 chunks), so GPU figures can be compared:
#   linears   218.1M weights/layer x 4 layers x 2 FLOP x 32768 tokens         = 57.2 TFLOP
#   attention history part: chunk i sees i*C rows, sum_i i = 28:
#             4 FLOP (QK^T + PV) x Hq 32 x D 128 x C^2 x 28 = 7.70 TFLOP/layer
#             causal chunk part: 4 x 32 x 128 x C^2/2 x 8 chunks = 1.10 TFLOP/layer
#             x 4 layers                                                       = 35.2 TFLOP
#   (same FLOPs as a chunked DynamicCache prefill; ~92 TFLOP total, ~0.15-0.2 s on an H200 at
#   realistic GEMM / FlashAttention-2 rates)
#   polykv extra, memory-bound: history decode reads 28 x 4096 = 114,688 rows/layer x 4 layers =
#             458,752 compressed rows (q8_0 K + turbo3 V: 1,488 B/row over 8 heads -> 0.68 GB) and
#             writes them dense bf16 (4,096 B/row -> 1.88 GB), which flash then reads; turbo3's
#             inverse rotation is 32.8 kFLOP fp32 per head-row -> 0.12 TFLOP fp32; the chunk's K/V
#             expanded to Hq (67 MB per chunk and layer), the LSE merge and its layout copies move
#             ~6 x 33.5 MB per chunk and layer (~8 GB in all with the expansion); the chunk's
#             compressed write is 32768 x 4 x 1,488 B = 0.2 GB. Together ~11 GB: ~2-3 ms at
#             4.8 TB/s, i.e. the split path should sit within a few % of the chunked baseline.
#   The old path (chunks of 512: a torch-op decode of the whole history in float32 per chunk, then
#   SDPA with a boolean [C, L] mask, which rules out the flash backend) decoded 512 x 2016 = 1.03M
#   rows per layer (4.1M in all; ~10 torch ops over the whole history per chunk and layer), plus
#   64 x 4 masked SDPA calls.


def flash_supported(q: torch.Tensor) -> bool:
    """Whether `flash_attention_lse` runs for q's device/dtype/head_dim: any float on CPU (aten's
    CPU flash kernel); on CUDA FlashAttention-2's limits (fp16/bf16, head_dim % 8 == 0, <= 256)."""
    if not q.is_cuda:
        return q.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    D = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256


def flash_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with a flash kernel that also returns the log-sum-exp.

    q [B, H, Lq, D], k/v [B, H, Lk, D] (same H, same dtype; Lk >= 1). causal: query i sees keys
    <= i (top-left aligned; callers use it with Lq == Lk only). Returns out [B, H, Lq, D] (q.dtype)
    and lse float32 [B, H, Lq], natural log of sum exp(score * scale) (FlashAttention-2's
    softmax_lse and aten's CPU flash kernel both return the natural log; tests check the CPU one,
    `polykv.bench.prefill_check` the CUDA one). Uses aten's private flash ops directly: SDPA
    returns no LSE. Schemas (torch 2.11 and 2.13):
        _scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask, *,
            scale) -> (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, dbg)
        _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
            scale) -> (out, logsumexp)
    (the CPU kernel dies with SIGFPE on Lk == 0: callers skip empty key sets)."""
    if k.shape[2] == 0:
        raise ValueError("flash_attention_lse: empty key set (skip the call, lse would be -inf)")
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=causal, scale=scale)
    out, lse = r[0], r[1]
    return out, lse[..., : q.shape[2]].float()


def _merge_fn():
    """The project's one LSE merge: `dispatch.merge_attention` (Triton on CUDA, the reference on
    CPU) when importable, else the reference."""
    mod = _dispatch_module()
    return mod.merge_attention if mod is not None else merge_attention_ref


def prefill_attention_split(q: torch.Tensor, hist_k: torch.Tensor, hist_v: torch.Tensor,
                            new_k: torch.Tensor, new_v: torch.Tensor, *, scaling: float | None,
                            hist_start: int, pos0: int, window: int | None) -> torch.Tensor:
    """`prefill_attention` (same arguments, same result up to float rounding) without a [C, L] mask.

    Full-attention layers: every history row (absolute positions < pos0) is visible to every chunk
    query, so the attention splits into
        history part  q against hist K/V, non-causal. GQA without expanding K/V: the g query heads of
                      a KV head become rows, q [1, Hq, C, D] viewed as [1, Hkv, g*C, D] (head
                      h = kv*g + i, repeat_interleave order);
        chunk part    q against the chunk's own K/V, causal; only these C rows are expanded to Hq;
    each by a flash kernel that returns the LSE, merged by LSE. An empty history skips its part.
    hist_k/hist_v: decoded history in q.dtype (true space, keys unscaled) [1, Hkv, L, D].

    Sliding-window layers keep the masked path (`prefill_attention`): a window band is not a flash
    shape here, and a window layer's history is at most window-1 rows, so that path costs
    O(C * (window + C)) per chunk, not O(C * document). K/V are expanded to Hq first so that CUDA's
    SDPA can take its memory-efficient kernel with the mask (no GQA + mask kernel exists).
    Returns [1, C, Hq, D]."""
    B, Hq, C, D = q.shape
    Hkv, L = new_k.shape[1], hist_k.shape[2]
    g = Hq // Hkv
    if window is not None:
        if g > 1:
            hist_k, hist_v = hist_k.repeat_interleave(g, 1), hist_v.repeat_interleave(g, 1)
            new_k, new_v = new_k.repeat_interleave(g, 1), new_v.repeat_interleave(g, 1)
        return prefill_attention(q, hist_k, hist_v, new_k, new_v, scaling=scaling,
                                 hist_start=hist_start, pos0=pos0, window=window)
    if hist_start + L > pos0:
        raise ValueError(f"history rows [{hist_start}, {hist_start + L}) overlap the chunk at {pos0}")
    scale = 1.0 / math.sqrt(D) if scaling is None else float(scaling)
    ck = new_k.repeat_interleave(g, 1) if g > 1 else new_k
    cv = new_v.repeat_interleave(g, 1) if g > 1 else new_v
    out_c, lse_c = flash_attention_lse(q, ck, cv, causal=True, scale=scale)
    if L == 0:
        return out_c.transpose(1, 2)
    qh = q.reshape(B, Hkv, g * C, D)
    out_h, lse_h = flash_attention_lse(qh, hist_k.to(q.dtype), hist_v.to(q.dtype), causal=False,
                                       scale=scale)
    out, _ = _merge_fn()(out_h.reshape(B, Hq, C, D), lse_h.reshape(B, Hq, C), out_c, lse_c)
    return out.transpose(1, 2)


# --- host-tier documents: the prefix streamed in chunks ---------------------------------------------
class PrefixStreamer:
    """Brings the chunks of a host-tier layer (`polykv.pool.residency.HostLayer`) to the device, one
    per cascade step; one streamer per agent batch, so one copy per chunk per layer per forward feeds
    every agent of the batch.

    CPU device: yields Packed views of the host chunks themselves (nothing to copy).
    CUDA: each chunk is ONE non-blocking copy of its pinned contiguous buffer into one of two device
    buffers (double buffering), issued on a side stream one chunk ahead, so chunk i+1 crosses while
    the cascade over chunk i runs. The compute stream waits for a chunk's copy event before reading
    it; a buffer is refilled only after the compute stream recorded that it is done with it. Each
    layer's walk first joins the side stream to the compute stream (everything queued before it,
    earlier reads of the buffers included, happens first) and uses only events recorded within the
    walk, so it is capturable in a CUDA graph: the copies become memcpy nodes on a forked branch.
    Counters: `chunks_read` / `bytes_read` (chunks and bytes yielded, copied or not)."""

    def __init__(self, device, max_chunk_bytes: int = 0):
        self.device = torch.device(device)
        self.max_chunk_bytes = int(max_chunk_bytes)  # the largest chunk of any layer it will stream
        self.buffers: list[torch.Tensor] = []  # CUDA: two uint8 [max_chunk_bytes] buffers
        self.chunks_read = 0
        self.bytes_read = 0
        self._side = None

    def tensors(self) -> list[torch.Tensor]:
        """The device buffers (GPU memory this streamer holds; empty on CPU)."""
        return list(self.buffers)

    def chunks(self, layer) -> "ChunkWalk":
        """The chunks of `layer` in row order (`ChunkWalk`: iterate once for (k Packed, v Packed
        leading [1, Hkv, rows], row0), readable on the device; a yielded view is valid until the
        next one is asked for)."""
        return ChunkWalk(self._walk(layer), [c.row0 for c in layer.chunks])

    def _walk(self, layer):
        if self.device.type != "cuda":
            for c in layer.chunks:
                self.chunks_read += 1
                self.bytes_read += c.nbytes
                k, v = c.packed()
                yield k, v, c.row0
            return
        yield from self._cuda_chunks(layer)

    def _cuda_chunks(self, layer):
        need = layer.max_chunk_bytes()
        if not self.buffers:  # allocated once, for every layer: never freed while copies are queued
            self._side = torch.cuda.Stream(self.device)
            self.buffers = [torch.empty(max(need, self.max_chunk_bytes), dtype=torch.uint8, device=self.device)
                            for _ in range(2)]
            for b in self.buffers:
                b.record_stream(self._side)
        if self.buffers[0].numel() < need:
            raise ValueError(f"PrefixStreamer: a chunk of {need} bytes exceeds max_chunk_bytes="
                             f"{self.buffers[0].numel()}")
        main = torch.cuda.current_stream(self.device)
        chunks = layer.chunks
        ready = [torch.cuda.Event() for _ in range(2)]
        free: list[torch.cuda.Event | None] = [None, None]  # recorded by `main` after reading buffer j
        self._side.wait_stream(main)  # fork: the earlier reads of both buffers come first

        def issue(i):
            j = i % 2
            if free[j] is not None:
                self._side.wait_event(free[j])  # never overwrite a buffer the cascade still reads
            with torch.cuda.stream(self._side):
                self.buffers[j][: chunks[i].nbytes].copy_(chunks[i].data, non_blocking=True)
                ready[j].record(self._side)

        if chunks:
            issue(0)
        for i, c in enumerate(chunks):
            if i + 1 < len(chunks):
                issue(i + 1)
            j = i % 2
            main.wait_event(ready[j])  # join: every copy is waited for by `main`
            self.chunks_read += 1
            self.bytes_read += c.nbytes
            k, v = c.packed(self.buffers[j])
            yield k, v, c.row0
            free[j] = torch.cuda.Event()
            free[j].record(main)  # the cascade over chunk i is queued on `main`


def _one_call(q, suffix_k, chunks, backend: str) -> bool:
    """Whether a full-attention layer's chunks go to one `cascade_attention` call: always on the
    reference path; on the kernels when every chunk starts at a multiple of PREFIX_CHUNK_ALIGN."""
    mod = _dispatch_module() if backend in ("auto", "dispatch") else None
    if mod is None or not (backend == "dispatch" or mod.use_triton(q, suffix_k.codes)):
        return True
    starts = getattr(chunks, "row_starts", None)
    return starts is not None and all(r % mod.PREFIX_CHUNK_ALIGN == 0 for r in starts)


class ChunkWalk:
    """One pass over a host-tier layer's chunks (an iterator of (k, v, row0)) that also tells, before
    it starts, where every chunk begins (`row_starts`): whether the kernels can take the chunks as
    one prefix (`streamed_cascade_attention`)."""

    def __init__(self, it, row_starts: list[int]):
        self._it, self.row_starts = it, row_starts

    def __iter__(self):
        return self._it


def streamed_cascade_attention(q, chunks, suffix_k, suffix_v, suffix_lens, k_codec, v_codec, *,
                               prefix_end: int, sm_scale=None, k_innerq=None, window=None,
                               prefix_start=0, backend: str = "auto", suffix_pages=None,
                               page_size: int = 0, suffix_rows: int | None = None):
    """`cascade_attention` with the shared prefix given as chunks of rows instead of one Packed.

    q [N, Hq, n_q, D]; chunks: iterable of (k, v, row0), Packed leading [1, Hkv, rows] holding prefix
    rows [row0, row0 + rows) (`PrefixStreamer.chunks`); prefix_start: absolute position of prefix row
    0, prefix_end: absolute position of suffix row 0 (the document length; required: a chunk is not
    the whole prefix). The suffix arguments are `cascade_attention`'s.

    Full-attention layers: one `cascade_attention` over the chunks (`prefix_chunks`) — on the
    reference path (the reference joins them), or on the kernels when every chunk starts at a
    multiple of `dispatch.PREFIX_CHUNK_ALIGN` rows (`ChunkWalk.row_starts`; the pool's default
    chunks do): the kernels run the resident prefix pass's own splits chunk by chunk as the chunks
    arrive — the resident document's values, bit for bit. Otherwise (sliding-window layers, other
    chunkings) each chunk is one cascade call; the first carries the agents' suffixes, later ones
    none: full-attention layers pass suffix lengths 0 (every prefix row is visible to every query),
    sliding-window layers keep the real lengths, which place the queries, and get no suffix rows
    (suffix_rows=0, or a 0-row dense suffix); the partial results are merged by LSE in float32
    (`dispatch.merge_attention`), cast to q.dtype once — the unchunked values up to float
    rounding. Chunk row i sits at prefix_start + row0 + i, so the window rule is the unchunked
    one. Returns out [N, Hq, n_q, D] (q.dtype), lse float32 [N, Hq, n_q]."""
    if window is None and _one_call(q, suffix_k, chunks, backend):
        return cascade_attention(q, None, None, suffix_k, suffix_v, suffix_lens, k_codec, v_codec,
                                 sm_scale=sm_scale, k_innerq=k_innerq, backend=backend,
                                 suffix_pages=suffix_pages, page_size=page_size,
                                 suffix_rows=suffix_rows, prefix_chunks=chunks,
                                 prefix_rows=prefix_end - prefix_start)
    merge = _merge_fn()
    out = lse = None
    rest = None  # (suffix_k, suffix_v, lens) of the chunks after the first
    for pk, pv, row0 in chunks:
        first = out is None
        if not first and rest is None:
            if window is None:
                rest = (suffix_k, suffix_v, torch.zeros_like(suffix_lens))
            elif suffix_pages is None:
                none = (slice(None), slice(None), slice(0, 0))
                rest = (suffix_k.index(none), suffix_v.index(none), suffix_lens)
            else:
                rest = (suffix_k, suffix_v, suffix_lens)
        sk, sv, lens = (suffix_k, suffix_v, suffix_lens) if first else rest
        o, l = cascade_attention(q, pk, pv, sk, sv, lens, k_codec, v_codec, sm_scale=sm_scale,
                                 k_innerq=k_innerq, window=window,
                                 prefix_start=prefix_start + int(row0), prefix_end=prefix_end,
                                 backend=backend, suffix_pages=suffix_pages, page_size=page_size,
                                 suffix_rows=suffix_rows if first else 0)
        if first:
            out, lse = o.float(), l
        else:
            out, lse = merge(out, lse, o.float(), l)
    if out is None:
        raise ValueError("streamed_cascade_attention: no prefix chunks (a document has >= 1 row)")
    return out.to(q.dtype), lse
