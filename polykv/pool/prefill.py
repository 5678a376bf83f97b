"""transformers Cache subclasses for document prefill (imported lazily: this module imports
transformers).

* `PrefillCache`    — prefills one document (batch 1) chunk by chunk into `CompressedLayer`s: each
  chunk attends to the compressed rows of everything before it plus its own dense rows, and is
  written compressed after. Sliding-window layers keep only the last `window - 1` rows.
* `F16DynamicCache` — a real float16 DynamicCache: the naive per-agent baseline of the memory figures.

`PrefillCache` implements the polykv attention protocol (`polykv.hf.attention`).

Two attention paths, same semantics (DESIGN §4 materialize / prefill-hybrid):
* "masked" — the CPU path and the reference: the history is decoded with the codecs' torch ops in
  float32 (`_decode_true`), then one SDPA call with a boolean [C, L] mask (`prefill_attention`).
* "split"  — the CUDA path: the history is decoded by `kernels.dispatch.dequantize` (the Triton
  kernel on CUDA) straight into the compute dtype, then history (non-causal) and chunk (causal)
  attention by flash kernels that return the LSE, merged by LSE (`prefill_attention_split`; the
  FLOP / byte budget of a 32k prefill is written beside it in pool/attention.py).
"auto" (default) takes "split" for CUDA queries flash can run (fp16/bf16, head_dim % 8 == 0, <= 256)
and "masked" everywhere else, so CPU outputs are the reference path's, bit for bit. Force a path with
`PrefillCache(..., path=...)`, `with prefill_path("split"): pool.add_document(...)` or the environment
variable POLYKV_PREFILL_PATH=auto|split|masked (on CPU "split" runs aten's CPU flash kernel: tests).
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..cache.layer import CompressedLayer
from ..hf.attention import activate
from .attention import flash_supported, prefill_attention, prefill_attention_split

PATHS = ("auto", "split", "masked")
_PATH: str | None = None  # set by `prefill_path`; None: POLYKV_PREFILL_PATH, default "auto"


@contextlib.contextmanager
def prefill_path(path: str):
    """Force the prefill attention path ("auto" | "split" | "masked") for PrefillCaches built with
    path=None (the pool's) inside the block; restores the previous setting on exit."""
    global _PATH
    if path not in PATHS:
        raise ValueError(f"prefill path {path!r}: expected one of {PATHS}")
    old, _PATH = _PATH, path
    try:
        yield
    finally:
        _PATH = old


def _default_path() -> str:
    path = _PATH or os.environ.get("POLYKV_PREFILL_PATH", "auto") or "auto"
    if path not in PATHS:
        raise ValueError(f"POLYKV_PREFILL_PATH={path!r}: expected one of {PATHS}")
    return path


def _decode_true(layer: CompressedLayer, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """True-space (unscaled) float32 K/V rows [start, stop) of a CompressedLayer."""
    if stop <= start:
        z = torch.zeros(layer.batch, layer.kv_heads, 0, layer.head_dim, device=layer.device)
        return z, z
    sl = (slice(None), slice(None), slice(start, stop))
    k = layer.k_codec.decode(layer.k.index(sl)).float()
    if layer.key_scales is not None:
        k = k / layer.key_scales[None, :, None, :]
    return k, layer.v_codec.decode(layer.v.index(sl)).float()


def _decode_hist(layer: CompressedLayer, stop: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """True-space K/V rows [0, stop) of a CompressedLayer in `dtype`, decoded by
    `dispatch.dequantize` (the Triton dequant kernel on CUDA, the codec reference elsewhere). Keys
    are divided by the InnerQ scales in float32 before the cast, as `_decode_true` does (on CPU in
    float32 the two functions agree bit for bit)."""
    from ..kernels import dispatch

    if stop <= 0:
        z = torch.zeros(layer.batch, layer.kv_heads, 0, layer.head_dim, dtype=dtype, device=layer.device)
        return z, z
    def dequant(p, codec, dt):
        if codec.head_dim & (codec.head_dim - 1):  # the Triton tiles need a power-of-two head_dim
            return codec.decode(p).to(dt)
        return dispatch.dequantize(p, codec, dt)

    sl = (slice(None), slice(None), slice(0, stop))
    if layer.key_scales is None:
        k = dequant(layer.k.index(sl), layer.k_codec, dtype)
    else:
        k = dequant(layer.k.index(sl), layer.k_codec, torch.float32)
        k = (k / layer.key_scales[None, :, None, :]).to(dtype)
    return k, dequant(layer.v.index(sl), layer.v_codec, dtype)


class F16DynamicCache(DynamicCache):
    """A transformers DynamicCache whose tensors are stored as float16 while the model computes in its
    own dtype: the naive per-agent baseline of the memory figures (real tensors, measured)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        dtype = key_states.dtype
        k, v = super().update(key_states.to(torch.float16), value_states.to(torch.float16), layer_idx,
                              *args, **kwargs)
        return k.to(dtype), v.to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for lay in self.layers:
            for name in ("keys", "values"):
                t = getattr(lay, name, None)
                if isinstance(t, torch.Tensor):
                    out.append(t)
        return out


class PrefillCache(Cache):
    """Compressing cache for one document (batch 1). Call `begin_chunk(pos0)` before each chunk's
    forward and `end_chunk(pos_end)` after it. `shadow` (optional): a transformers DynamicCache that
    receives the same rows as float16 — a real f16 copy whose bytes are measured for the naive figure.
    path: "auto" | "split" | "masked" (module doc); None: `prefill_path` / POLYKV_PREFILL_PATH.
    """

    def __init__(self, layers: list[CompressedLayer], windows: list[int | None], shadow=None,
                 path: str | None = None):
        super().__init__(layers=[])
        if path is not None and path not in PATHS:
            raise ValueError(f"prefill path {path!r}: expected one of {PATHS}")
        self.path = path
        self.cl = layers
        self.windows = windows
        self.start_abs = [0] * len(layers)  # absolute position of each layer's row 0
        self.shadow = shadow
        self.pos0 = 0
        self._new: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def begin_chunk(self, pos0: int) -> None:
        self.pos0 = pos0

    def end_chunk(self, pos_end: int) -> None:
        for i, (layer, w) in enumerate(zip(self.cl, self.windows)):
            if w is not None:
                layer.trim(max(1, w - 1))
            self.start_abs[i] = pos_end - layer.length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.pos0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        activate(self)
        layer = self.cl[layer_idx]
        self._new[layer_idx] = (layer.length, key_states, value_states)
        layer.append(key_states, value_states)
        if self.shadow is not None:
            self.shadow.update(key_states.to(torch.float16), value_states.to(torch.float16), layer_idx)
        return key_states, value_states

    def use_split(self, query: torch.Tensor) -> bool:
        """Whether this chunk's attention takes the split path (module doc)."""
        path = self.path or _default_path()
        if path == "auto":
            return query.is_cuda and flash_supported(query)
        if path == "split" and not flash_supported(query):
            raise ValueError(f"prefill path 'split' cannot run {query.dtype} head_dim "
                             f"{query.shape[-1]} on {query.device.type} (flash kernel limits)")
        return path == "split"

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        li = module.layer_idx
        old_len, k_new, v_new = self._new.pop(li)
        kw = dict(scaling=scaling, hist_start=self.start_abs[li], pos0=self.pos0,
                  window=self.windows[li])
        if self.use_split(query):
            hk, hv = _decode_hist(self.cl[li], old_len, query.dtype)
            return prefill_attention_split(query, hk, hv, k_new, v_new, **kw)
        hk, hv = _decode_true(self.cl[li], 0, old_len)
        return prefill_attention(query, hk, hv, k_new, v_new, **kw)
