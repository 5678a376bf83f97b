"""polykv: shared, asymmetrically compressed KV caches — one compressed prefix, many agents.

    import polykv
    model, tok = polykv.load_model()                     # embedded SmolLM2-135M
    cache = polykv.KVCache(model, k="q8_0", v="turbo3")   # a transformers Cache
    pool = polykv.SharedKVPool(model, tok, k="q8_0", v="turbo3")

Heavy submodules (transformers, triton) load on first use.
"""

from __future__ import annotations

from ._lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "load_model": ("polykv.hf.loading", "load_model"),
    "KVCache": ("polykv.hf.kv_cache", "KVCache"),
    "SharedKVPool": ("polykv.pool", "SharedKVPool"),
    "InnerQTable": ("polykv.codecs", "InnerQTable"),
    "get_codec": ("polykv.codecs", "get_codec"),
    "CODEC_NAMES": ("polykv.codecs", "CODEC_NAMES"),
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__ = lazy_getattr("polykv", _LAZY, globals())
