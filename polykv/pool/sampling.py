"""Next-token choice for pool.generate: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> int:
    """logits float [vocab] -> token id. temperature <= 0: argmax."""
    if temperature is None or temperature <= 0:
        return int(torch.argmax(logits))
    x = logits.float() / float(temperature)
    if top_k and 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sx, si = torch.sort(x, descending=True)
        cp = torch.softmax(sx, -1).cumsum(-1)
        drop = cp - torch.softmax(sx, -1) >= top_p  # keep the smallest set reaching top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, si, sx)
    p = torch.softmax(x, -1)
    return int(torch.multinomial(p, 1, generator=generator))
