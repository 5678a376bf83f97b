"""Capture real K/V from a model and calibrate InnerQ tables from them.

    kv = capture_kv(model, tok, texts, max_tokens=2048)     # {layer: (keys, values)}
    table = calibrate_innerq(model, tok, texts)               # also saved to the cache dir

Keys are captured post-RoPE, exactly as a transformers cache stores them (and as KVCache encodes
them), through a plain full-length DynamicCache forward (no sliding trim, so sliding layers see every
token too).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..codecs import InnerQTable


def _token_chunks(tok, texts, max_tokens: int) -> list[torch.Tensor]:
    if isinstance(texts, str):
        texts = [texts]
    out = []
    for t in texts:
        if isinstance(t, torch.Tensor):
            ids = t.reshape(-1)
        elif isinstance(t, (list, tuple)) and t and isinstance(t[0], int):
            ids = torch.tensor(t)
        else:
            ids = torch.tensor(tok(t, add_special_tokens=True)["input_ids"])
        ids = ids[:max_tokens]
        if ids.numel():
            out.append(ids)
    if not out:
        raise ValueError("capture_kv: no tokens to run (empty texts)")
    return out


@torch.no_grad()
def capture_kv(model, tok, texts, max_tokens: int = 2048) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run each text (truncated to max_tokens; str, list of str, or token id tensors) through the
    model with a DynamicCache and return {layer: (keys, values)}, each float32
    [1, kv_heads, total_tokens, head_dim] (texts concatenated along the sequence axis)."""
    from transformers import DynamicCache

    per_layer: dict[int, tuple[list, list]] = {}
    device = next(model.parameters()).device
    for ids in _token_chunks(tok, texts, max_tokens):
        cache = DynamicCache()  # no config: every layer keeps all rows
        model(input_ids=ids[None].to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        for i, layer in enumerate(cache.layers):
            ks, vs = per_layer.setdefault(i, ([], []))
            ks.append(layer.keys.float().cpu())
            vs.append(layer.values.float().cpu())
    return {i: (torch.cat(ks, 2), torch.cat(vs, 2)) for i, (ks, vs) in per_layer.items()}


def calibrate_innerq(model, tok, texts, max_tokens: int = 2048, save: bool = True,
                     path: str | Path | None = None) -> InnerQTable:
    """InnerQ key scales from real keys of `texts`; saved (when save=True) to `path` or to the
    polykv cache dir, where KVCache(innerq="auto") finds it for this model."""
    from .fingerprint import innerq_key, innerq_path

    kv = capture_kv(model, tok, texts, max_tokens)
    table = InnerQTable.calibrate({i: k for i, (k, _) in kv.items()}, model=innerq_key(model))
    if save:
        target = Path(path) if path is not None else innerq_path(model)
        target.parent.mkdir(parents=True, exist_ok=True)
        table.save(target)
        table.path = str(target)  # type: ignore[attr-defined]
    return table


__all__ = ["calibrate_innerq", "capture_kv"]
