"""Acceptance rules of speculative decoding.

An agent whose next token is t proposes drafts d_1..d_k. One forward over [t, d_1, .., d_k] gives
the target distributions p_0..p_k (p_j: of the token after d_j; d_0 = t). Emitted: the accepted
drafts d_1..d_m, then one token from p_m (a correction at a rejection, the bonus token when all
k are accepted). Rows of the rejected drafts d_{m+1}..d_k are rolled back.

Greedy. d_j is accepted while d_j = argmax p_{j-1}; the emitted tokens are exactly those plain
greedy decoding emits (`accept_greedy`).

Sampling, the standard rule (Leviathan et al. 2023; Chen et al. 2023) for a draft d drawn from q:
accept with probability min(1, p(d) / q(d)); on rejection draw from r = (p - q)+ / ||(p - q)+||_1.
Then P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) r(x) = min(q(x), p(x)) +
(p(x) - min(q(x), p(x))) = p(x): the output distribution is p, whatever q is (`accept_sampled`, the
general rule, any q). Model-free drafts are deterministic: q is a point mass on d, so the rule reads
"accept d with probability p(d); on rejection draw from p with d removed, renormalised".

What the pool and the engine run (`choose_with_drafts` in `AgentBatch`): each column's token is
drawn exactly as plain sampling would draw it — Gumbel-max with the agent's counter-based noise of
(seed, token index, vocabulary id), `generation.choose_tokens` — and d_j is accepted iff it equals
that column's token. For a point-mass draft this *is* the rule above: with x* = argmax(log p + G),
P(x* = d) = p(d) (accept with probability p(d)), and conditioned on x* != d, x* is distributed as p
restricted to the other tokens, renormalised (the residual r for q = δ_d). So sampled agents emit
the very tokens plain sampling with the same seed emits, not just the same distribution. Drafts
from a sampled draft model (q not a point mass) need `accept_sampled`.
"""

from __future__ import annotations

import torch

__all__ = ["accept_greedy", "accept_sampled", "accepted_prefix", "residual"]


def accepted_prefix(drafts: list[int], chosen: list[int]) -> int:
    """m: how many drafts match the target's own choices (chosen[j]: the token the target picks at
    column j, after d_j). len(chosen) >= len(drafts) + 1."""
    m = 0
    for d, c in zip(drafts, chosen):
        if d != c:
            break
        m += 1
    return m


def accept_greedy(drafts: list[int], chosen: list[int]) -> list[int]:
    """The emitted tokens: the matching prefix of the drafts, then the target's own next token."""
    m = accepted_prefix(drafts, chosen)
    return list(drafts[:m]) + [int(chosen[m])]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(p - q)+ renormalised (float [V]); p itself when q covers nothing p lacks (p == q)."""
    r = (p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator | None = None
                   ) -> tuple[bool, int]:
    """One step of the standard rule: p, q float [V] (target and draft distributions), `draft` drawn
    from q. Returns (accepted, emitted token): the draft, or a draw from the residual."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    pd, qd = float(p[draft]), float(q[draft])
    if qd > 0 and float(u) * qd <= pd:  # u < min(1, p/q)
        return True, int(draft)
    r = residual(p.double(), q.double())
    return False, int(torch.multinomial(r, 1, generator=generator))
