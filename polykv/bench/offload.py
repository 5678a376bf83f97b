"""`polykv bench offload`: decode steps over a host-resident (streamed) document vs the same document
GPU-resident, vs transformers' offloaded dense cache, with the machine's pinned H2D bandwidth
measured in the same run (issue H).

Rows (DESIGN §6): {agents, ctx, tier, ms, h2d_gbps, h2d_peak_gbps, ...}, one per (ctx, agents, tier):
    tier "gpu"       polykv, the document's compressed layers on the GPU (the resident step)
    tier "host"      polykv, the same packed rows in pinned host memory, streamed into the cascade
                     chunk by chunk (one copy per chunk and layer per step for all agents)
    tier "offloaded" transformers `DynamicCache(offloading=True)`: N dense bf16 copies of the
                     document (the baseline a user has without polykv), batched greedy steps
ms: median wall time of a decode step (feed + greedy choice on the device + one host copy of the
tokens). For "host": stream_bytes = the compressed prefix bytes a step copies host -> device,
h2d_gbps = stream_bytes / (ms_host - ms_gpu) (the streaming cost on top of the resident step; CUDA
only) and
step_bound_ms = 1.33 * stream_bytes / h2d_peak + ms_gpu, issue H's target (ms <= step_bound_ms).
h2d_peak_gbps: a 1 GiB pinned host -> device copy, CUDA events, median of 10.
Host rows also carry the measured agreement of the two tiers' next-token logits after the suffix
prefill and one decode step (logits_max_abs_diff, logits_bit_identical, argmax_agree).

Model: the random-initialised Llama-3-8B-shape model of `polykv.bench.e2e` (timing does not depend
on trained weights); `--tiny --device cpu` runs the same code on a toy model for a smoke test.
"""

from __future__ import annotations

import statistics

import torch

from ..cache.accounting import storage_bytes
from .e2e import Clock, _greedy_loop, _next_tokens, build_model, env_info, kv_tensors, prefill, use_attention

DEFAULTS = dict(agents=(1, 8, 32, 64), ctxs=(65536, 262144), layers=4, suffix_tokens=64, steps=10,
                warmup=2, k="q8_0", v="turbo3", chunk=4096, stream_chunk_rows=16384)
TABLE_COLUMNS = ("ctx", "agents", "tier", "ms", "ms_gpu_tier", "h2d_gbps", "h2d_peak_gbps", "step_bound_ms")


