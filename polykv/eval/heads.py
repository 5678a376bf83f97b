"""Per-head K/V types, simulated for measurement (issue K): what a cache holding each KV head of a layer
at its own type would score.

What it is: a KVCache whose storage is per layer, as always — each layer stored at its `base` types
(the most common K and V type among its heads) — plus, for every head whose type differs from its
layer's, that head's rows round-tripped through its own codec (`polykv.hf.precision._roundtrip`, true
space, InnerQ scales for turbo K) and kept on the side. When the materialize path (`KVCache.attend`,
CPU) decodes a layer's past rows, those heads' columns are overwritten by their side rows, mapped into
the domain the layer attends in (as `polykv.eval.anchors` does for anchor rows). The codecs encode each
head's rows on their own (a row of head_dim values, its own scale / norm), so a head's round trip alone
is exactly what a per-head store would hold. The ring (`recent=`), when there is one, is untouched:
its rows are q8_0 for every head, as in a real cache. `nbytes()` / `memory_report()` measure the base
storage; `HeadTypes.bits` is the bits/value a per-head store would hold (the table's real codec bits,
weighted by the values each head holds), and `ratio_expected(layout, R)` the f16 / held ratio with
the ring (16 / (bits + ring bits), the relation the held-bytes tests check for per-layer tables).

Where the types come from: a per-head precision table (`measure_sensitivity(..., per_head=True)`,
one row per (layer, head), layer-major) allocated at a budget: `HeadTypes.parse("TABLE@BITS")`.
Not a storage format: the side rows are float32, sliding layers with mixed heads and the fused
(CUDA) path are refused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..hf.kv_cache import KVCache
from .anchors import attend_decoding, materialize_only


@dataclass(frozen=True)
class HeadTypes:
    types: tuple[tuple[tuple[str, str], ...], ...]  # [layer][head] -> (k, v)
    bits: float  # bits/value of the per-head allocation (table weights, real codec bits)
    source: dict = field(default_factory=dict)  # table path, budget

    @classmethod
    def from_table(cls, table, bits: float, path: str | None = None) -> "HeadTypes":
        """Allocate a per-head PrecisionTable (meta "kv_heads") at `bits` and group its rows by layer."""
        heads = table.meta.get("kv_heads")
        if not heads:
            raise ValueError("not a per-head precision table (measure_sensitivity(..., per_head=True))")
        if sum(heads) != table.layers:
            raise ValueError(f"per-head table: {table.layers} rows, kv_heads sum to {sum(heads)}")
        pol = table.allocate(bits)
        out, u = [], 0
        for n in heads:
            out.append(tuple(pol.types[u:u + n]))
            u += n
        return cls(tuple(out), pol.bits_achieved, {"path": path or table.path, "bits_target": float(bits)})

    @classmethod
    def parse(cls, spec: str) -> "HeadTypes":
        """'TABLE.json@BITS'."""
        from ..hf.precision import PrecisionTable

        path, sep, bits = spec.rpartition("@")
        if not sep or not path:
            raise ValueError(f"head types {spec!r}: expected TABLE@BITS (a per-head precision table)")
        return cls.from_table(PrecisionTable.load(path), float(bits), path)

    def base(self) -> dict[int, tuple[str, str]]:
        """{layer: (k, v)}: each layer's most common K and V type among its heads (ties: the first)."""
        out = {}
        for i, hs in enumerate(self.types):
            out[i] = (Counter(k for k, _ in hs).most_common(1)[0][0], Counter(v for _, v in hs).most_common(1)[0][0])
        return out

    def differing(self) -> dict[int, tuple[dict[str, list[int]], dict[str, list[int]]]]:
        """{layer: ({k type: heads}, {v type: heads})} for heads whose type is not the layer's base."""
        base, out = self.base(), {}
        for i, hs in enumerate(self.types):
            kd: dict[str, list[int]] = {}
            vd: dict[str, list[int]] = {}
            for h, (k, v) in enumerate(hs):
                if k != base[i][0]:
                    kd.setdefault(k, []).append(h)
                if v != base[i][1]:
                    vd.setdefault(v, []).append(h)
            if kd or vd:
                out[i] = (kd, vd)
        return out

    def ratio_expected(self, layout, recent: int) -> float:
        from ..hf.precision import ring_bits
        from ..presets import GATE_CTX

        return 16.0 / (self.bits + ring_bits(layout, recent, GATE_CTX))

    def as_dict(self) -> dict:
        counts = Counter(f"{k}/{v}" for hs in self.types for k, v in hs)
        return {**self.source, "bits_achieved": round(self.bits, 4), "type_counts": dict(counts),
                "layers_mixed": sorted(self.differing()),
                "types": [[list(kv) for kv in hs] for hs in self.types]}


