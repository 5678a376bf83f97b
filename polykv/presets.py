"""Named KV configurations (DESIGN §5): `preset=` on `KVCache` and `SharedKVPool`; `k=` / `v=` override.

| preset | K | V | InnerQ | bits/value (head_dim 64 / 128) | bytes vs f16 |
|---|---|---|---|---|---|
| default | q8_0 | turbo3 | — | 5.875 / 5.8125 | 2.7x |
| balanced | turbo4 | turbo3 | auto | 3.75 / 3.625 | 4.3x / 4.4x |
| max | turbo3 | turbo2 | auto | 2.75 / 2.625 | 5.8x / 6.1x |

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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    k: str
    v: str
    innerq: str | None  # None or "auto"
    bits: float | None = None  # budget for a calibrated precision table (None: fixed types only)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("default", "q8_0", "turbo3", None),
    Preset("balanced", "turbo4", "turbo3", "auto", bits=4.25),
    Preset("max", "turbo3", "turbo2", "auto", bits=3.125),
)}


def resolve(preset: str | None, k: str | None, v: str | None, innerq=None) -> tuple[str, str, object]:
    """(k, v, innerq) from a preset name (None: "default") with explicit k / v / innerq winning."""
    name = "default" if preset is None else str(preset)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[name]
    return (k or p.k, v or p.v, innerq if innerq is not None else p.innerq)


__all__ = ["PRESETS", "Preset", "resolve"]
