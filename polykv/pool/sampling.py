"""Next-token choice: greedy, temperature, top-k, top-p (nucleus). Shared by pool.generate and the
serving engine (which adds per-request parameters and stop strings on top)."""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = 0,
                generator: torch.Generator | None = None) -> int:
    """logits float [vocab] -> token id.

    temperature <= 0: argmax (ties: lowest id). Otherwise logits / temperature, filtered by top-k,
    then top-p (the smallest set of most likely tokens whose probability reaches top_p; the most
    likely token always stays), and one token drawn with `generator`."""
    logits = logits.detach().reshape(-1).float()
    if temperature is None or temperature <= 0:
        return int(torch.argmax(logits))
    x = logits / float(temperature)
    if top_k and 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sx, order = torch.sort(x, descending=True)
        probs = torch.softmax(sx, -1)
        drop = torch.cumsum(probs, -1) - probs >= top_p  # mass strictly before each token
        drop[0] = False
        x = torch.full_like(x, float("-inf")).scatter(0, order, sx.masked_fill(drop, float("-inf")))
    p = torch.softmax(x, -1)
    if not bool(torch.isfinite(p).all()) or float(p.sum()) <= 0:  # all -inf / nan logits
        return int(torch.argmax(logits))
    return int(torch.multinomial(p, 1, generator=generator))


def sample_rows(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int | None = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Batched `sample_next` on the logits' device, without host syncs: logits float [G, vocab] ->
    int64 [G] token ids. Same rules per row (argmax when temperature <= 0; rows whose filtered
    distribution is not finite fall back to argmax); `generator` must live on the logits' device."""
    logits = logits.detach().float()
    best = torch.argmax(logits, dim=-1)
    if temperature is None or temperature <= 0:
        return best
    x = logits / float(temperature)
    if top_k and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sx, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sx, -1)
        drop = torch.cumsum(probs, -1) - probs >= top_p  # mass strictly before each token
        drop[:, 0] = False
        x = torch.full_like(x, float("-inf")).scatter(1, order, sx.masked_fill(drop, float("-inf")))
    p = torch.softmax(x, -1)
    ok = torch.isfinite(p).all(-1) & (p.sum(-1) > 0)
    p = torch.where(ok[:, None], p, torch.nn.functional.one_hot(best, p.shape[-1]).to(p.dtype))
    return torch.multinomial(p, 1, generator=generator)[:, 0]
