"""Anchors, simulated for measurement (issue K): per layer, the first `sink` tokens and the `recent`
rows just before the current chunk read at a higher precision than the layer's codec.

What it is: a KVCache whose storage is unchanged — every row is stored in its layer's codec, as always,
and `nbytes()` / `memory_report()` measure that storage — plus every layer's exact K/V rows kept on the
side. When the materialize path (`KVCache.attend`, CPU) decodes a layer's past rows, the anchor rows
are overwritten by their exact values (`anchor="exact"`) or by their round trip through the codec
`anchor` (e.g. "q8_0", true space), mapped into the domain that path attends in (InnerQ-scaled and
rotated for turbo K, rotated for turbo V). So it answers "what would a cache that holds these rows at
`anchor` precision score" with the harness otherwise unchanged; `anchored_bits` gives the bits/value
such a cache would store. It is not a storage format: the side rows are float32 and unbounded, and the
fused (CUDA) path, which never decodes rows, is refused. docs/quality.md ("Anchors") has the figures;
the recent window now exists as storage (`KVCache(..., recent=R)`, `polykv.cache.ring`), and with
anchor="q8_0" and no sinks its materialize path gives this simulation's floats (tests/hf/test_recent.py).

Positions: row r of a layer's stored past is absolute position cumulative_length - new - past + r
(sliding layers keep their last rows; positions of trimmed rows are never anchors there). A row is an
anchor when its position < sink or it is one of the `recent` rows before the current chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import check_codec_name, get_codec
from ..hf.kv_cache import KVCache, _fused_available


@dataclass(frozen=True)
class Anchors:
    sink: int = 0  # first tokens of every layer
    recent: int = 0  # rows just before the current chunk
    anchor: str = "q8_0"  # "exact" or a codec name (polykv.codecs.CODEC_NAMES)

    def __post_init__(self):
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink and recent must be >= 0, got {self.sink}, {self.recent}")
        if self.anchor != "exact":
            check_codec_name(self.anchor)

    @classmethod
    def parse(cls, spec: str) -> "Anchors":
        """'recent=32,sink=4,anchor=q8_0' (any subset; unknown keys are an error)."""
        fields = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, val = part.partition("=")
            key = key.strip()
            if not sep or key not in ("sink", "recent", "anchor"):
                raise ValueError(f"anchors spec {spec!r}: expected sink=N, recent=N, anchor=TYPE, got {part!r}")
            fields[key] = val.strip() if key == "anchor" else int(val)
        return cls(**fields)

    def as_dict(self) -> dict:
        return {"sink": self.sink, "recent": self.recent, "anchor": self.anchor}


def anchor_rows(start: int, rows: int, sink: int, recent: int) -> torch.Tensor:
    """Indices into `rows` stored rows whose first is absolute position `start`: position < sink,
    or among the last `recent`."""
    pos = torch.arange(start, start + rows)
    keep = pos < sink
    if recent:
        keep |= pos >= start + rows - recent
    return torch.nonzero(keep).flatten()


class AnchoredKVCache(KVCache):
    """KVCache(model, ..., anchors=Anchors(...)): module docstring. Other arguments as KVCache."""

    def __init__(self, model, *args, anchors: Anchors, **kwargs):
        kwargs.setdefault("recent", 0)
        if kwargs["recent"]:
            raise ValueError("AnchoredKVCache simulates anchors on a cache without a recent ring "
                             f"(got recent={kwargs['recent']}); the ring is what it simulates")
        super().__init__(model, *args, **kwargs)
        self.anchors = anchors
        self._exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = key_states.detach().float(), value_states.detach().float()
        ex = self._exact.get(layer_idx)
        self._exact[layer_idx] = (k, v) if ex is None else (torch.cat([ex[0], k], 2), torch.cat([ex[1], v], 2))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        materialize_only(self, query, "AnchoredKVCache simulates anchors")
        layer = self.layers[module.layer_idx]
        store = layer.store
        new = key.shape[2]
        decode = store.decode_rows
        exact = self._exact[module.layer_idx]
        a = self.anchors

        def anchored(start, stop, dtype=torch.float32, rotated=(False, False)):
            k, v = decode(start, stop, dtype, rotated)
            past = k.shape[2]
            first = layer.cumulative_length - new - past  # absolute position of row 0
            idx = anchor_rows(first, past, a.sink, a.recent)
            if idx.numel() == 0:
                return k, v
            xk, xv = exact[0][:, :, idx + first], exact[1][:, :, idx + first]
            if a.anchor != "exact":
                c = get_codec(a.anchor, xk.shape[-1])
                xk, xv = c.decode(c.encode(xk.contiguous())), c.decode(c.encode(xv.contiguous()))
            xk, xv = layer.attention_domain(xk, xv, rotated[0] and store.k_codec.rotated,
                                            rotated[1] and store.v_codec.rotated)
            k, v = k.clone(), v.clone()
            k[:, :, idx] = xk.to(k.dtype)
            v[:, :, idx] = xv.to(v.dtype)
            return k, v

        return attend_decoding(self, store, anchored, module, query, key, value, attention_mask,
                               scaling=scaling, **kwargs)


def materialize_only(cache: KVCache, query: torch.Tensor, what: str) -> None:
    """Refuse the fused path for a simulation (`what`): it changes rows the materialize path
    (`KVCache.attend` on CPU) decodes, and the fused path never decodes rows."""
    if cache._static is not None or _fused_available(query):
        raise NotImplementedError(f"{what} on the materialize path only (CPU); the fused path never "
                                  "decodes rows")


def attend_decoding(cache: KVCache, store, decode_rows, module, query, key, value, attention_mask,
                    scaling=None, **kwargs):
    """`KVCache.attend` of `cache` with the layer store's `decode_rows` replaced by `decode_rows` for
    this call only (an instance attribute over the method, removed after): how the evaluation
    caches change what attention reads without touching the stored rows."""
    store.decode_rows = decode_rows
    try:
        return KVCache.attend(cache, module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    finally:
        del store.decode_rows


def anchored_bits(cache: AnchoredKVCache) -> dict:
    """Bits/value of the rows the cache holds now: as stored, and as a cache holding its anchor rows
    at the anchor precision (16 for "exact") would store them. Codec bits from real encodes."""
    a = cache.anchors
    stored = anchored = values = 0.0
    for layer in cache.layers:
        st = layer.store
        if st is None or st.length == 0:
            continue
        n = int(anchor_rows(layer.cumulative_length - st.length, st.length, a.sink, a.recent).numel())
        per_row = st.batch * st.kv_heads * st.head_dim
        bk, bv = layer.k_codec.bits_per_value(), layer.v_codec.bits_per_value()
        ab = 16.0 if a.anchor == "exact" else get_codec(a.anchor, st.head_dim).bits_per_value()
        stored += st.length * per_row * (bk + bv)
        anchored += st.length * per_row * (bk + bv) + n * per_row * (2 * ab - bk - bv)
        values += 2 * st.length * per_row
    return {"bits_per_value_stored": stored / values if values else None,
            "bits_per_value_anchored": anchored / values if values else None}


__all__ = ["AnchoredKVCache", "Anchors", "anchor_rows", "anchored_bits", "attend_decoding"]
