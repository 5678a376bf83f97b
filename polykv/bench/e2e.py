"""End-to-end benchmark (GPU): whole-model decode steps and prefill, polykv beside the plain
transformers way of doing the same job, measured in the same run (DESIGN §6 `polykv bench e2e`).

    PYTHONPATH=. python3 polykv/bench/e2e.py --out DIR      # or: polykv bench e2e [--json]

Writes DIR/gpu_e2e.json (after every scenario, so a late failure loses nothing) and DIR/gpu_e2e.png.
Contract: rows: [{scenario, agents, layers, ctx, ms_polykv, ms_baseline, speedup}] (+ extra fields).

Model: a random-initialised LlamaForCausalLM of Llama-3-8B shape (hidden 4096, 32 q heads, 8 KV
heads, head_dim 128, vocab 128256, rope_theta 5e5), bf16, SDPA, with the scenario's number of layers;
step time does not depend on trained weights. `tiny=True` is a toy of the same family for CPU tests.

Scenarios (each polykv figure beside its baseline, same model, same run):
* pool_decode    N agents over ONE ctx-token document, each with a private suffix (64 tokens).
                 polykv: SharedKVPool, one AgentBatch; a step = `feed` + `step_tokens` (greedy).
                 ms_polykv_pipelined: the same steps pipelined as `pool.generate` runs them
                 (`step_tokens_ahead`: step t+1 launched with step t's ids fed on the device, step
                 t's ids read after), in a second batch of the same run over the same captured
                 steps; `pipelined_identical`: both loops chose the same tokens at every step.
                 Captured steps compile the model's norms, MLPs and rotary (`hf.graphs.capture_step`,
                 the library default on CUDA); with compile on, every row is timed again with
                 them eager (POLYKV_COMPILE=0): ms_polykv_eager_modules[_pipelined].
                 baseline: the document prefilled once into a DynamicCache (chunked), then
                 `copy.deepcopy(doc_cache).batch_repeat_interleave(N)` (transformers' own batch
                 expansion: N dense copies), the N suffixes in one batched forward, then batched
                 [N, 1] decode steps. An N whose baseline would not fit (estimated from the
                 measured single copy vs free memory) keeps its polykv figure, ms_baseline None and
                 `baseline_skipped` saying why.
* kvcache_decode `KVCache(model, k, v)` drop-in at batch B: prefill ctx tokens, then one-token decode
                 steps (through `polykv.hf.graphs.DecodeGraph` when it exists, else eager;
                 `polykv_path` says which). Baselines: DynamicCache eager (ms_baseline); StaticCache
                 eager (ms_static_eager) and StaticCache + torch.compile(mode="reduce-overhead",
                 fullgraph=True) of the decode forward, gpt-fast style (ms_static_compile).
* prefill        `pool.add_document` of ctx tokens vs a chunked DynamicCache prefill, each timed
                 once after a warm-up at a small size.
`agents` is the batch size in kvcache_decode rows and 1 in prefill rows. Each side of a row runs
guarded: an exception (OOM included) lands in row["errors"] and in the top-level `errors` list.

Timing: a few untimed warm-up steps, then the median of `steps` steps; each step is timed with
torch.cuda.synchronize() + time.perf_counter() around the whole step, host work included (Python,
launches, the one device-to-host copy of the chosen tokens a generation loop needs): that host work
is what DESIGN §8 is about. `*_gpu` fields: CUDA-event time of the same span. A pipelined loop is
not synchronised between steps (that would undo the overlap): `Clock.loop` takes the median interval
between the ends of consecutive steps, and the mean over the whole timed run (`*_mean`). Every
decode loop (polykv and baselines) chooses greedy tokens on the device and copies them to the host
once a step.
torch's cuDNN SDPA is switched off (torch 2.11 picks it for decode shapes and rebuilds its plan every
step, DESIGN §8), so the baselines run SDPA's flash / memory-efficient kernels.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from polykv.cache.accounting import storage_bytes

SCENARIOS = ("pool_decode", "prefill", "kvcache_decode")
"""Run order of the default: the two 4-layer scenarios share one model; compile (slowest) last."""

DEFAULTS = dict(agents=(1, 8, 32, 64), ctx=32768, layers=4, suffix_tokens=64, kv_ctx=16384, kv_layers=8,
                kv_batches=(1, 8), steps=20, warmup=3, k="q8_0", v="turbo3", chunk=4096)

Row = dict


# --- model ------------------------------------------------------------------------------------
def model_config(layers: int, tiny: bool = False):
    """LlamaConfig of Llama-3-8B shape with `layers` layers; `tiny`: a toy of the same family
    (hidden 64, 4 q heads, 2 KV heads, head_dim 32 — the smallest turbo group, vocab 256)."""
    from transformers import LlamaConfig

    shape = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, vocab_size=256) if tiny else
             dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, vocab_size=128256))
    return LlamaConfig(num_hidden_layers=layers, rope_theta=500000.0, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, attn_implementation="sdpa", **shape)


def build_model(layers: int, device: torch.device, dtype: torch.dtype, tiny: bool = False):
    """Random-initialised LlamaForCausalLM, built directly on `device` in `dtype` (no host copy,
    no float32 detour; bf16 weights: 3.8 GB at 4 layers, 2.1 GB of it embeddings and head). Seeded."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(model_config(layers, tiny))
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def use_attention(model, name: str) -> None:
    """Switch the model between "polykv" (the pool's / KVCache's attention, set again before every
    polykv run because the baselines switch it away) and plain "sdpa" (what a user without polykv
    runs: no detour through polykv's fallback, nothing for torch.compile to trace through)."""
    if name == "polykv":
        from polykv.hf.attention import use_polykv_attention

        use_polykv_attention(model)
    else:
        model.set_attn_implementation(name)


