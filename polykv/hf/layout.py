"""KV layout of a transformers model: per decoder layer, KV heads, head_dim and sliding window."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerSpec", "UnsupportedModelError", "kv_layout"]


class UnsupportedModelError(ValueError):
    """The model's config does not describe a KV layout polykv can handle."""


@dataclass(frozen=True)
class LayerSpec:
    """KV geometry of one decoder layer (cache tensors are ``[batch, num_kv_heads, seq, head_dim]``)."""

    index: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # None: full attention


def kv_layout(model) -> list[LayerSpec]:
    """Per decoder layer: KV heads, head_dim, sliding window (None = full attention).

    Accepts a model or a config. Follows transformers' conventions: ``num_key_value_heads``
    (absent: multi-head attention, = ``num_attention_heads``), ``head_dim`` (absent or None:
    ``hidden_size // num_attention_heads``), ``layer_types`` (``sliding_attention`` layers use
    ``sliding_window``); without ``layer_types`` a set ``sliding_window`` applies to every layer
    (Mistral) unless ``use_sliding_window`` is False (Qwen2).
    """
    config = getattr(model, "config", model)
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtype = getattr(cfg, "model_type", type(cfg).__name__)

    def attr(name):
        try:
            return getattr(cfg, name, None)
        except Exception:  # some configs raise on unset attribute_map entries
            return None

    n_layers = attr("num_hidden_layers")
    n_heads = attr("num_attention_heads")
    n_kv = attr("num_key_value_heads")
    head_dim = attr("head_dim")
    hidden = attr("hidden_size")

    if not isinstance(n_layers, int) or n_layers <= 0:
        raise UnsupportedModelError(f"config ({mtype}) has no usable num_hidden_layers; cannot derive a KV layout")
    if n_kv is None:
        n_kv = n_heads
    if head_dim is None and isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0:
        if hidden % n_heads == 0:
            head_dim = hidden // n_heads
    if not isinstance(n_kv, int) or n_kv <= 0 or not isinstance(head_dim, int) or head_dim <= 0:
        raise UnsupportedModelError(
            f"config ({mtype}) lacks KV geometry: need num_key_value_heads (or num_attention_heads) and "
            f"head_dim (or hidden_size divisible by num_attention_heads); got num_key_value_heads={n_kv!r}, "
            f"num_attention_heads={n_heads!r}, head_dim={head_dim!r}, hidden_size={hidden!r}"
        )

    window = attr("sliding_window")
    layer_types = attr("layer_types")
    specs: list[LayerSpec] = []
    if layer_types is not None:
        if len(layer_types) != n_layers:
            raise UnsupportedModelError(
                f"config ({mtype}) has {len(layer_types)} layer_types for {n_layers} layers"
            )
        for i, lt in enumerate(layer_types):
            if lt == "full_attention":
                sw = None
            elif lt == "sliding_attention":
                if not isinstance(window, int) or window <= 0:
                    raise UnsupportedModelError(
                        f"config ({mtype}) layer {i} is sliding_attention but sliding_window={window!r}"
                    )
                sw = window
            else:
                raise UnsupportedModelError(
                    f"config ({mtype}) layer {i} has attention type {lt!r}; polykv supports "
                    f"'full_attention' and 'sliding_attention' only"
                )
            specs.append(LayerSpec(i, n_kv, head_dim, sw))
        return specs

    if attr("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        window = None
    return [LayerSpec(i, n_kv, head_dim, window) for i in range(n_layers)]
