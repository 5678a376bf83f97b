"""InnerQ: per-layer, per-(kv head, channel) key scales that balance channel magnitudes before a
turbo codec quantizes them.

    s_c = clamp((mean_rms / rms_c) ** 0.5, 0.5, 2)     (mean over the head's channels)
Keys are stored as K * s and queries use q / s, so q.k is unchanged while the quantizer sees
flatter channels. Heads whose channels are already balanced (max/min rms < BALANCED_RATIO) keep
s = 1; a layer where every head is balanced has no table at all. Layers never share a table, so
layers of different head_dim (Gemma's local/global) are naturally separate.

File format: safetensors, tensor "layer.<i>" = float32 [kv_heads, head_dim], metadata
{"format": "polykv-innerq", "version": "1", "model": <fingerprint or "">}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

BALANCED_RATIO = 1.2
SCALE_MIN, SCALE_MAX = 0.5, 2.0
FORMAT = "polykv-innerq"
VERSION = "1"


def channel_rms(keys: torch.Tensor) -> torch.Tensor:
    """RMS per (kv head, channel) of keys [batch, kv_heads, seq, head_dim] -> float32 [kv_heads, D]."""
    if keys.dim() != 4:
        raise ValueError(f"keys must be [batch, kv_heads, seq, head_dim], got {tuple(keys.shape)}")
    k = keys.float()
    return k.pow(2).mean(dim=(0, 2)).sqrt()


def scales_from_rms(rms: torch.Tensor) -> torch.Tensor | None:
    """InnerQ scales [kv_heads, D] from channel RMS [kv_heads, D]; None when every head is balanced."""
    rms = rms.float().clamp_min(1e-12)
    balanced = (rms.amax(-1) / rms.amin(-1)) < BALANCED_RATIO  # [kv_heads]
    if bool(balanced.all()):
        return None
    s = (rms.mean(-1, keepdim=True) / rms).sqrt().clamp(SCALE_MIN, SCALE_MAX)
    s[balanced] = 1.0
    return s


@dataclass
class InnerQTable:
    """Per-layer key scales; `scales[i]` is float32 [kv_heads, head_dim] or absent (no scaling)."""

    scales: dict[int, torch.Tensor] = field(default_factory=dict)
    model: str = ""

    @classmethod
    def calibrate(cls, keys_by_layer: dict[int, torch.Tensor], model: str = "") -> "InnerQTable":
        """Calibrate from real keys: {layer: [batch, kv_heads, seq, head_dim]} (pre-RoPE or post-RoPE,
        as the cache stores them — post-RoPE for transformers caches)."""
        table = cls(model=model)
        for layer, keys in keys_by_layer.items():
            s = scales_from_rms(channel_rms(keys))
            if s is not None:
                table.scales[int(layer)] = s
        return table

    def layer(self, i: int) -> torch.Tensor | None:
        return self.scales.get(i)

    def scale_keys(self, i: int, keys: torch.Tensor) -> torch.Tensor:
        """keys [batch, kv_heads, seq, D] -> keys * s (unchanged when layer i has no table)."""
        s = self.scales.get(i)
        if s is None:
            return keys
        return keys * s.to(device=keys.device, dtype=keys.dtype)[None, :, None, :]

    def unscale_keys(self, i: int, keys: torch.Tensor) -> torch.Tensor:
        """Inverse of scale_keys: keys [batch, kv_heads, seq, D] / s."""
        s = self.scales.get(i)
        if s is None:
            return keys
        return keys / s.to(device=keys.device, dtype=keys.dtype)[None, :, None, :]

    def scale_queries(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """q [batch, q_heads, seq, D] -> q / s, each kv head's scale repeated over its GQA group."""
        s = self.scales.get(i)
        if s is None:
            return q
        s = s.to(device=q.device, dtype=q.dtype).repeat_interleave(q.shape[1] // s.shape[0], 0)
        return q / s[None, :, None, :]

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {f"layer.{i}": s.contiguous().float().cpu() for i, s in self.scales.items()}
        if not tensors:  # safetensors needs at least one entry to carry metadata reliably
            tensors = {"empty": torch.zeros(1)}
        save_file(tensors, str(path), metadata={"format": FORMAT, "version": VERSION,
                                                "model": self.model})

    @classmethod
    def load(cls, path: str | Path) -> "InnerQTable":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not a polykv InnerQ table (format={meta.get('format')!r})")
            if meta.get("version") != VERSION:
                raise ValueError(f"{path}: unsupported InnerQ table version {meta.get('version')!r}")
            scales = {int(k.split(".")[1]): f.get_tensor(k) for k in f.keys() if k.startswith("layer.")}
        return cls(scales=scales, model=meta.get("model", ""))
