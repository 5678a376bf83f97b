"""transformers integration: KVCache (a transformers Cache), the "polykv" attention function,
K/V capture and InnerQ calibration, model loading. Heavy pieces load on first use."""

from __future__ import annotations

from polykv._lazy import lazy_getattr

from .attention import ATTN_NAME, activate, active_cache, polykv_attention, register, use_polykv_attention

_LAZY = {
    "KVCache": ("polykv.hf.kv_cache", "KVCache"),
    "DecodeGraph": ("polykv.hf.graphs", "DecodeGraph"),
    "model_layout": ("polykv.hf.kv_cache", "model_layout"),
    "innerq_path": ("polykv.hf.fingerprint", "innerq_path"),
    "model_fingerprint": ("polykv.hf.fingerprint", "model_fingerprint"),
    "capture_kv": ("polykv.hf.capture", "capture_kv"),
    "calibrate_innerq": ("polykv.hf.capture", "calibrate_innerq"),
    "load_model": ("polykv.hf.loading", "load_model"),
    "kv_layout": ("polykv.hf.layout", "kv_layout"),
}

__all__ = ["ATTN_NAME", "activate", "active_cache", "polykv_attention", "register",
           "use_polykv_attention"] + sorted(_LAZY)


__getattr__ = lazy_getattr("polykv.hf", _LAZY, globals())