# --- measuring --------------------------------------------------------------------------------
class Clock:
    """Wall time around a whole call (synchronize before and after: host work included) and, on
    CUDA, the CUDA-event time of the same span; peak-memory bookkeeping. No CUDA call on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def call(self, fn: Callable):
        """(fn(), wall ms, GPU-event ms or None)."""
        self.sync()
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            e1.record()
        self.sync()
        wall = (time.perf_counter() - t0) * 1e3
        return out, wall, (e0.elapsed_time(e1) if self.cuda else None)

    def steps(self, step: Callable[[], None], warmup: int, steps: int) -> dict:
        """`warmup` untimed calls of `step`, then `steps` timed ones: {ms, ms_gpu (medians), ms_min,
        ms_max, steps}."""
        for _ in range(warmup):
            step()
        walls, gpus = [], []
        for _ in range(max(1, steps)):
            _, w, g = self.call(step)
            walls.append(w)
            gpus.append(g)
        return dict(ms=statistics.median(walls), ms_gpu=statistics.median(gpus) if self.cuda else None,
                    ms_min=min(walls), ms_max=max(walls), steps=len(walls))

    def loop(self, step: Callable[[], None], warmup: int, steps: int) -> dict:
        """`warmup` untimed calls, then `steps` calls back to back, not synchronised in between (a
        pipelined step returns while the device still runs the next one): {ms (median interval
        between the ends of consecutive calls, the first measured from the end of the warm-up),
        ms_mean (the timed run / steps), ms_min, ms_max, steps}."""
        for _ in range(warmup):
            step()
        ends = [time.perf_counter()]
        for _ in range(max(1, steps)):
            step()
            ends.append(time.perf_counter())
        gaps = [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]
        return dict(ms=statistics.median(gaps), ms_mean=(ends[-1] - ends[0]) * 1e3 / len(gaps),
                    ms_min=min(gaps), ms_max=max(gaps), steps=len(gaps))

    def start(self) -> int:
        """Reset the peak counter; returns bytes allocated now (0 on CPU)."""
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def free_bytes(self) -> int | None:
        """Device memory a new allocation can get (after emptying the allocator's cache)."""
        if not self.cuda:
            return None
        self.free()
        return torch.cuda.mem_get_info()[0]


def _peak_fields(clock: Clock, who: str, base: int) -> dict:
    peak = clock.peak()
    return {f"peak_bytes_{who}": peak, f"peak_delta_bytes_{who}": None if peak is None else peak - base}


def kv_tensors(cache) -> list[torch.Tensor]:
    """K/V tensors of a transformers DynamicCache / StaticCache (layers with .keys / .values)."""
    return [t for lay in cache.layers for t in (getattr(lay, "keys", None), getattr(lay, "values", None))
            if isinstance(t, torch.Tensor)]


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Chunked prefill of ids [B, n] (on the model's device) into `cache` at positions 0..n-1;
    returns the last position's logits [B, vocab]."""
    b, n = ids.shape
    out = None
    for a in range(0, n, chunk):
        e = min(n, a + chunk)
        pos = torch.arange(a, e, device=ids.device)[None].expand(b, -1)
        out = model(input_ids=ids[:, a:e], position_ids=pos, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
    return out.logits[:, -1]


def _greedy_loop(clock: Clock, forward: Callable[[torch.Tensor], torch.Tensor], first: torch.Tensor,
                 warmup: int, steps: int, trace: list | None = None) -> dict:
    """Decode steps of a dense-batch loop from tokens first [B]: forward(ids [B, 1]) -> logits
    [B, vocab]; the next tokens are the greedy argmax on the device, copied to the host once a step
    (`.tolist()`, as a generation loop must, for EOS and streaming). `trace` receives every step's
    tokens ([B] lists, `first` included)."""
    state = {"ids": first.reshape(-1, 1)}
    if trace is not None:
        trace.append(first.reshape(-1).tolist())

    def step():
        nxt = forward(state["ids"]).argmax(-1, keepdim=True)
        toks = nxt.tolist()
        if trace is not None:
            trace.append([t[0] for t in toks])
        state["ids"] = nxt

    return clock.steps(step, warmup, steps)


def _next_tokens(batch) -> tuple[dict[int, int], str]:
    """One AgentBatch step choosing greedy tokens: `step_tokens` (on the device, one host copy)
    where the batch has it, else `step` + argmax of each agent's host logits."""
    if hasattr(batch, "step_tokens"):
        return batch.step_tokens(), "step_tokens"
    return {aid: int(torch.argmax(l)) for aid, l in batch.step().items()}, "step+argmax"


def greedy_steps(clock: "Clock", batch, warmup: int = 2, steps: int = 8) -> dict:
    """Time `steps` greedy decode steps of an open batch whose agents are added (after `warmup`):
    clock.steps' figures plus "toks", each step's {agent: token}. The probes' step loop."""
    state = {"t": _next_tokens(batch)[0]}
    toks = []

    def step():
        batch.feed(state["t"])
        state["t"] = _next_tokens(batch)[0]
        toks.append(dict(state["t"]))

    r = clock.steps(step, warmup, steps)
    r["toks"] = toks
    r["step"] = step  # one more step (a profiler's)
    return r


# --- scenario a: N agents over one document -------------------------------------------------------
def baseline_need_bytes(n: int, single: int, layers: int, gqa: int) -> int:
    """Device bytes the batched DynamicCache baseline needs beyond what is allocated: n dense copies
    of the document KV (`single` bytes, all layers), plus its largest transient: the suffix prefill
    passes a mask, so transformers' SDPA repeats one layer's K and V to all q heads (gqa x), and a
    decode step's torch.cat holds a layer's old and new K/V together; plus 2 GiB of activations."""
    per_layer = n * single / layers
    return int(n * single + per_layer * (gqa + 1)) + (2 << 30)


def _pool_polykv(clock: Clock, pool, doc: str, suffixes: list[list[int]], warmup: int, steps: int,
                 trace: list | None = None, trace_pipelined: list | None = None, pipelined: bool = True) -> dict:
    """One AgentBatch of len(suffixes) agents: suffix prefill, then timed feed + step_tokens steps;
    then (pipelined) `_pool_polykv_pipelined` in a second batch over the same document (it takes
    over this batch's storage and captured steps: the same graphs, no capture). `trace` /
    `trace_pipelined` receive every step's tokens (lists in agent order, the suffix prefill's first)."""
    use_attention(pool.model, "polykv")
    base = clock.start()
    seq_cap = len(suffixes[0]) + warmup + steps + 16
    with pool.open_batch(doc, capacity=len(suffixes), seq_capacity=seq_cap) as batch:
        aids = [batch.add(s) for s in suffixes]
        (toks, path), ms_prefill, _ = clock.call(lambda: _next_tokens(batch))
        state = {"toks": toks}
        if trace is not None:
            trace.append([toks[a] for a in aids])

        def step():
            batch.feed(state["toks"])
            state["toks"], _ = _next_tokens(batch)
            if trace is not None:
                trace.append([state["toks"][a] for a in aids])

        t = clock.steps(step, warmup, steps)
        mem = pool.memory_report()
    row = dict(ms_polykv=t["ms"], ms_polykv_gpu=t["ms_gpu"], ms_polykv_min=t["ms_min"],
               ms_polykv_max=t["ms_max"], ms_polykv_suffix_prefill=ms_prefill, polykv_step=path,
               kv_bytes_polykv=mem["kv_bytes_shared"] + mem["kv_bytes_agents"],
               kv_bytes_polykv_shared=mem["kv_bytes_shared"], kv_bytes_polykv_agents=mem["kv_bytes_agents"],
               **_peak_fields(clock, "polykv", base))
    if pipelined:
        row.update(_pool_polykv_pipelined(clock, pool, doc, suffixes, warmup, steps, seq_cap, trace_pipelined))
    return row


def _pool_polykv_pipelined(clock: Clock, pool, doc: str, suffixes: list[list[int]], warmup: int, steps: int,
                           seq_cap: int, trace: list | None = None) -> dict:
    """The decode steps of `_pool_polykv`, pipelined (`AgentBatch.step_tokens_ahead`, as
    `pool.generate` runs them): a step launches step t+1 — its tokens fed on the device from step
    t's ids — then reads step t's ids (a non-blocking copy and an event). Timed by `Clock.loop`
    (no synchronisation between steps). The reads trail the launches by one: the first warm-up call
    reads the suffix prefill, and the step launched by the last call is read after the timing
    (its tokens are past the trace). `trace`: as in `_pool_polykv` (the same steps' tokens)."""
    with pool.open_batch(doc, capacity=len(suffixes), seq_capacity=seq_cap) as batch:
        if not hasattr(batch, "step_tokens_ahead"):
            return dict(ms_polykv_pipelined=None, pipelined_error="AgentBatch has no step_tokens_ahead")
        aids = [batch.add(s) for s in suffixes]
        state = {"ahead": batch.step_tokens_ahead()}  # the suffix prefill

        def step():
            nxt = batch.step_tokens_ahead()
            toks = state["ahead"].result()
            state["ahead"] = nxt
            if trace is not None:
                trace.append([toks[a] for a in aids])

        t = clock.loop(step, warmup + 1, steps)
        state["ahead"].result()
        captures = batch.graph_captures
    return dict(ms_polykv_pipelined=t["ms"], ms_polykv_pipelined_mean=t["ms_mean"],
                ms_polykv_pipelined_min=t["ms_min"], ms_polykv_pipelined_max=t["ms_max"],
                polykv_pipelined_captures=captures)


@torch.no_grad()
def _pool_baseline(clock: Clock, model, doc_cache, ctx: int, sfx: torch.Tensor, warmup: int,
                   steps: int, trace: list | None = None) -> dict:
    """Plain transformers: N deep copies of the document cache in one batch, the suffixes sfx [N, S]
    in one batched forward, then batched greedy decode steps (`trace`: as in `_greedy_loop`)."""
    use_attention(model, "sdpa")
    n, s = sfx.shape
    base = clock.start()

    def expand():
        c = copy.deepcopy(doc_cache)
        c.batch_repeat_interleave(n)
        return c

    cache, ms_copy, _ = clock.call(expand)
    pos = torch.arange(ctx, ctx + s, device=sfx.device)[None].expand(n, -1)
    logits, ms_prefill, _ = clock.call(lambda: model(input_ids=sfx, position_ids=pos, past_key_values=cache,
                                                     use_cache=True, logits_to_keep=1).logits[:, -1])
    step_pos = torch.full((n, 1), ctx + s, dtype=torch.long, device=sfx.device)

    def forward(ids):
        out = model(input_ids=ids, position_ids=step_pos, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        step_pos.add_(1)
        return out.logits[:, -1]

    t = _greedy_loop(clock, forward, logits.argmax(-1), warmup, steps, trace)
    row = dict(ms_baseline=t["ms"], ms_baseline_gpu=t["ms_gpu"], ms_baseline_min=t["ms_min"],
               ms_baseline_max=t["ms_max"], ms_baseline_suffix_prefill=ms_prefill, ms_baseline_copy=ms_copy,
               kv_bytes_baseline=storage_bytes(kv_tensors(cache)), **_peak_fields(clock, "baseline", base))
    del cache, logits
    return row


@torch.no_grad()
def run_pool_decode(model, clock: Clock, *, agents, ctx: int, suffix_tokens: int, k: str, v: str,
                    warmup: int, steps: int, chunk: int, log, compile: bool = False,
                    recents=()) -> list[Row]:
    """Scenario a (see module doc): one row per agent count. recents: recent windows R > 0 (issue
    K; a preset pool's default) also timed per row, a pool with `recent=R` over the same document:
    ms_polykv_recent{R}, ms_polykv_pipelined_recent{R}, speedup_pipelined_recent{R}."""
    from polykv.pool import SharedKVPool

    cfg = model.config
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(1)
    doc_ids = torch.randint(0, cfg.vocab_size, (ctx,), generator=g)
    sfx = torch.randint(0, cfg.vocab_size, (max(agents), suffix_tokens), generator=g)
    log(f"pool_decode: prefill {ctx} tokens (pool, {k}/{v})")
    pool = SharedKVPool(model, None, k=k, v=v, progress=False, prefill_chunk=chunk)
    doc = pool.add_document(doc_ids.tolist())
    log(f"pool_decode: prefill {ctx} tokens (DynamicCache)")
    use_attention(model, "sdpa")
    from transformers import DynamicCache

    doc_cache = DynamicCache(config=cfg)
    prefill(model, doc_cache, doc_ids[None].to(dev), chunk)
    single = storage_bytes(kv_tensors(doc_cache))
    gqa = cfg.num_attention_heads // cfg.num_key_value_heads
    rows = []
    for n in agents:
        row: Row = dict(scenario="pool_decode", agents=n, layers=cfg.num_hidden_layers, ctx=ctx,
                        suffix_tokens=suffix_tokens, k=k, v=v, ms_polykv=None, ms_baseline=None, speedup=None,
                        baseline=f"copy.deepcopy(DynamicCache).batch_repeat_interleave({n}), sdpa",
                        kv_bytes_baseline_single_copy=single)
        log(f"pool_decode: {n} agents, polykv")
        sync, piped = [], []
        _guard(row, "polykv", lambda: row.update(_pool_polykv(clock, pool, doc, sfx[:n].tolist(), warmup, steps,
                                                             trace=sync, trace_pipelined=piped)), clock)
        if row.get("ms_polykv_pipelined") is not None:
            row["pipelined_identical"] = piped == sync
            row["pipelined_gain"] = row["ms_polykv"] / row["ms_polykv_pipelined"]
        free = clock.free_bytes()
        need = baseline_need_bytes(n, single, cfg.num_hidden_layers, gqa)
        if free is not None and need > free:
            row["baseline_skipped"] = (f"needs ~{need / 2**30:.1f} GiB ({n} dense copies of "
                                       f"{single / 2**30:.2f} GiB + transients), {free / 2**30:.1f} GiB free")
            log(f"pool_decode: {n} agents, baseline skipped: {row['baseline_skipped']}")
        else:
            log(f"pool_decode: {n} agents, baseline")
            _guard(row, "baseline", lambda: row.update(
                _pool_baseline(clock, model, doc_cache, ctx, sfx[:n].to(dev), warmup, steps)), clock)
        _speedup(row, "ms_baseline", "speedup")
        _speedup(row, "ms_baseline", "speedup_pipelined", "ms_polykv_pipelined")
        rows.append(row)
        clock.free()
    for r in recents:
        log(f"pool_decode: prefill {ctx} tokens (pool, {k}/{v}, recent={r})")
        ring_pool = SharedKVPool(model, None, k=k, v=v, progress=False, prefill_chunk=chunk, recent=r)
        ring_doc = ring_pool.add_document(doc_ids.tolist())
        for row in rows:
            n = row["agents"]
            log(f"pool_decode: {n} agents, polykv recent={r}")
            res: dict = {}
            _guard(row, f"polykv_recent{r}", lambda: res.update(
                _pool_polykv(clock, ring_pool, ring_doc, sfx[:n].tolist(), warmup, steps)), clock)
            if res:
                row.update({f"ms_polykv_recent{r}": res["ms_polykv"],
                            f"ms_polykv_pipelined_recent{r}": res.get("ms_polykv_pipelined")})
                _speedup(row, "ms_baseline", f"speedup_pipelined_recent{r}", f"ms_polykv_pipelined_recent{r}")
            clock.free()
        ring_pool.close()
        del ring_pool
    if compile:  # polykv again with the captured steps' norms, MLPs and rotary eager (POLYKV_COMPILE=0)
        from polykv.hf import graphs

        pool.close()  # the parked batch holds compiled captures: eager ones capture anew
        was, graphs.COMPILE = graphs.COMPILE, False
        try:
            for row in rows:
                n = row["agents"]
                log(f"pool_decode: {n} agents, polykv with eager norms / MLPs (POLYKV_COMPILE=0)")
                res: dict = {}
                _guard(row, "polykv_eager_modules", lambda: res.update(
                    _pool_polykv(clock, pool, doc, sfx[:n].tolist(), warmup, steps)), clock)
                if res:
                    row.update(ms_polykv_eager_modules=res["ms_polykv"],
                               ms_polykv_eager_modules_pipelined=res.get("ms_polykv_pipelined"))
                    _speedup(row, "ms_baseline", "speedup_eager_modules_pipelined",
                             "ms_polykv_eager_modules_pipelined")
                clock.free()
        finally:
            graphs.COMPILE = was
            pool.close()
    del doc_cache, pool
    return rows


# --- scenario b: KVCache drop-in --------------------------------------------------------------------
@torch.no_grad()
def _kv_polykv(clock: Clock, model, ids: torch.Tensor, k: str, v: str, chunk: int, warmup: int,
               steps: int, graph: bool, trace: list | None = None, recent: int = 0) -> dict:
    """KVCache at batch ids.shape[0] (recent: its recent window, issue K): chunked prefill, then
    decode steps through DecodeGraph (graph=True) or eager forwards (`trace`: as in `_greedy_loop`)."""
    from polykv.hf.kv_cache import KVCache

    b, ctx = ids.shape
    base = clock.start()
    cache = KVCache(model, k=k, v=v, recent=recent)  # switches the model to polykv attention
    logits, ms_prefill, _ = clock.call(lambda: prefill(model, cache, ids, chunk))
    if graph:
        from polykv.hf.graphs import DecodeGraph

        runner = DecodeGraph(model, cache, max_new_tokens=warmup + steps + 4)
        forward, mode = runner.step, getattr(runner, "mode", None)
    else:
        forward, mode = _eager_forward(model, cache, b, ctx, ids.device), None

    t = _greedy_loop(clock, forward, logits.argmax(-1), warmup, steps, trace)
    return dict(ms_polykv=t["ms"], ms_polykv_gpu=t["ms_gpu"], ms_polykv_min=t["ms_min"],
                ms_polykv_max=t["ms_max"], ms_polykv_prefill=ms_prefill,
                polykv_path="DecodeGraph" if graph else "eager", polykv_graph_mode=mode,
                kv_bytes_polykv=cache.nbytes(),
                **_peak_fields(clock, "polykv", base))


def _eager_forward(model, cache, batch: int, ctx: int, device) -> Callable[[torch.Tensor], torch.Tensor]:
    """One eager decode step over `cache` after a ctx-token prompt: ids [B, 1] -> logits [B, vocab]
    (positions advance on the device)."""
    pos = torch.full((batch, 1), ctx, dtype=torch.long, device=device)

    def forward(x):
        out = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True)
        pos.add_(1)
        return out.logits[:, -1]

    return forward


def _kv_polykv_any(clock: Clock, model, ids, k, v, chunk, warmup, steps, log, trace: list | None = None,
                   recent: int = 0) -> dict:
    """DecodeGraph when importable and working; otherwise eager, with the reason recorded."""
    try:
        from polykv.hf.graphs import DecodeGraph  # noqa: F401 - only probing
    except ImportError as e:
        why = f"ImportError: {e}"
    else:
        try:
            return _kv_polykv(clock, model, ids, k, v, chunk, warmup, steps, graph=True, trace=trace,
                              recent=recent)
        except Exception as e:  # a broken capture must not hide the eager figure
            why = f"{type(e).__name__}: {e}"[:2000]
            log(f"kvcache_decode: DecodeGraph failed, eager instead\n{traceback.format_exc()}")
        clock.free()
        if trace is not None:
            trace.clear()
    row = _kv_polykv(clock, model, ids, k, v, chunk, warmup, steps, graph=False, trace=trace, recent=recent)
    row["polykv_graph_error"] = why
    return row


@torch.no_grad()
def _kv_dynamic(clock: Clock, model, ids: torch.Tensor, chunk: int, warmup: int, steps: int,
                trace: list | None = None) -> dict:
    """transformers DynamicCache, eager: what `model.generate` does by default."""
    from transformers import DynamicCache

    use_attention(model, "sdpa")
    b, ctx = ids.shape
    base = clock.start()
    cache = DynamicCache(config=model.config)
    logits, ms_prefill, _ = clock.call(lambda: prefill(model, cache, ids, chunk))
    forward = _eager_forward(model, cache, b, ctx, ids.device)
    t = _greedy_loop(clock, forward, logits.argmax(-1), warmup, steps, trace)
    return dict(ms_baseline=t["ms"], ms_baseline_gpu=t["ms_gpu"], ms_baseline_min=t["ms_min"],
                ms_baseline_max=t["ms_max"], ms_baseline_prefill=ms_prefill,
                kv_bytes_baseline=storage_bytes(kv_tensors(cache)), **_peak_fields(clock, "baseline", base))


@torch.no_grad()
def _kv_static(clock: Clock, model, ids: torch.Tensor, chunk: int, warmup: int, steps: int,
               compile: bool, log, trace: list | None = None) -> dict:
    """transformers StaticCache: eager decode steps, then (compile=True) the same decode forward
    through torch.compile(mode="reduce-overhead", fullgraph=True) — gpt-fast style, CUDA graphs —
    continuing on the same cache (one prefill serves both). `trace`: the eager steps' tokens."""
    from transformers import StaticCache

    use_attention(model, "sdpa")
    b, ctx = ids.shape
    cw = max(warmup, 3)  # reduce-overhead records its CUDA graph on the second/third call
    base = clock.start()
    cache = StaticCache(config=model.config, max_cache_len=ctx + warmup + cw + 2 * steps + 16)
    logits, ms_prefill, _ = clock.call(lambda: prefill(model, cache, ids, chunk))
    pos = torch.full((b, 1), ctx, dtype=torch.long, device=ids.device)

    def decode(x, p):
        return model(input_ids=x, position_ids=p, past_key_values=cache, use_cache=True).logits[:, -1]

    def eager(x):
        out = decode(x, pos)
        pos.add_(1)
        return out

    t = _greedy_loop(clock, eager, logits.argmax(-1), warmup, steps, trace)
    row = dict(ms_static_eager=t["ms"], ms_static_eager_gpu=t["ms_gpu"], ms_static_prefill=ms_prefill,
               kv_bytes_static=storage_bytes(kv_tensors(cache)), ms_static_compile=None,
               **_peak_fields(clock, "static_eager", base))
    if not compile:
        row["static_compile_error"] = "not run (compile off)"
        return row
    try:
        torch._dynamo.reset()  # a fresh cache object per batch: no stale guards, no recompile limit
        compiled = torch.compile(decode, mode="reduce-overhead", fullgraph=True, dynamic=False)
        first = torch.zeros((b, 1), dtype=torch.long, device=ids.device)

        def step(x):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x, pos)
            pos.add_(1)
            return out

        _, ms_compile, _ = clock.call(lambda: step(first))  # trace + compile
        log(f"kvcache_decode: torch.compile took {ms_compile / 1e3:.1f} s")
        t = _greedy_loop(clock, step, first, cw, steps)
        row.update(ms_static_compile=t["ms"], ms_static_compile_gpu=t["ms_gpu"], static_compile_s=ms_compile / 1e3)
    except Exception as e:  # report the eager figures and why compile failed
        row["static_compile_error"] = f"{type(e).__name__}: {e}"[:2000]
        log(f"kvcache_decode: torch.compile failed\n{traceback.format_exc()}")
    finally:
        torch._dynamo.reset()
    return row


def run_kvcache_decode(model, clock: Clock, *, batches, ctx: int, k: str, v: str, warmup: int, steps: int,
                       chunk: int, compile: bool, log, recents=()) -> list[Row]:
    """Scenario b (see module doc): one row per batch size (`agents` = batch). recents: recent
    windows R > 0 (issue K) also timed per row, as ms_polykv_recent{R} / speedup_recent{R}."""
    cfg = model.config
    dev = next(model.parameters()).device
    rows = []
    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, ctx), generator=torch.Generator().manual_seed(2 + b)).to(dev)
        row: Row = dict(scenario="kvcache_decode", agents=b, batch=b, layers=cfg.num_hidden_layers, ctx=ctx,
                        k=k, v=v, ms_polykv=None, ms_baseline=None, speedup=None,
                        baseline="DynamicCache eager, sdpa")
        for who, fn in (
                ("polykv", lambda: _kv_polykv_any(clock, model, ids, k, v, chunk, warmup, steps, log)),
                ("baseline", lambda: _kv_dynamic(clock, model, ids, chunk, warmup, steps)),
                ("static", lambda: _kv_static(clock, model, ids, chunk, warmup, steps, compile, log))):
            log(f"kvcache_decode: batch {b}, {who}")
            _guard(row, who, lambda: row.update(fn()), clock)
        for r in recents:
            log(f"kvcache_decode: batch {b}, polykv recent={r}")
            _guard(row, f"polykv_recent{r}", lambda: row.update(
                {f"{key}_recent{r}": val for key, val in
                 _kv_polykv_any(clock, model, ids, k, v, chunk, warmup, steps, log, recent=r).items()}),
                clock)
            _speedup(row, "ms_baseline", f"speedup_recent{r}", f"ms_polykv_recent{r}")
        _speedup(row, "ms_baseline", "speedup")
        _speedup(row, "ms_static_compile", "speedup_vs_static_compile")
        _speedup(row, "ms_static_eager", "speedup_vs_static_eager")
        rows.append(row)
        del ids
        clock.free()
    return rows


