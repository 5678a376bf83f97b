"""Named KV configurations (DESIGN §5): `preset=` on `KVCache` and `SharedKVPool`; `k=` / `v=` override.

| preset | K | V | InnerQ | bits/value (head_dim 64 / 128) | bytes vs f16 | recent R | calibrated table |
|---|---|---|---|---|---|---|---|
| default | q8_0 | turbo3 | — | 5.875 / 5.8125 | 2.7x | 8 | — |
| balanced | turbo4 | turbo3 | auto | 3.75 / 3.625 | 4.3x / 4.4x | 64 | ratio 3.5x at 2k, ring paid per model, <= 4.25 |
| max | turbo3 | turbo2 | auto | 2.75 / 2.625 | 5.8x / 6.1x | 8 | 3.125 bits/value |

(bits / bytes: the fixed K/V without their ring, DESIGN §3.) "auto" InnerQ: the table calibrated for the
model (`polykv calibrate`), when one exists. Bytes follow from DESIGN §3 and are checked against measured
tensors by the tests; the quality of `balanced` and `max` against issue K's gates is measured in
docs/quality.md, not promised here.

Calibrated precision: `balanced` and `max` carry a budget. When the model has a precision table
(`polykv calibrate --bits B`, `polykv.hf.precision`), `KVCache(model, preset=...)` takes per-layer K/V
types allocated from it instead of the fixed K/V above (explicit k= / v= keep the fixed types);
`KVCache.precision` says which ("source": "calibrated" / "fixed") and the budget used ("bits_target").

- `bits` alone (max): the table is allocated at that bits/value; the ring comes on top. Max 3.125
  (5.12x before its ring, gate 5.0x). Max as a ratio preset with R = 32 was measured and not kept
  (SmolLM2 real_frac 2/24 but code needles still 13/16; Gemma-3 ppl +3.09 % at 2.75 bits).
  `polykv calibrate --bits B` measures per (layer, KV head) with a copying signal at weight 0.25 by
  default, and a KVCache stores that allocation head by head: SmolLM2 max 5.08x, equivalence 3/24 (per
  layer, novel text only: 4/24), code needles -6.25 pp of f16 (-14.6) and = f16 on a held-out set
  (docs/quality.md, sessions 15-16); a SharedKVPool allocates the table collapsed to layers.
- `ratio` (balanced): the held bytes f16 / preset at GATE_CTX = 2,048 tokens, ring included, that the
  allocation must meet with RATIO_MARGIN (1 %): budget = 16 / (ratio x 1.01) minus the ring's bits/value
  for the model's shape (`polykv.hf.precision.ratio_budget`), at most `bits` (4.25; balanced at 4.375 /
  4.5 passed on neither model: docs/quality.md, "Balanced's bits budget above 4.25"). `precision` then
  also reports "ring" (rows, bits, ctx), "ratio_target" and "ratio_expected". A ring weighs per model:
  balanced's R = 64 costs 0.266 bits/value on SmolLM2 (budget 4.26, capped: 4.25) and 0.709 on
  Gemma-3, whose sliding layers hold 511 rows (budget 3.817, allocated 3.650). Measured held bytes at
  2,047 rows: 3.543x / 3.670x (docs/quality.md, "Balanced with a ring paid by its table (session 12)").
  The ring the budget pays for is the cache's own (`recent=` on KVCache / SharedKVPool, `--recent`
  on eval; the preset's R by default).

Recent window (`recent`, issue K): every layer also holds its last R rows at q8_0 and attention reads
those instead of the layer codec's copy (`polykv.cache.ring`; explicit k= / v= without a preset: none).
It costs R q8_0 rows per layer whatever the length, so its share of the bytes falls as 1/length; the
gates are at 2,048 tokens. R was chosen there from measured held bytes and the gates
(docs/quality.md, "Anchors: the recent window as storage", "Gates after session 11", session 12),
SmolLM2 / Gemma-3: default R = 8 (2.708x / 2.711x vs f16; R = 16 would fall under 2.7x), balanced
R = 64 (3.543x / 3.670x; ppl Δ +0.14 % on 4 windows / +0.88 % on 8; code needles = f16 on both, where
R = 32 lost one on SmolLM2), max R = 8 (5.08x / 5.008x; R = 16 is 4.87x on Gemma-3).
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
