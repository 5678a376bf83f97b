"""transformers Cache subclasses for document prefill (imported lazily: this module imports
transformers).

* `PrefillCache`    — prefills one document (batch 1) chunk by chunk into `CompressedLayer`s: each
  chunk attends to the compressed rows of everything before it plus its own dense rows, and is
  written compressed after. Sliding-window layers keep only the last `window - 1` rows.
* `F16DynamicCache` — a real float16 DynamicCache: the naive per-agent baseline of the memory figures.

`PrefillCache` implements the polykv attention protocol (`polykv.hf.attention`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..cache.layer import CompressedLayer
from ..hf.attention import activate
from .attention import prefill_attention


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
    """

    def __init__(self, layers: list[CompressedLayer], windows: list[int | None], shadow=None):
        super().__init__(layers=[])
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

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        li = module.layer_idx
        old_len, k_new, v_new = self._new.pop(li)
        hk, hv = _decode_true(self.cl[li], 0, old_len)
        return prefill_attention(query, hk, hv, k_new, v_new, scaling=scaling,
                                 hist_start=self.start_abs[li], pos0=self.pos0,
                                 window=self.windows[li])
