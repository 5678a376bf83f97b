"""CUDA-graph-captured decode steps (DESIGN §8): the whole model step recorded once, replayed.

    runner = DecodeGraph(model, cache, max_new_tokens=64)   # cache: a prefilled polykv.KVCache
    logits = runner.step(input_ids)                         # [B, 1] -> float32 [B, vocab]

A decode step is the same sequence of kernels every time; only the token, the write row and the
length change. `DecodeGraph` reserves the cache's storage once (capacity fixed for the graph's
lifetime), keeps those inputs in static device tensors (the cache reads its write positions and
lengths from them: `KVCache._static`), and captures model forward + the last-position logits in one
CUDA graph. Per step the host launches two small fills and one replay, and advances the cache's host
lengths. Elsewhere (CPU, sliding-window layers, forced reference) it runs the same step eagerly.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import warnings
from typing import Callable

import torch


def capture_graph(fn: Callable[[], None], mempool=None, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run `fn` `warmup` times on a side stream (Triton compiles, lazily built device tables), then
    capture one call of it into a CUDA graph (allocations from `mempool` when given)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Garbage first, and no collection while capturing: a finished batch's graphs wait in
    # reference cycles, and the cyclic collector destroying one mid-capture (CUDAGraph.reset) is an
    # illegal call that silently invalidates this capture (H200: a speculative bench's 32-agent
    # verify capture failed after its 8-agent batches, "operation not permitted when stream is
    # capturing (function reset)"). torch 2.11's graph context does not collect by itself.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        # thread_local: CUDA work of other threads (another batch of the same pool) during the
        # capture is not an error; only this thread's stream is captured
        with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"), torch.no_grad():
            fn()
    finally:
        if gc_was_enabled:
            gc.enable()
    return graph


POINTWISE_MODULES = ("RMSNorm", "MLP")
"""Submodule class-name suffixes `compiled_pointwise` compiles: a decode step's norms (fp32 upcast,
mean, rsqrt, scale: ~7 kernels each in eager mode) and MLP activation x up-projection products."""

ROTARY_FUNCTION = "apply_rotary_pos_emb"
"""The module-level function transformers' attention modules call by name to rotate queries and keys
(RoPE); `compiled_pointwise` compiles it too. Eager, each of q and k costs a multiply, a negate, a
concatenation, a multiply and an add: ~10 small kernels per layer, more than the layer's attention
kernels (a 30-layer SmolLM2 pool step on an H100: ~0.6 of its 2.8 ms on the device)."""

_COMPILED_LOCK = threading.RLock()
_COMPILED_HERE = threading.local()


class _ThreadGate:
    """A callable's stand-in inside `compiled_pointwise` (a module's `_compiled_call_impl`, a
    modeling module's rotary function): the compiled callable for the thread that opened the block,
    the eager one for every other thread (a batch of the same pool prefilling or stepping eagerly
    meanwhile must neither run nor trigger compiled code)."""

    def __init__(self, eager: Callable):
        self.eager, self.compiled = eager, torch.compile(eager)

    def __call__(self, *args, **kwargs):
        if getattr(_COMPILED_HERE, "on", False):
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def _rotary_homes(model) -> list:
    """The Python modules defining `model`'s layers that hold a `ROTARY_FUNCTION` (the modeling
    files whose attention forward looks it up at call time)."""
    homes = {sys.modules.get(type(m).__module__) for m in model.modules()}
    return [h for h in homes if h is not None and callable(getattr(h, ROTARY_FUNCTION, None))]


@contextlib.contextmanager
def compiled_pointwise(model):
    """Within the block, the model's norms, MLPs and rotary embedding function
    (`POINTWISE_MODULES`, `ROTARY_FUNCTION`) run torch.compile'd (inductor) in this thread, so a
    captured decode step runs fused kernels instead of chains of small elementwise ones; attention
    modules stay eager (they call the polykv caches). Other threads keep the eager code, and blocks
    of different threads run one at a time (dynamo is not thread-safe). Undone on exit. The first
    shape compiles static, a second one recompiles with its batch and token dims dynamic (automatic
    dynamic), so every batch bucket and verify width shares two compiles (seconds each); outputs
    equal eager up to float rounding. Yields the number of compiled modules and functions."""
    mods = [m for m in model.modules() if type(m).__name__.endswith(POINTWISE_MODULES)]
    with _COMPILED_LOCK:
        homes = _rotary_homes(model)
        outer = getattr(_COMPILED_HERE, "on", False)
        for m in mods:
            if not isinstance(m._compiled_call_impl, _ThreadGate):
                m._compiled_call_impl = _ThreadGate(m._call_impl)
        for home in homes:
            if not isinstance(getattr(home, ROTARY_FUNCTION), _ThreadGate):
                setattr(home, ROTARY_FUNCTION, _ThreadGate(getattr(home, ROTARY_FUNCTION)))
        _COMPILED_HERE.on = True
        try:
            yield len(mods) + len(homes)
        finally:
            _COMPILED_HERE.on = outer
            if not outer:
                for m in mods:
                    m._compiled_call_impl = None  # what nn.Module.__call__ checks: the eager forward
                for home in homes:
                    setattr(home, ROTARY_FUNCTION, getattr(home, ROTARY_FUNCTION).eager)


COMPILE = os.environ.get("POLYKV_COMPILE", "1") != "0"
"""Whether captured decode steps (`capture_step`) compile the model's norms, MLPs and rotary
(`compiled_pointwise`). POLYKV_COMPILE=0 turns it off (debugging, A/B timing); it is also turned
off for the process after a compile fails."""


def capture_step(fn: Callable[[], None], model, mempool=None, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """`capture_graph` of a model's decode step with its norms, MLPs and rotary compiled
    (`COMPILE`): the warm-up calls compile, the capture records the fused kernels, replays never
    enter Python. On an H200, one run: a pipelined 32-agent, 4-layer pool step 1.670 ms eager ->
    1.467 ms with norms and MLPs compiled (docs/BENCHMARKS.md §5.8); the rotary function compiled
    too, on an H100: 1.737 -> 1.656 ms (§5.19). Where torch.compile fails (no working inductor
    toolchain), the step is captured with the eager code and compiling stays off for the process."""
    global COMPILE
    if COMPILE:
        try:
            with compiled_pointwise(model):
                return capture_graph(fn, mempool, warmup)
        except Exception as e:  # noqa: BLE001 - any compile failure: capture without it
            if torch.cuda.is_current_stream_capturing():
                raise
            COMPILE = False
            warnings.warn(f"polykv: compiling the decode step's norms, MLPs and rotary failed "
                          f"({type(e).__name__}: {e}); captured steps run them eagerly", stacklevel=2)
    return capture_graph(fn, mempool, warmup)


def _capturable(cache) -> bool:
    from ..kernels import dispatch

    layers = cache.layers
    return (os.environ.get("POLYKV_CUDA_GRAPHS", "1") != "0"
            and all(lay.store.device.type == "cuda" for lay in layers)
            and dispatch.use_triton(layers[0].store.k.codes))


class DecodeGraph:
    """Single-token decode steps over a prefilled `polykv.KVCache` (see module doc).

    max_new_tokens: steps this runner may take (storage for them is reserved up front).
    attention_mask: the prompt's 2D mask [B, prompt_len] (1 = token) of a left-padded batch; the
    static step then reads each sequence from its first token on.
    Modes: "captured" (CUDA graph replay), "static" (the same static-input step run eagerly: CPU,
    or capture=False), "eager" (plain forward: models with sliding-window layers, caches with per-head types).
    """

    def __init__(self, model, cache, max_new_tokens: int, warmup: int = 2,
                 capture: bool | None = None, attention_mask: torch.Tensor | None = None):
        if any(lay.store is None for lay in cache.layers):
            raise ValueError("DecodeGraph needs a prefilled KVCache (run the prompt through it first)")
        self.model, self.cache = model, cache
        self.batch = cache.layers[0].store.batch
        self.limit = cache.layers[0].store.length + int(max_new_tokens)
        if any(lay.is_sliding or lay.mixed for lay in cache.layers):  # no static step for these
            self.mode = "eager"
            return
        capture = _capturable(cache) if capture is None else bool(capture)
        self.mode = "captured" if capture else "static"
        for lay in cache.layers:
            lay.apply_pending_trim()
            lay.store.reserve(self.limit, exact=True)
        dev = cache.layers[0].store.device
        B = self.batch
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.full((B, 1), cache.layers[0].store.length, dtype=torch.long, device=dev)
        mask = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=dev)  # 4D: transformers passes it as-is
        kv_start = None
        if attention_mask is not None:  # first real token of each left-padded sequence
            kv_start = attention_mask.to(dev).to(torch.int8).argmax(-1).to(torch.int32)
        self._out: dict[str, torch.Tensor] = {}

        def fwd():
            cache._static = (self.pos, (self.pos[:, 0] + 1).to(torch.int32), kv_start)
            try:
                # RoPE positions count real tokens only (as transformers' generate does)
                pos = self.pos if kv_start is None else self.pos - kv_start[:, None]
                res = model(input_ids=self.ids, position_ids=pos, attention_mask=mask,
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
            finally:
                cache._static = None
            self._out["logits"] = res.logits[:, -1].float()

        self._fwd = fwd
        # warm-up steps write row `length` of every layer: the first real step overwrites it
        self.graph = capture_step(fwd, model, warmup=warmup) if capture else None

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [B, 1] -> next-token logits float32 [B, vocab] on the model's device
        (captured: a view overwritten by the next step)."""
        cache = self.cache
        length = cache.layers[0].store.length
        if length >= self.limit:
            raise RuntimeError(f"DecodeGraph: max_new_tokens reached ({self.limit} rows reserved)")
        if self.mode == "eager":
            dev = cache.layers[0].store.device
            return self.model(input_ids=input_ids.to(dev), past_key_values=cache, use_cache=True,
                              logits_to_keep=1).logits[:, -1].float()
        self.ids.copy_(input_ids.view(self.batch, 1), non_blocking=True)
        self.pos.fill_(length)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._fwd()
        for lay in cache.layers:
            lay.store.length += 1
            lay.cumulative_length += 1
            lay._past_rows = lay.store.length - 1
        return self._out["logits"]
