"""Quality harness: perplexity, logit equivalence, RULER-style niah/vt, tier overview (DESIGN §6, §7).

Every function returns a plain dict carrying the JSON fields of DESIGN §6.
"""

from __future__ import annotations

from polykv._lazy import lazy_getattr

_LAZY = {
    "eval_ppl": ("polykv.eval.ppl", "eval_ppl"),
    "eval_equiv": ("polykv.eval.equiv", "eval_equiv"),
    "eval_ruler": ("polykv.eval.ruler", "eval_ruler"),
    "eval_tiers": ("polykv.eval.tiers", "eval_tiers"),
    "to_markdown": ("polykv.eval.tiers", "to_markdown"),
    "FORMAT_HELP": ("polykv.eval.equiv", "FORMAT_HELP"),
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr("polykv.eval", _LAZY, globals())
