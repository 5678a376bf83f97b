"""Error table of every codec on fresh N(0, 1) data (the `polykv codecs` table)."""

from __future__ import annotations

import torch

from .registry import CODEC_NAMES, get_codec


def codec_errors(codec, x: torch.Tensor) -> tuple[float, float]:
    """(relative MSE, mean cosine) of decode(encode(x)) against x [..., head_dim]."""
    y = codec.decode(codec.encode(x)).float()
    xf = x.float()
    rel = float(((xf - y) ** 2).sum() / (xf ** 2).sum().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(xf.reshape(-1, xf.shape[-1]),
                                                      y.reshape(-1, xf.shape[-1]), dim=-1).mean())
    return rel, cos


def gaussian_table(head_dim: int = 128, rows: int = 8192, seed: int = 0) -> list[dict]:
    """One row per type: name, bits_per_value (measured from the packed tensors), rel_mse_gaussian,
    cosine_gaussian on `rows` fresh N(0,1) vectors of `head_dim`."""
    x = torch.randn(rows, head_dim, generator=torch.Generator().manual_seed(seed))
    out = []
    for name in CODEC_NAMES:
        codec = get_codec(name, head_dim)
        rel, cos = codec_errors(codec, x)
        out.append({"name": name, "bits_per_value": codec.bits_per_value(codec.encode(x)),
                    "rel_mse_gaussian": rel, "cosine_gaussian": cos})
    return out
