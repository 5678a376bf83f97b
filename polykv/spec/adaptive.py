"""How many drafts to verify: per agent (its running acceptance) and per batch step (the step's cost).

Model: each draft token is accepted with probability a, independently (the usual analysis, Leviathan
et al. 2023). With k drafts a verify step emits E(k) = (1 - a^(k+1)) / (1 - a) tokens.

Per agent (`AdaptiveLength`, the engine's loop): the step is taken to cost about 1 + c·k decode
steps (c = `cost_per_draft`: the extra cost of one more query column per agent, small on a GPU where
decode pads the tensor-core tile, larger on a CPU where every column is compute) and the agent
drafts the k in 0..k_max that maximises E(k) / (1 + c·k); k = 0 is plain decode.

Per batch (`WidthPlanner`, `SharedKVPool.generate`): a batch step runs every agent with the columns
of the WIDEST one (left-padded; a captured step per width), so its time T(w) depends on the widest
draft count w alone, and per-agent choices that ignore the others are not enough: the planner picks
the w in 0..k_max maximising  sum_i E(a_i, min(k_i, w)) / T(w)  (k_i: the drafts agent i has, agents
without drafts emit 1 token) and caps every agent at w drafts — drafts up to w are free in a step
of width w. T(w) is measured (`StepTimes`: the median of the batch's own steps of that agent bucket
and width, kept per document across generate calls), and before a width is seen, the line
T(w) = t0·(1 + c·w) through the measured ones (c fitted from at least two widths, else the device
prior). w = 0 is a plain decode step for everyone.

Static batches (`SharedKVPool.generate` with no prompt waiting for a slot): the call ends when its
last answer does, so tokens per second over the batch is the wrong aim — drafts accepted by an
agent that finishes early anyway shorten nothing. The planner then weighs each agent's expected
tokens by how likely it is to be the last one (`finish_weights`: exp((left_i - L) / sqrt(L)), left_i
the tokens agent i may still emit, L the most of any agent): agents near the longest answer count
fully, those far ahead hardly at all. The softness is on purpose: the last agent is not settled
while much is left, and on the CPU a planner that counted the longest answer alone (the steps it
still needs at each width) widened too rarely: 47 steps for the quoting bench's 64 tokens against
39–46 for the unweighted sum and 42–45 for the weighting (session 22, 2 cores, 4 agents;
BENCHMARKS §8.14). Before drafting, `plain_ahead` needs each agent's drafts ahead of time: in a
static batch it forecasts them (an agent whose last drafting found nothing is taken to find nothing
again) rather than bounding them, since a bound of full drafts for everyone nearly always calls for
drafting, and a step drafted and then kept plain runs synchronously instead of pipelined. Measured
motive (H100, SmolLM2 bf16, `polykv bench spec`, session 22): a static batch's verify steps brought
1.9–2.2 tokens per agent, yet the calls took 52–64 steps against plain decoding's 64, each slower:
0.82–0.95× for quoting.

What T(w) covers (one basis for every width): the whole wall of one step of the loop that runs it,
from the previous step's ids on the host to this step's — the host work that prepares its inputs
(the last ids' stop rules, `Speculator.record`, drafting, the planner, `feed`), its launch and the
wait for its ids — billed to the width its drafts made. That is the pipelined plain loop's period
between reads (`SharedKVPool._decode_pipelined`), which feeds T(0) from plain calls. Before issue I's
fix (session 15) a speculative step was timed from its launch to its ids only: drafting, record and
feed were left out of T(w > 0) while T(0) from plain calls held all the host work, so speculation
looked cheaper than it was. The engine times its speculating batches the same way (`_apply` after a
step + the next step). Graph-capturing steps and the prompts' prefill stay untimed.

w = 0 inside the speculative loop versus plain decoding: a w = 0 step of the speculative loop is
synchronous (its host work and the device's take turns) where the pipelined plain loop overlaps
them, so on a GPU it costs more than a plain call's step (on the CPU the two are nearly the same:
the forward is host work either way). The planner chooses among the steps its own loop can run, so
the T(0) it needs is the speculative loop's: (1) such a step drafts nothing when the planner knows
before drafting that it will be plain (`WidthPlanner.plain_ahead`: backed off and waiting, and
even full drafts would not pay; or calibrating), so drafting is billed only to the widths that
use it and "don't speculate" saves it; (2) T(0) is never extrapolated from wider steps (their time
holds the drafting): a bucket with widths measured but no T(0) runs one plain step to measure it
(calibrating). T(0)'s window (the last 16 plain steps) starts from plain calls' pipelined steps
when there were some, the bar a speculative call must clear (a conservative start on a GPU), and
the speculative loop's own plain steps replace them as they run — in `SharedKVPool.generate`'s
pipelined mode only its pipelined stretches' periods: a plain step of the loop is what the call runs
instead of speculating, and once the planner turns plain that is a stretch (session 22, H100, 8
agents: the loop's plain steps, synchronous and stretch ones together, had a median of 2.2 ms
against a plain call's 1.8, so a width-3 step of 2.9 ms looked 1.3× a plain one where it cost
1.6×); the engine times its speculating batches' plain steps the same way. Whether to speculate at
all rather than decode plain and pipelined is the caller's choice: a speculative call that the planner keeps
plain runs slower than a plain call on a GPU (the synchronous loop), by the host work it no longer
overlaps.

a is estimated from what the agent has seen (exponentially decayed counts, a Beta(1, 1) prior):
accepted drafts and rejections (a step that stops before its last draft has one rejection; a fully
accepted step has none) — the maximum-likelihood estimate of a geometric run length.

Back-off (both): while k (w) = 0 nothing is learned about acceptance, so every `probe` plain steps
a probe of `probe_k` drafts re-measures; each failed probe doubles the wait (up to `max_probe`), a
successful one resets it.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque

__all__ = ["AdaptiveLength", "StepCost", "StepTimes", "WidthPlanner", "expected_tokens", "finish_weights"]


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one verify step of k drafts at acceptance a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class AdaptiveLength:
    def __init__(self, k_max: int, cost_per_draft: "float | StepCost" = 0.1, decay: float = 0.9, probe: int = 8,
                 max_probe: int = 64, probe_k: int = 2, fixed: bool = False):
        self.k_max, self.cost, self.decay = int(k_max), cost_per_draft, float(decay)
        self.probe0, self.max_probe, self.probe_k, self.fixed = int(probe), int(max_probe), int(probe_k), fixed
        self.acc = 1.0  # decayed accepted drafts (+ prior)
        self.rej = 1.0  # decayed rejections (+ prior)
        self.wait = 0  # plain steps left before the next probe
        self.probe = self.probe0
        self.planned = False  # its width comes from a WidthPlanner: `update` keeps the acceptance only

    @property
    def cost(self) -> float:
        """c: a number, or the current fit of a `StepCost` given as cost_per_draft (read when needed:
        a batch's agents no longer copy the fit after every step)."""
        return self._cost if self._cost_src is None else self._cost_src.cost_per_draft

    @cost.setter
    def cost(self, value) -> None:
        if isinstance(value, StepCost):
            self._cost_src, self._cost = value, None
        else:
            self._cost_src, self._cost = None, float(value)

    @property
    def acceptance(self) -> float:
        return self.acc / (self.acc + self.rej)

    def best_k(self) -> int:
        a, cost = self.acceptance, self.cost
        best, score = 0, 1.0
        for k in range(1, self.k_max + 1):
            s = expected_tokens(a, k) / (1.0 + cost * k)
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
        if self.planned:  # the planner has its own back-off; `next` is not asked (two best_k
            # scans per agent and step were ~0.2 ms of host time per step at 32 agents)
            self.acc = self.decay * self.acc + accepted
            self.rej = self.decay * self.rej + (1 if accepted < drafted else 0)
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
        self._fit: float | None = None  # cost_per_draft of the current obs

    def observe(self, width: int, seconds: float) -> None:
        self.obs.append((int(width), float(seconds)))
        self._fit = None

    @property
    def cost_per_draft(self) -> float:
        """The fit of the current observations (computed once per observation, when read)."""
        if self._fit is None:
            self._fit = self._cost_per_draft()
        return self._fit

    def _cost_per_draft(self) -> float:
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



def agent_bucket(n: int) -> int:
    """The batch size a step of n agents runs at: the next power of two (the captured steps'
    buckets, polykv.pool.decode_graph.bucket); step times are kept per bucket."""
    return 1 << max(0, int(n) - 1).bit_length()


class StepTimes:
    """Measured seconds of batch steps by (agent bucket, width) — width: the widest draft count of
    the step (0 = plain decode; the step has width + 1 query columns). Thread-safe (the pool keeps
    one per document, shared by concurrent generate calls). Callers leave out steps that prefilled
    prompts or captured a graph; `estimate` is robust to the odd one left in anyway: the median of
    the last `window` steps once there are 3, before that the fastest (a capture or a stall only
    ever makes a step slower)."""

    def __init__(self, window: int = 16):
        self.window = int(window)
        self._obs: dict[tuple[int, int], deque] = {}
        # memos, dropped by the next observation of their key / bucket (the planner asks for every
        # width of its bucket twice per step; one width changed since the last step)
        self._est: dict[tuple[int, int], float] = {}
        self._seen: dict[int, dict[int, float]] = {}
        self._lock = threading.Lock()

    def observe(self, agents: int, width: int, seconds: float) -> None:
        key = (agent_bucket(agents), int(width))
        with self._lock:
            self._obs.setdefault(key, deque(maxlen=self.window)).append(float(seconds))
            self._est.pop(key, None)
            self._seen.pop(key[0], None)

    def _estimate(self, key) -> float | None:
        got = self._est.get(key)
        if got is None:
            xs = self._obs.get(key)
            if not xs:
                return None
            got = self._est[key] = statistics.median(xs) if len(xs) >= 3 else min(xs)
        return got

    def estimate(self, agents: int, width: int) -> float | None:
        """Seconds of one step of `width` for `agents` agents, or None when never measured."""
        with self._lock:
            return self._estimate((agent_bucket(agents), int(width)))

    def seen(self, agents: int) -> dict[int, float]:
        """{width: estimate} of every width measured for this agent bucket (kept until the bucket's
        next observation: the planner asks for it twice per step)."""
        b = agent_bucket(agents)
        with self._lock:
            got = self._seen.get(b)
            if got is None:
                got = self._seen[b] = {w: self._estimate((b, w)) for w in sorted(w for bb, w in self._obs if bb == b)}
            return dict(got)

    def buckets(self) -> list[int]:
        with self._lock:
            return sorted({b for b, _ in self._obs})

    def table(self) -> dict[int, dict[int, float]]:
        """{bucket: {width: seconds}} (diagnostics)."""
        return {b: self.seen(b) for b in self.buckets()}


def fit_cost_ratio(points: dict[int, float]) -> float | None:
    """c of the line T(w) = t0 + s·w = t0·(1 + c·w), least squares through {w: T(w)} (at least two
    widths); None when there are fewer or the fit is degenerate. Clamped to [0, 10]."""
    if len(points) < 2:
        return None
    ws, ts = list(points), list(points.values())
    n, mw, mt = len(ws), sum(ws) / len(ws), sum(ts) / len(ts)
    var = sum((w - mw) ** 2 for w in ws)
    slope = sum((w - mw) * (t - mt) for w, t in zip(ws, ts)) / var
    t0 = mt - slope * mw
    if t0 <= 0:
        return None
    return min(10.0, max(0.0, slope / t0))


def finish_weights(left: list[int], rest: int = 0) -> tuple[list[float], float]:
    """How much each agent of a static batch weighs in a step's worth, from the tokens it may still
    emit (left; rest: the most any agent outside `left` may, counted as one agent at one token a
    step): exp((left_i - L) / τ), L the most tokens left, τ = sqrt(L). The batch ends with its last
    agent, so tokens of agents far from it are worth little; but who finishes last is not settled
    while much is left (every verify step moves the agents apart by a token or so), so agents within
    about sqrt(L) tokens of the longest count nearly as much. Returns (weights, rest's weight)."""
    most = max(max(left, default=0), int(rest))
    tau = math.sqrt(max(most, 1))
    return [math.exp((n - most) / tau) for n in left], (math.exp((rest - most) / tau) if rest > 0 else 0.0)


class WidthPlanner:
    """The batch-level draft width (module doc): `choose` once per step, before the drafts are fed.

    times: the measured step times (`StepTimes`, kept by the pool per document); prior: the cost of
    one draft column in plain steps before two widths are measured (`DEFAULT_COST_PER_DRAFT`);
    cost_per_draft: a fixed c instead of any measurement (T(w) = 1 + c·w); probe / max_probe /
    probe_k: the back-off (module doc)."""

    def __init__(self, k_max: int, times: StepTimes | None = None, prior: float = 0.1,
                 cost_per_draft: float | None = None, probe: int = 8, max_probe: int = 64, probe_k: int = 2):
        self.k_max = int(k_max)
        self.times = times if times is not None else StepTimes()
        self.prior, self.cost = float(prior), cost_per_draft
        self.probe0, self.max_probe, self.probe_k = int(probe), int(max_probe), int(probe_k)
        self.probe = self.probe0
        self.wait = 0
        self._off = False  # the last choice with drafts available was plain
        self._probed = False  # the last choice was a probe

    def cost_ratio(self, agents: int) -> float:
        """c (extra cost of one draft column per step, in units of t0): fitted from this agent
        bucket's measured widths, else from the nearest bucket with two widths, else the prior."""
        if self.cost is not None:
            return float(self.cost)
        c = fit_cost_ratio(self.times.seen(agents))
        if c is not None:
            return c
        b = agent_bucket(agents)
        for other in sorted(self.times.buckets(), key=lambda x: abs(x.bit_length() - b.bit_length())):
            c = fit_cost_ratio(self.times.seen(other))
            if c is not None:
                return c
        return self.prior

    def step_costs(self, agents: int) -> list[float]:
        """T(w) for w = 0..k_max: measured where seen (seconds), else the fitted line anchored on the
        nearest measured width; relative units 1 + c·w when nothing is measured for this bucket (or
        with a fixed cost_per_draft). Only the ratios matter."""
        c = self.cost_ratio(agents)
        seen = {} if self.cost is not None else self.times.seen(agents)
        out = []
        for w in range(self.k_max + 1):
            if w in seen:
                out.append(seen[w])
            elif seen:
                w0 = min(seen, key=lambda x: (abs(x - w), x))
                out.append(seen[w0] * (1.0 + c * w) / (1.0 + c * w0))
            else:
                out.append(1.0 + c * w)
        return out

    def best(self, agents: list[tuple[float, int]], n_agents: int | None = None, left: list[int] | None = None,
             rest: int = 0) -> tuple[int, list[float]]:
        """(the best w, the score of every w). agents: (acceptance, drafts available) of each agent
        that drafts; n_agents: all agents of the step (the others emit one token whatever w is).
        left None: the score is the expected tokens per second (module doc). left given (a static
        batch): the tokens each agent of `agents` may still emit, rest the most any other agent of
        the step may; each agent's tokens are weighted by how likely it is to finish last
        (`finish_weights`; module doc, "Static batches")."""
        n = max(len(agents), int(n_agents) if n_agents is not None else len(agents))
        costs = self.step_costs(n)
        if left is None:
            weights, others = None, n - len(agents)
        else:
            weights, others = finish_weights(left, rest)
        top = self.k_max
        # sums[w] = sum(weight * expected_tokens(a, min(k, w)) for a, k in agents): the same floats added
        # in the same order, each agent's k pow calls once instead of k_max + 1 calls (measured 32
        # agents: 75 -> 30 us per step)
        sums = [0] * (top + 1)
        widths = range(1, top + 1)
        for i, (a, k) in enumerate(agents):
            m = k if k < top else top
            g = 1.0 if weights is None else weights[i]
            e = g  # g * expected_tokens(a, 0), exactly
            sums[0] += e
            if a >= 1.0:
                for j in widths:
                    if j <= m:
                        e = g * float(j + 1)
                    sums[j] += e
            else:
                d = 1.0 - a
                for j in widths:
                    if j <= m:
                        e = g * ((1.0 - a ** (j + 1)) / d)
                    sums[j] += e
        return self._argmax([(others + sums[w]) / max(costs[w], 1e-12) for w in range(top + 1)])

    def _argmax(self, scores: list[float]) -> tuple[int, list[float]]:
        """(the w of the highest score, a wider w winning only by more than 0.01 %; the scores)."""
        w = 0
        for j in range(1, self.k_max + 1):
            if scores[j] > scores[w] * 1.0001:
                w = j
        return w, scores

    def _calibrating(self, n: int) -> bool:
        """T(0) of this agent bucket never measured while another width is: the next step is plain
        (one step measures what not speculating costs; it is never extrapolated from wider steps,
        whose time holds the drafting that a plain step skips)."""
        return self.cost is None and self.times.estimate(n, 0) is None and bool(self.times.seen(n))

    def plain_ahead(self, bound, n_agents: int) -> bool:
        """Before drafting: whether the next step is plain whatever the drafts turn out to be, so
        nothing need be drafted. bound: a function giving (agents, left, rest) as `best` takes them
        — (acceptance, the most drafts it may have) of every drafting agent —, called only while
        the planner is off (backed off, waiting or just probed): if w = 0 wins with these, it wins
        with the real drafts (fewer drafts only lower a wider step's score), and `choose` would have
        returned 0 with this very state change (the wait goes down; a failed probe doubles it
        first). In a static batch the drafts are a forecast instead (`Speculator._most_drafts`).
        Also True while calibrating T(0)."""
        if self._calibrating(int(n_agents)):
            return True
        if not (self._off and (self.wait > 0 or self._probed)):
            return False
        agents, left, rest = bound()
        if not agents or self.best(agents, max(len(agents), int(n_agents)), left, rest)[0] > 0:
            return False
        if self._probed:  # the probe did not bring the acceptance back (as `choose`)
            self._probed = False
            self.probe = min(self.max_probe, 2 * self.probe)
            self.wait = self.probe
        self.wait -= 1
        return True

    def choose(self, agents: list[tuple[float, int]], n_agents: int | None = None, left: list[int] | None = None,
               rest: int = 0) -> int:
        """The width of the next step (0 = plain): `best` (left, rest: its static-batch objective),
        with the back-off's probes while it is 0. A probe's width is probe_k (capped by k_max and
        the longest draft available); a step without drafts available is plain and probes nothing
        (it still counts in the wait)."""
        n = max(len(agents), int(n_agents) if n_agents is not None else len(agents))
        if self._calibrating(n):
            return 0
        avail = max((k for _, k in agents), default=0)
        w, _ = self.best(agents, n, left, rest)
        probed, self._probed = self._probed, False
        if w > 0:
            self._off, self.probe, self.wait = False, self.probe0, 0
            return w
        if not self._off:
            if avail == 0:  # nothing drafted: nothing decided
                return 0
            self._off, self.wait = True, self.probe  # just turned plain: wait before the first probe
        elif probed:  # the probe did not bring the acceptance back: wait longer
            self.probe = min(self.max_probe, 2 * self.probe)
            self.wait = self.probe
        if self.wait > 0:
            self.wait -= 1
            return 0
        if avail == 0:  # the probe waits for a step with drafts
            return 0
        self._probed = True
        return min(self.probe_k, self.k_max, avail)
