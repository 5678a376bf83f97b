"""Per-head K/V types for evaluation (issue K): `--head-types TABLE@BITS` on `eval ppl | equiv | ruler`.

A per-head precision table (`measure_sensitivity(..., per_head=True)`, `polykv calibrate --per-head`;
one row per (layer, KV head), layer-major) allocated at a budget, `HeadTypes.parse("TABLE@BITS")`,
and stored for real: the cache under test is a KVCache with `overrides=HeadTypes.overrides()`, whose
mixed layers hold each head at its type (`polykv.cache.HeadGroupedLayer`), the ring (`recent=`) as
usual. Until 2026-12-05 this was a simulation (the layer stored at its heads' most common types, the
other heads' round trips kept on the side as float32); the figures of docs/quality.md "Per-head
types, simulated" came from it. `HeadTypes.bits` is the allocation's bits/value (the table's real
codec bits, weighted by the values each head holds); `ratio_expected(layout, R)` the f16 / held
ratio with the ring at 2,048 tokens (16 / (bits + ring bits)); the run's measured bytes say the same.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HeadTypes:
    types: tuple[tuple[tuple[str, str], ...], ...]  # [layer][head] -> (k, v)
    bits: float  # bits/value of the per-head allocation (table weights, real codec bits)
    source: dict = field(default_factory=dict)  # table path, budget

    @classmethod
    def from_table(cls, table, bits: float, path: str | None = None) -> "HeadTypes":
        """Allocate a per-head PrecisionTable (meta "kv_heads") at `bits` and group its rows by layer."""
        heads = table.kv_heads
        if not heads:
            raise ValueError("not a per-head precision table (measure_sensitivity(..., per_head=True))")
        if sum(heads) != table.layers:
            raise ValueError(f"per-head table: {table.layers} rows, kv_heads sum to {sum(heads)}")
        from ..hf.precision import head_rows

        pol = table.allocate(bits)
        out = [tuple(pol.types[r] for r in rows) for rows in head_rows(heads)]
        return cls(tuple(out), pol.bits_achieved, {"path": path or table.path, "bits_target": float(bits)})

    @classmethod
    def parse(cls, spec: str) -> "HeadTypes":
        """'TABLE.json@BITS'."""
        from ..hf.precision import PrecisionTable

        path, sep, bits = spec.rpartition("@")
        if not sep or not path:
            raise ValueError(f"head types {spec!r}: expected TABLE@BITS (a per-head precision table)")
        return cls.from_table(PrecisionTable.load(path), float(bits), path)

    def overrides(self) -> dict[int, list[tuple[str, str]]]:
        """{layer: [(k, v) per KV head]} for `KVCache(..., overrides=...)`."""
        return {i: list(hs) for i, hs in enumerate(self.types)}

    def ratio_expected(self, layout, recent: int) -> float:
        from ..hf.precision import ring_bits
        from ..presets import GATE_CTX

        return 16.0 / (self.bits + ring_bits(layout, recent, GATE_CTX))

    def as_dict(self) -> dict:
        counts = Counter(f"{k}/{v}" for hs in self.types for k, v in hs)
        return {**self.source, "bits_achieved": round(self.bits, 4), "type_counts": dict(counts),
                "layers_mixed": [i for i, hs in enumerate(self.types) if len(set(hs)) > 1],
                "types": [[list(kv) for kv in hs] for hs in self.types]}


__all__ = ["HeadTypes"]