def pinned_h2d_gbps(nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """Measured pinned host -> device copy bandwidth (GB/s), median of `reps`; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    del src, dst
    return nbytes / statistics.median(times[1:]) / 1e6


def _tier(pool, doc: str) -> str:
    """The document's tier as the pool reports it while its batch is open (recorded beside each
    row: the tier that was measured)."""
    return next(d["tier"] for d in pool.documents() if d["id"] == doc)


def _polykv_steps(clock: Clock, pool, doc: str, suffixes: list[list[int]], warmup: int, steps: int) -> dict:
    use_attention(pool.model, "polykv")
    # promote=False: a host-tier document is streamed, not brought to the GPU by opening the batch
    with pool.open_batch(doc, capacity=len(suffixes), seq_capacity=len(suffixes[0]) + warmup + steps + 8,
                         promote=False) as batch:
        for s in suffixes:
            batch.add(s)
        state = {"toks": _next_tokens(batch)[0]}

        def step():
            batch.feed(state["toks"])
            state["toks"] = _next_tokens(batch)[0]

        return dict(clock.steps(step, warmup, steps), doc_tier=_tier(pool, doc))


@torch.no_grad()
def _tier_logits(pool, doc: str, suffixes: list[list[int]]) -> torch.Tensor:
    """Float32 [agents, vocab] next-token logits after the agents' suffix prefill and one decode
    step, read from the document in whatever tier it is in (no promotion). The decode step feeds
    each agent's first suffix token, not its argmax: two tiers whose prefill logits differ by
    rounding may break an argmax tie differently, and would then compare different inputs."""
    with pool.open_batch(doc, capacity=len(suffixes), promote=False) as batch:
        aids = [batch.add(s) for s in suffixes]
        batch.step()
        batch.feed({a: s[0] for a, s in zip(aids, suffixes)})
        out = batch.step()
        return torch.stack([out[a] for a in aids])


@torch.no_grad()
def _offloaded_steps(clock: Clock, model, doc_ids: torch.Tensor, sfx: torch.Tensor, chunk: int, warmup: int,
                     steps: int) -> dict:
    """transformers' offloaded DynamicCache with N dense copies of the document, batched greedy steps."""
    from transformers import DynamicCache

    use_attention(model, "sdpa")
    n, s = sfx.shape
    cache = DynamicCache(config=model.config, offloading=True)
    prefill(model, cache, doc_ids[None].expand(n, -1).contiguous(), chunk)
    ctx = doc_ids.numel()
    pos = torch.arange(ctx, ctx + s, device=sfx.device)[None].expand(n, -1)
    logits = model(input_ids=sfx, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    step_pos = torch.full((n, 1), ctx + s, dtype=torch.long, device=sfx.device)

    def forward(ids):
        out = model(input_ids=ids, position_ids=step_pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step_pos.add_(1)
        return out.logits[:, -1]

    t = _greedy_loop(clock, forward, logits.argmax(-1), warmup, steps)
    t["kv_bytes"] = storage_bytes(kv_tensors(cache))
    del cache
    return t


def bench_offload(agents=DEFAULTS["agents"], ctxs=DEFAULTS["ctxs"], layers: int = DEFAULTS["layers"],
                  suffix_tokens: int = DEFAULTS["suffix_tokens"], steps: int = DEFAULTS["steps"],
                  warmup: int = DEFAULTS["warmup"], k: str = DEFAULTS["k"], v: str = DEFAULTS["v"],
                  chunk: int = DEFAULTS["chunk"], stream_chunk_rows: int = DEFAULTS["stream_chunk_rows"],
                  device: str = "cuda", tiny: bool = False, baseline_max_host_bytes: int = 16 << 30,
                  log=lambda m: None, on_rows=lambda rows: None) -> dict:
    """One row per (ctx, agents, tier); see the module doc. The offloaded baseline is skipped (with
    the reason in the row) where its N dense copies would exceed `baseline_max_host_bytes` or where
    it runs out of memory. `on_rows(rows)` is called after every agent count (partial results)."""
    from ..pool import SharedKVPool

    dev = torch.device(device)
    clock = Clock(dev)
    model = build_model(layers, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, tiny)
    cfg = model.config
    peak = pinned_h2d_gbps() if dev.type == "cuda" else None
    log(f"offload: pinned H2D {peak} GB/s")
    g = torch.Generator().manual_seed(3)
    rows = []
    for ctx in ctxs:
        doc_ids = torch.randint(0, cfg.vocab_size, (ctx,), generator=g)
        sfx = torch.randint(0, cfg.vocab_size, (max(agents), suffix_tokens), generator=g)
        pool = SharedKVPool(model, None, k=k, v=v, progress=False, prefill_chunk=chunk,
                            host_budget_bytes=1 << 62, stream_chunk_rows=stream_chunk_rows)
        log(f"offload: prefill {ctx} tokens")
        doc = pool.add_document(doc_ids.tolist())
        stream_bytes = pool.memory_report()["kv_bytes_shared"]
        dense_one = 2 * ctx * cfg.num_key_value_heads * cfg.head_dim * 2 * cfg.num_hidden_layers
        for n in agents:
            suffixes = sfx[:n].tolist()
            base = dict(ctx=ctx, agents=n, layers=layers, k=k, v=v, h2d_peak_gbps=peak)
            pool.move(doc, "gpu")
            log(f"offload: ctx {ctx}, {n} agents, gpu tier")
            t_gpu = _polykv_steps(clock, pool, doc, suffixes, warmup, steps)
            want = _tier_logits(pool, doc, suffixes)
            rows.append(dict(base, tier="gpu", ms=t_gpu["ms"], ms_min=t_gpu["ms_min"], h2d_gbps=None,
                             doc_tier=t_gpu["doc_tier"]))
            pool.move(doc, "host")
            log(f"offload: ctx {ctx}, {n} agents, host tier (streamed)")
            t_host = _polykv_steps(clock, pool, doc, suffixes, warmup, steps)
            got = _tier_logits(pool, doc, suffixes)
            extra = t_host["ms"] - t_gpu["ms"]
            rows.append(dict(base, tier="host", ms=t_host["ms"], ms_min=t_host["ms_min"], ms_gpu_tier=t_gpu["ms"],
                             doc_tier=t_host["doc_tier"],
                             logits_max_abs_diff=float((got - want).abs().max()),
                             logits_bit_identical=bool(torch.equal(got, want)),
                             argmax_agree=float((got.argmax(-1) == want.argmax(-1)).float().mean()),
                             stream_bytes=stream_bytes,
                             h2d_gbps=stream_bytes / extra / 1e6 if (peak and extra > 0) else None,
                             step_bound_ms=(1.33 * stream_bytes / (peak * 1e6) + t_gpu["ms"]) if peak else None))
            row = dict(base, tier="offloaded", ms=None, h2d_gbps=None, kv_bytes=n * dense_one)
            if dev.type != "cuda":
                row["skipped"] = "transformers' offloaded DynamicCache needs CUDA"
            elif n * dense_one > baseline_max_host_bytes:
                row["skipped"] = (f"{n} dense copies need {n * dense_one / 2**30:.1f} GiB of host memory "
                                  f"(limit {baseline_max_host_bytes / 2**30:.0f} GiB)")
            else:
                log(f"offload: ctx {ctx}, {n} agents, transformers offloaded DynamicCache")
                try:
                    t = _offloaded_steps(clock, model, doc_ids.to(dev), sfx[:n].to(dev), chunk, warmup, steps)
                    row.update(ms=t["ms"], ms_min=t["ms_min"], kv_bytes=t["kv_bytes"],
                               speedup_host_vs_offloaded=t["ms"] / t_host["ms"])
                except (torch.OutOfMemoryError, RuntimeError) as exc:  # CUDA/pinned-host OOM of the baseline
                    if "out of memory" not in str(exc).lower():
                        raise
                    row["skipped"] = f"transformers' offloaded DynamicCache ran out of memory: {str(exc)[:120]}"
                    log(f"offload: {row['skipped']}")
            rows.append(row)
            clock.free()
            on_rows(rows)
        del pool
    return dict(rows=rows, env=env_info(dev),
                config=dict(agents=list(agents), ctxs=list(ctxs), layers=layers, suffix_tokens=suffix_tokens,
                            steps=steps, warmup=warmup, k=k, v=v, chunk=chunk, stream_chunk_rows=stream_chunk_rows,
                            tiny=tiny, device=device))
