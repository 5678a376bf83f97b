"""Per-agent draft length from its running acceptance.

Model: each draft token is accepted with probability a, independently (the usual analysis, Leviathan
et al. 2023). With k drafts a verify step emits E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs
about 1 + c·k decode steps (c = `cost_per_draft`: the extra cost of one more query column per agent,
small on a GPU where decode pads the tensor-core tile, larger on a CPU where every column is
compute). The agent drafts the k in 0..k_max that maximises E(k) / (1 + c·k); k = 0 is plain decode.

a is estimated from what the agent has seen (exponentially decayed counts, a Beta(1, 1) prior):
accepted drafts and rejections (a step that stops before its last draft has one rejection; a fully
accepted step has none) — the maximum-likelihood estimate of a geometric run length.

Back-off: while k = 0 the agent decodes plainly and learns nothing, so every `probe` plain steps it
drafts `probe_k` tokens once to re-measure; each failed probe doubles the wait (up to `max_probe`),
a successful one resets it.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["AdaptiveLength", "StepCost", "expected_tokens"]


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one verify step of k drafts at acceptance a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class AdaptiveLength:
    def __init__(self, k_max: int, cost_per_draft: float = 0.1, decay: float = 0.9, probe: int = 8,
                 max_probe: int = 64, probe_k: int = 2, fixed: bool = False):
        self.k_max, self.cost, self.decay = int(k_max), float(cost_per_draft), float(decay)
        self.probe0, self.max_probe, self.probe_k, self.fixed = int(probe), int(max_probe), int(probe_k), fixed
        self.acc = 1.0  # decayed accepted drafts (+ prior)
        self.rej = 1.0  # decayed rejections (+ prior)
        self.wait = 0  # plain steps left before the next probe
        self.probe = self.probe0

    @property
    def acceptance(self) -> float:
        return self.acc / (self.acc + self.rej)

    def best_k(self) -> int:
        a = self.acceptance
        best, score = 0, 1.0
        for k in range(1, self.k_max + 1):
            s = expected_tokens(a, k) / (1.0 + self.cost * k)
            if s > score * 1.0001:
                best, score = k, s
        return best

    def next(self) -> int:
        """Drafts to request for the next step (0: plain decode)."""
        if self.fixed:
            return self.k_max
        k = self.best_k()
        if k > 0:
            return k
        if self.wait > 0:
            self.wait -= 1
            return 0
        return min(self.probe_k, self.k_max)  # probe

    def update(self, drafted: int, accepted: int) -> None:
        """After a verify step with `drafted` drafts of which `accepted` were accepted."""
        if drafted <= 0:
            return
        was_off = self.best_k() == 0
        self.acc = self.decay * self.acc + accepted
        self.rej = self.decay * self.rej + (1 if accepted < drafted else 0)
        if self.best_k() == 0:
            if was_off:  # a failed probe: wait longer
                self.probe = min(self.max_probe, 2 * self.probe)
            self.wait = self.probe
        else:
            self.probe = self.probe0


class StepCost:
    """The cost of one draft column, in decode steps, measured from the batch's own timed steps.

    A batch step whose widest agent verifies w drafts (w = 0: a plain decode step) takes about
    T(w) = t0 + s·w seconds, so c = s / t0 is what `AdaptiveLength` needs. On a CPU a column is
    compute (measured 0.1-0.3 with SmolLM2 on 2 cores, depending on the workload's draft lengths);
    on a GPU it is nearly free. The fit is least squares over the last `window` steps, after
    dropping steps slower than 3x the median (a first replay's graph capture, a stall); until it
    has 4 steps of at least 2 widths, or when the fit is degenerate, the `prior` is used."""

    def __init__(self, prior: float, window: int = 24):
        self.prior = float(prior)
        self.obs: deque = deque(maxlen=int(window))

    def observe(self, width: int, seconds: float) -> None:
        self.obs.append((int(width), float(seconds)))

    @property
    def cost_per_draft(self) -> float:
        if len(self.obs) < 4:
            return self.prior
        med = statistics.median(t for _, t in self.obs)
        pts = [(w, t) for w, t in self.obs if t <= 3 * med]
        ws = [w for w, _ in pts]
        if len(set(ws)) < 2:
            return self.prior
        n, mw, mt = len(pts), sum(ws) / len(pts), sum(t for _, t in pts) / len(pts)
        var = sum((w - mw) ** 2 for w in ws)
        slope = sum((w - mw) * (t - mt) for w, t in pts) / var
        t0 = mt - slope * mw
        if t0 <= 0:
            return self.prior
        return min(2.0, max(0.0, slope / t0))