# --- scenario c: prefill ------------------------------------------------------------------------
@torch.no_grad()
def run_prefill(model, clock: Clock, *, ctx: int, k: str, v: str, chunk: int, log) -> list[Row]:
    """Scenario c (see module doc): pool.add_document vs chunked DynamicCache prefill, one row."""
    from transformers import DynamicCache

    from polykv.pool import SharedKVPool

    cfg = model.config
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (ctx,), generator=g)
    warm = torch.randint(0, cfg.vocab_size, (min(ctx, 2048),), generator=g)
    row: Row = dict(scenario="prefill", agents=1, layers=cfg.num_hidden_layers, ctx=ctx, k=k, v=v, chunk=chunk,
                    ms_polykv=None, ms_baseline=None, speedup=None, baseline="DynamicCache, chunked, sdpa")

    def polykv():
        pool = SharedKVPool(model, None, k=k, v=v, progress=False, prefill_chunk=chunk)
        pool.add_document(warm.tolist())  # warm-up: Triton JIT, cuBLAS heuristics
        doc_ids = ids.tolist()
        base = clock.start()
        doc, ms, _ = clock.call(lambda: pool.add_document(doc_ids))
        info = next(d for d in pool.documents() if d["id"] == doc)
        row.update(ms_polykv=ms, kv_bytes_polykv=info["bytes"], **_peak_fields(clock, "polykv", base))

    def baseline():
        use_attention(model, "sdpa")
        prefill(model, DynamicCache(config=cfg), warm[None].to(dev), chunk)
        x = ids[None].to(dev)
        base = clock.start()
        cache = DynamicCache(config=cfg)
        _, ms, _ = clock.call(lambda: prefill(model, cache, x, chunk))
        row.update(ms_baseline=ms, kv_bytes_baseline=storage_bytes(kv_tensors(cache)),
                   **_peak_fields(clock, "baseline", base))

    for who, fn in (("polykv", polykv), ("baseline", baseline)):
        log(f"prefill: {ctx} tokens, {who}")
        _guard(row, who, fn, clock)
    _speedup(row, "ms_baseline", "speedup")
    return [row]


