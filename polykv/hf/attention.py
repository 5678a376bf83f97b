"""The "polykv" attention implementation registered with transformers.

transformers calls `past_key_values.update(k, v, layer_idx)` and then the attention function of
`config._attn_implementation` for the same layer. A polykv cache marks itself active in `update`
(`activate`), and `polykv_attention` hands the query to that cache's `attend`, which reads the
compressed K/V directly (materialize, fused or cascade — the cache decides). Without an active
polykv cache the call falls back to SDPA on the given dense K/V.

Protocol for a polykv cache (KVCache, the pool's agent cache):
    cache.attend(module, query [B, Hq, q_len, D], key, value, attention_mask, scaling, **kwargs)
        -> attn_output [B, q_len, Hq, D]
`key`/`value` are whatever the cache's `update` returned (caches may return the new rows only).
"""

from __future__ import annotations

import contextvars

import torch

ATTN_NAME = "polykv"

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("polykv_active_cache", default=None)


def activate(cache) -> None:
    """Mark `cache` as the one the next attention call on this thread/context reads (the mark is
    consumed by that call; caches call this in every `update`)."""
    _ACTIVE.set(cache)


def active_cache():
    return _ACTIVE.get()


def polykv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs):
    cache = _ACTIVE.get()
    if cache is not None:
        # Consume the mark: it covers exactly the attention call that follows the cache's
        # `update`. A later forward with another cache (e.g. a DynamicCache for capture) must not
        # be routed to a stale polykv cache.
        _ACTIVE.set(None)
    if cache is None or not hasattr(cache, "attend"):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = cache.attend(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return out, None


_REGISTERED = False


def register() -> str:
    """Register the "polykv" attention (and its mask, the SDPA boolean mask) with transformers."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(ATTN_NAME, polykv_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
        _REGISTERED = True
    return ATTN_NAME


def use_polykv_attention(model) -> None:
    """Switch a loaded transformers model to the polykv attention implementation."""
    register()
    model.set_attn_implementation(ATTN_NAME)
