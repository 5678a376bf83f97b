"""Named KV configurations (DESIGN §5): `preset=` on `KVCache` and `SharedKVPool`; `k=` / `v=` override.

| preset | K | V | InnerQ | bits/value (head_dim 64 / 128) | bytes vs f16 | recent R |
|---|---|---|---|---|---|---|
| default | q8_0 | turbo3 | — | 5.875 / 5.8125 | 2.7x | 8 |
| balanced | turbo4 | turbo3 | auto | 3.75 / 3.625 | 4.3x / 4.4x | 32 |
| max | turbo3 | turbo2 | auto | 2.75 / 2.625 | 5.8x / 6.1x | 8 |

"auto" InnerQ: the table calibrated for the model (`polykv calibrate`), when one exists. Bytes follow
from DESIGN §3 and are checked against measured tensors by the tests; the quality of `balanced` and
`max` against issue K's gates is measured by `polykv eval tiers` (docs/quality.md), not promised here.

Calibrated precision: `balanced` and `max` carry a bits/value budget (`bits`). When the model has a
precision table (`polykv calibrate --bits B`, `polykv.hf.precision`), `KVCache(model, preset=...)`
takes per-layer K/V types allocated from it at that budget instead of the fixed K/V above (explicit
k= / v= keep the fixed types); `KVCache.precision["source"]` says which ("calibrated" / "fixed").
Budgets: balanced 4.25 bits/value (16 / 4.25 = 3.76x fewer bytes than f16, gate 3.5x), max 3.125
(5.12x, gate 5.0x): a little under each gate's 4.57 / 3.2 so that fp16 scales of odd head_dims
and rounding never cross it. Balanced at 4.375 / 4.5 passed on neither model (Gemma-3 ppl +1.15 %
at both; SmolLM2 +1.01 % at 4.375, +0.43 % but real_frac 2/24 at 4.5): docs/quality.md, "Balanced's
bits budget above 4.25".

Recent window (`recent`, issue K): every layer also holds its last R rows at q8_0 and attention reads
those instead of the layer codec's copy (`polykv.cache.ring`; explicit k= / v= without a preset: none).
It costs R q8_0 rows per layer whatever the length, so its share of the bytes falls as 1/length; the
gates are at 2,048 tokens. R was chosen there from measured held bytes and perplexity
(docs/quality.md, "Anchors: the recent window as storage"), SmolLM2 / Gemma-3 (Gemma's sliding layers
hold 511 rows, so the ring weighs ~4x more there): default R = 8 (2.708x / 2.711x vs f16; R = 16 would
fall under 2.7x), balanced R = 32 (3.65x / 3.505x; ppl Δ +0.16 % on 4 windows / +0.67 % on 8), max
R = 8 (5.08x / 5.008x; R = 16 is 4.87x on Gemma-3).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    k: str
    v: str
    innerq: str | None  # None or "auto"
    bits: float | None = None  # budget for a calibrated precision table (None: fixed types only);
    #                            with `ratio`, the most it may spend
    recent: int = 0  # R: the last R rows of every layer also held at q8_0 (polykv.cache.ring)
    ratio: float | None = None  # held bytes f16 / this preset at GATE_CTX tokens that a calibrated
    #                             table must meet, ring included (polykv.hf.precision.ratio_budget)


GATE_CTX = 2048      # tokens at which issue K's byte gates are measured (2,047 rows stored)
RATIO_MARGIN = 0.01  # a `ratio` preset aims at ratio x (1 + margin) (docstring, "Ratio")


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("default", "q8_0", "turbo3", None, recent=8),
    Preset("balanced", "turbo4", "turbo3", "auto", bits=4.25, recent=64, ratio=3.5),
    Preset("max", "turbo3", "turbo2", "auto", bits=3.125, recent=8),
)}


def recent_for(preset: str | None, k: str | None = None, v: str | None = None,
               recent: int | None = None) -> int:
    """The recent window R of a cache: an explicit `recent` wins; else the preset's when a preset is
    named or nothing is (None: "default"); explicit k / v without a preset mean exactly those
    types, no window."""
    if recent is not None:
        if int(recent) < 0:
            raise ValueError(f"recent must be >= 0, got {recent}")
        return int(recent)
    if preset is None and (k is not None or v is not None):
        return 0
    name = "default" if preset is None else str(preset)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].recent


def resolve(preset: str | None, k: str | None, v: str | None, innerq=None) -> tuple[str, str, object]:
    """(k, v, innerq) from a preset name (None: "default") with explicit k / v / innerq winning."""
    name = "default" if preset is None else str(preset)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[name]
    return (k or p.k, v or p.v, innerq if innerq is not None else p.innerq)


__all__ = ["GATE_CTX", "PRESETS", "Preset", "RATIO_MARGIN", "recent_for", "resolve"]