# --- driver ------------------------------------------------------------------------------------
def _guard(row: Row, who: str, fn: Callable[[], None], clock: Clock) -> None:
    """Run one side of a row; an exception (OOM included) is recorded in row["errors"][who] and
    the memory it held is released, so the other side and the other rows still run."""
    try:
        fn()
    except Exception as e:
        row.setdefault("errors", {})[who] = f"{type(e).__name__}: {e}"[:2000]
        print(f"!! {row['scenario']} {row['agents']} {who}\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        clock.free()


def _speedup(row: Row, key: str, out: str, polykv_key: str = "ms_polykv") -> None:
    a, b = row.get(key), row.get(polykv_key)
    row[out] = (a / b) if (a and b) else None


def env_info(device: torch.device) -> dict:
    """Versions, GPU, date and source revision: what a figure needs to be reproduced."""
    import platform
    import subprocess

    import transformers

    import polykv

    info = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=str(device), torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                polykv=polykv.__version__, triton=None, git=None)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        root = Path(__file__).resolve().parents[2]
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["git"] = (rev + ("+dirty" if dirty else "")) or None
    except Exception:  # not a checkout: the version above is all there is
        pass
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
                    flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
                    mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled())
    return info


def _stderr(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_e2e(agents=DEFAULTS["agents"], ctx: int = DEFAULTS["ctx"], layers: int = DEFAULTS["layers"],
              kv_ctx: int = DEFAULTS["kv_ctx"], kv_layers: int = DEFAULTS["kv_layers"],
              kv_batches=DEFAULTS["kv_batches"], steps: int = DEFAULTS["steps"], warmup: int = DEFAULTS["warmup"],
              scenarios=SCENARIOS, k: str = DEFAULTS["k"], v: str = DEFAULTS["v"],
              suffix_tokens: int = DEFAULTS["suffix_tokens"], chunk: int = DEFAULTS["chunk"],
              device: str = "cuda", compile: bool | None = None, tiny: bool = False, out: str | None = None,
              log: Callable[[str], None] | None = None, kv_recents=(), pool_recents=()) -> dict:
    """Run the scenarios (module doc) and return {rows, env, config, errors, seconds}. With `out`,
    writes out/gpu_e2e.json after every scenario and out/gpu_e2e.png at the end. compile=None: on
    for CUDA, off for CPU (inductor on a CPU toy only costs time). Logs go to stderr."""
    log = log or _stderr
    t0 = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # plan rebuilt every decode step (module doc)
    compile = (dev.type == "cuda") if compile is None else bool(compile)
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; known: {list(SCENARIOS)}")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    clock = Clock(dev)
    result = dict(rows=[], errors=[], env=env_info(dev),
                  config=dict(agents=list(agents), ctx=ctx, layers=layers, kv_ctx=kv_ctx, kv_layers=kv_layers,
                              kv_batches=list(kv_batches), kv_recents=list(kv_recents),
                              pool_recents=list(pool_recents), steps=steps,
                              warmup=warmup, scenarios=list(scenarios),
                              k=k, v=v, suffix_tokens=suffix_tokens, chunk=chunk, compile=compile, tiny=tiny,
                              dtype=str(dtype).replace("torch.", ""),
                              model=("tiny random Llama" if tiny else "random Llama-3-8B shape") +
                              ", layers per scenario"))
    held: dict = {}  # {layers: model}: one model alive at a time

    def model_for(n_layers: int):
        if n_layers not in held:
            held.clear()
            clock.free()
            log(f"building a {n_layers}-layer model on {dev}")
            held[n_layers] = build_model(n_layers, dev, dtype, tiny)
        return held[n_layers]

    runs = dict(
        pool_decode=lambda: run_pool_decode(model_for(layers), clock, agents=list(agents), ctx=ctx,
                                            suffix_tokens=suffix_tokens, k=k, v=v, warmup=warmup, steps=steps,
                                            chunk=chunk, log=log, compile=compile,
                                            recents=list(pool_recents)),
        prefill=lambda: run_prefill(model_for(layers), clock, ctx=ctx, k=k, v=v, chunk=chunk, log=log),
        kvcache_decode=lambda: run_kvcache_decode(model_for(kv_layers), clock, batches=list(kv_batches), ctx=kv_ctx,
                                                  k=k, v=v, warmup=warmup, steps=steps, chunk=chunk,
                                                  compile=compile, log=log, recents=list(kv_recents)))
    for name in scenarios:
        s0 = time.perf_counter()
        try:
            result["rows"] += runs[name]()
        except Exception as e:  # one broken scenario must not lose the others
            result["errors"].append(dict(scenario=name, error=f"{type(e).__name__}: {e}"[:2000],
                                         traceback=traceback.format_exc()))
            log(f"!! scenario {name} failed\n{traceback.format_exc()}")
        finally:
            clock.free()
        log(f"{name}: {time.perf_counter() - s0:.1f} s")
        result["seconds"] = time.perf_counter() - t0
        if out:
            write_json(result, out)
    held.clear()
    clock.free()
    result["errors"] += [dict(scenario=r["scenario"], agents=r["agents"], error=f"{who}: {e}")
                         for r in result["rows"] for who, e in r.get("errors", {}).items()]
    result["skipped"] = [dict(scenario=r["scenario"], agents=r["agents"], reason=r["baseline_skipped"])
                         for r in result["rows"] if r.get("baseline_skipped")]
    result["seconds"] = time.perf_counter() - t0
    if out:
        write_json(result, out)
        plot_e2e(result, Path(out) / "gpu_e2e.png")
    return result


def write_json(result: dict, out) -> Path:
    path = Path(out) / "gpu_e2e.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)
    return path


# --- report ------------------------------------------------------------------------------------
def plot_e2e(result: dict, path) -> None:
    """PNG, one panel per decode scenario present: pool_decode ms per step vs agents (polykv vs
    batched DynamicCache copies); kvcache_decode ms per step per batch size (polykv KVCache,
    DynamicCache, StaticCache + torch.compile)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pool = [r for r in result["rows"] if r["scenario"] == "pool_decode"]
    kv = [r for r in result["rows"] if r["scenario"] == "kvcache_decode"]
    panels = [f for f, rows in ((_plot_pool, pool), (_plot_kvcache, kv)) if rows] or [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.2), dpi=120, squeeze=False)
    for ax, draw in zip(axes[0], panels):
        if draw is None:
            ax.text(0.5, 0.5, "no decode rows", ha="center", va="center")
        else:
            draw(ax, pool if draw is _plot_pool else kv, result["config"])
    env = result["env"]
    fig.suptitle(f"polykv bench e2e — {env.get('gpu', env['device'])}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _plot_pool(ax, rows: list[Row], config: dict) -> None:
    for key, label, style in (("ms_polykv", f"polykv pool ({config['k']}/{config['v']})", "o-"),
                              ("ms_polykv_pipelined", "polykv pool, pipelined (step_tokens_ahead)", "o:"),
                              ("ms_polykv_eager_modules_pipelined", "polykv pool, pipelined, norms / MLPs eager", "^:"),
                              ("ms_baseline", "transformers: N DynamicCache copies, batched", "s--")):
        pts = [(r["agents"], r[key]) for r in rows if r.get(key)]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for r in rows:
        if r.get("baseline_skipped"):
            ax.axvline(r["agents"], color="gray", ls=":", lw=1)
            ax.text(r["agents"], 0.98, " baseline does not fit", transform=ax.get_xaxis_transform(),
                    fontsize=7, rotation=90, va="top")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["agents"] for r in rows], [str(r["agents"]) for r in rows])
    ax.set_title(f"N agents over one {rows[0]['ctx']}-token document, {rows[0]['layers']} layers", fontsize=9)
    ax.set_xlabel("agents")
    ax.set_ylabel("ms per decode step (wall, host work in)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _plot_kvcache(ax, rows: list[Row], config: dict) -> None:
    series = (("ms_polykv", f"polykv KVCache ({config['k']}/{config['v']})"), ("ms_baseline", "DynamicCache eager"),
              ("ms_static_compile", "StaticCache + torch.compile"))
    w = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        heights = [r.get(key) or float("nan") for r in rows]  # nan: no bar where a figure is missing
        ax.bar([j + i * w for j in range(len(rows))], heights, w, label=label)
    ax.set_xticks([j + w for j in range(len(rows))], [f"batch {r['agents']}" for r in rows])
    ax.set_title(f"KVCache decode, ctx {rows[0]['ctx']}, {rows[0]['layers']} layers", fontsize=9)
    ax.set_ylabel("ms per decode step (wall, host work in)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


TABLE_COLUMNS = ["scenario", "agents", "layers", "ctx", "ms_polykv", "ms_polykv_pipelined",
                 "ms_polykv_eager_modules_pipelined", "ms_baseline", "speedup", "speedup_pipelined",
                 "speedup_eager_modules_pipelined", "ms_static_compile", "speedup_vs_static_compile"]


def format_e2e(result: dict) -> str:
    """Plain-text table of the rows (and the errors, one line each)."""
    def cell(x):
        return "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))

    lines = [" ".join(f"{c[:14]:>14}" for c in TABLE_COLUMNS)]
    lines += [" ".join(f"{cell(r.get(c)):>14}" for c in TABLE_COLUMNS) for r in result["rows"]]
    lines += [f"skipped: {s}" for s in result.get("skipped", [])]
    lines += [f"error: {e['scenario']} {e.get('agents', '')} {e['error'][:200]}" for e in result["errors"]]
    return "\n".join(lines)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def main(argv: list[str] | None = None) -> dict:
    d = DEFAULTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default=",".join(map(str, d["agents"])))
    ap.add_argument("--ctx", type=int, default=d["ctx"])
    ap.add_argument("--layers", type=int, default=d["layers"])
    ap.add_argument("--suffix-tokens", type=int, default=d["suffix_tokens"])
    ap.add_argument("--kv-ctx", type=int, default=d["kv_ctx"])
    ap.add_argument("--kv-layers", type=int, default=d["kv_layers"])
    ap.add_argument("--kv-batches", default=",".join(map(str, d["kv_batches"])))
    ap.add_argument("--kv-recent", default="", help="recent windows R > 0 also timed in kvcache_decode rows")
    ap.add_argument("--pool-recent", default="", help="recent windows R > 0 also timed in pool_decode rows")
    ap.add_argument("--steps", type=int, default=d["steps"])
    ap.add_argument("--warmup", type=int, default=d["warmup"])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--k", default=d["k"])
    ap.add_argument("--v", default=d["v"])
    ap.add_argument("--chunk", type=int, default=d["chunk"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--json", action="store_true", help="print the JSON object instead of the table")
    a = ap.parse_args(argv)
    result = bench_e2e(agents=_ints(a.agents), ctx=a.ctx, layers=a.layers, kv_ctx=a.kv_ctx, kv_layers=a.kv_layers,
                       kv_batches=_ints(a.kv_batches), steps=a.steps, warmup=a.warmup,
                       scenarios=tuple(filter(None, a.scenarios.split(","))), k=a.k, v=a.v,
                       suffix_tokens=a.suffix_tokens, chunk=a.chunk, device=a.device, compile=a.compile,
                       tiny=a.tiny, out=a.out, kv_recents=_ints(a.kv_recent) if a.kv_recent else (),
                       pool_recents=_ints(a.pool_recent) if a.pool_recent else ())
    print(json.dumps(result, default=str) if a.json else format_e2e(result))
    return result


if __name__ == "__main__":
    main()