class HeadTypedKVCache(KVCache):
    """KVCache(model, ..., heads=HeadTypes(...)): module docstring. `overrides` is replaced by
    heads.base(); other arguments as KVCache."""

    def __init__(self, model, *args, heads: HeadTypes, **kwargs):
        from ..hf.kv_cache import _resolve_innerq
        from ..presets import resolve

        kwargs["overrides"] = heads.base()
        super().__init__(model, *args, **kwargs)
        # a turbo-K head in a layer stored otherwise still has the InnerQ scales a real store would use
        iq = resolve(kwargs.get("preset"), kwargs.get("k"), kwargs.get("v"), kwargs.get("innerq"))[2]
        self._innerq_heads = _resolve_innerq(iq, model, "turbo3")
        if len(heads.types) != len(self.layers):
            raise ValueError(f"head types for {len(heads.types)} layers, the model has {len(self.layers)}")
        self.heads = heads
        self._diff = heads.differing()
        for i in self._diff:
            lay = self.layers[i]
            if lay.is_sliding:
                raise NotImplementedError(f"layer {i} is sliding: mixed head types are simulated on "
                                          "full-attention layers only (rows = positions)")
            if len(heads.types[i]) != lay.layout.num_kv_heads:
                raise ValueError(f"layer {i}: {len(heads.types[i])} head types, {lay.layout.num_kv_heads} heads")
        self._side: dict[int, dict[tuple[str, str], torch.Tensor]] = {}

    def _scales(self, i: int):
        """InnerQ scales of layer i for a turbo-K head (the cache's table, whatever the base type)."""
        return self._innerq_heads.layer(i) if self._innerq_heads is not None else None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._static is not None:
            raise NotImplementedError("HeadTypedKVCache simulates on the materialize path only")
        d = self._diff.get(layer_idx)
        if d is not None:
            from ..hf.precision import _roundtrip

            k, v = key_states.detach().float(), value_states.detach().float()
            side = self._side.setdefault(layer_idx, {})
            for (name, types) in (("k", d[0]), ("v", d[1])):
                for t in types:
                    if name == "k":
                        rt, _ = _roundtrip(k, v, t, "f16", self._scales(layer_idx))
                    else:
                        _, rt = _roundtrip(k, v, "f16", t, None)
                    key = (name, t)
                    side[key] = rt if key not in side else torch.cat([side[key], rt], 2)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attend(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        materialize_only(self, query, "HeadTypedKVCache simulates per-head types")
        i = module.layer_idx
        d = self._diff.get(i)
        if d is None:
            return super().attend(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        layer = self.layers[i]
        store = layer.store
        decode = store.decode_rows
        side = self._side[i]

        def mixed(start, stop, dtype=torch.float32, rotated=(False, False)):
            k, v = decode(start, stop, dtype, rotated)
            k, v = k.clone(), v.clone()
            start, stop = max(0, int(start)), max(0, int(start)) + k.shape[2]
            k_rot = rotated[0] and store.k_codec.rotated
            v_rot = rotated[1] and store.v_codec.rotated
            for t, hs in d[0].items():
                xk = side[("k", t)][:, :, start:stop]
                xk, _ = layer.attention_domain(xk, xk, k_rot, False)
                k[:, hs] = xk[:, hs].to(k.dtype)
            for t, hs in d[1].items():
                xv = side[("v", t)][:, :, start:stop]
                _, xv = layer.attention_domain(xv, xv, False, v_rot)
                v[:, hs] = xv[:, hs].to(v.dtype)
            return k, v

        return attend_decoding(self, store, mixed, module, query, key, value, attention_mask,
                               scaling=scaling, **kwargs)


__all__ = ["HeadTypedKVCache", "HeadTypes"]
