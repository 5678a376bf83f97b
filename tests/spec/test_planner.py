"""The batch-level draft width (`WidthPlanner`, `StepTimes`, `Speculator.propose_all`) on fake
timings: a step costs its widest agent, so the batch picks one width w maximising
sum_i E(a_i, min(k_i, w)) / T(w) and cuts every agent's drafts to it."""

from __future__ import annotations

import math

import pytest

from polykv.spec import SpecConfig, Speculator, expected_tokens
from polykv.spec.adaptive import StepTimes, WidthPlanner, agent_bucket, finish_weights, fit_cost_ratio


def times_of(table: dict[int, float], agents: int = 8, reps: int = 3) -> StepTimes:
    t = StepTimes()
    for w, s in table.items():
        for _ in range(reps):
            t.observe(agents, w, s)
    return t


def test_flat_step_time_drafts_the_most_steep_goes_plain():
    agents = [(0.5, 4)] * 8
    flat = WidthPlanner(4, times_of({w: 6e-3 for w in range(5)}))  # a GPU verify step ~ a decode step
    assert flat.choose(agents, 8) == 4
    steep = WidthPlanner(4, times_of({w: 6e-3 * (1 + 0.8 * w) for w in range(5)}))  # CPU-like compute
    assert steep.choose(agents, 8) == 0
    # in between: exactly the brute-force argmax of expected tokens per second over the measured T(w)
    T = {0: 5.2e-3, 1: 5.6e-3, 2: 6.1e-3, 3: 7.6e-3, 4: 8.5e-3}
    mixed = [(0.7, 4), (0.3, 2), (0.5, 0), (0.9, 4)]
    planner = WidthPlanner(4, times_of(T, agents=6))
    score = {w: (2 + sum(expected_tokens(a, min(k, w)) for a, k in mixed)) / T[w] for w in T}
    assert planner.choose(mixed, 6) == max(score, key=score.get)
    assert planner.best(mixed, 6)[1] == pytest.approx([score[w] for w in range(5)])


def test_the_widest_agent_sets_the_cost_not_each_agent():
    """Per-agent choices see only their own gain; the batch pays the widest. One eager agent among
    seven that gain little: with a steep T(w) the batch stays plain; alone it would draft."""
    T = {w: 1.0 + 0.35 * w for w in range(5)}
    planner = WidthPlanner(4, times_of(T, agents=8))
    alone = WidthPlanner(4, times_of(T, agents=1))
    assert alone.choose([(0.95, 4)], 1) > 0
    assert planner.choose([(0.95, 4)] + [(0.05, 4)] * 7, 8) == 0


def test_unmeasured_widths_follow_the_fitted_line_then_the_prior():
    t = StepTimes()
    assert WidthPlanner(4, t, prior=0.05).step_costs(8) == pytest.approx([1 + 0.05 * w for w in range(5)])
    for _ in range(3):
        t.observe(8, 0, 5.0)
        t.observe(8, 2, 6.0)
    planner = WidthPlanner(4, t, prior=0.05)
    assert fit_cost_ratio(t.seen(8)) == pytest.approx(0.1)
    costs = planner.step_costs(8)
    assert costs[0] == 5.0 and costs[2] == 6.0 and costs[1] == pytest.approx(5.5) and costs[4] == pytest.approx(7.0)
    # another bucket borrows the measured shape (c = 0.1), not the prior
    assert WidthPlanner(4, t, prior=0.05).cost_ratio(32) == pytest.approx(0.1)
    # a fixed cost_per_draft ignores the measurements
    assert WidthPlanner(4, t, cost_per_draft=0.3).step_costs(8) == pytest.approx([1 + 0.3 * w for w in range(5)])


def test_step_times_are_robust_to_a_capture():
    t = StepTimes()
    t.observe(5, 3, 0.6)  # a first step that captured a graph (450-725 ms on the H200)
    t.observe(5, 3, 0.007)
    assert t.estimate(8, 3) == 0.007  # fewer than 3 steps: the fastest (bucket 8 = 5 agents)
    t.observe(6, 3, 0.008)
    assert t.estimate(7, 3) == 0.008  # the median
    assert t.estimate(8, 2) is None and t.estimate(16, 3) is None
    assert agent_bucket(5) == 8 and agent_bucket(1) == 1


def test_low_acceptance_backs_off_to_plain_and_probes_rarely():
    """Free-form: drafts are found but rejected. The planner goes plain, probes after 8 plain steps,
    and waits twice as long after each failed probe; acceptance coming back turns drafting on."""
    spec = Speculator(None, None, "cuda", times=times_of({w: 6e-3 * (1 + 0.05 * w) for w in range(5)}))
    cfg = SpecConfig("prompt_lookup", 4)
    keys = list(range(8))
    for k in keys:
        spec.add(k, [1, 2, 3], cfg)
    for k in keys:
        spec._agents[k].drafter = type("D", (), {"propose": lambda self, ctx, k: [7] * k})()
    widths = []
    for step in range(120):
        drafts = spec.propose_all({k: 60 for k in keys}, agents=8)
        w = max(len(d) for d in drafts.values())
        widths.append(w)
        for k in keys:  # every draft rejected
            spec.record(k, [5], len(drafts[k]))
    assert widths[0] >= 2  # the prior acceptance (0.5) on a nearly flat T(w): draft
    first_off = widths.index(0)
    assert first_off <= 12  # ten rejected steps bring the estimate under 0.05, where even +5 % does not pay
    probes = [i for i in range(first_off, 120) if widths[i]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) <= 4 and gaps == sorted(gaps) and gaps[0] >= 8  # rare, ever rarer
    assert all(widths[i] <= 2 for i in probes)  # a probe drafts probe_k
    assert spec.stats()["widths"][0] >= 100
    for _ in range(30):  # the agents start to quote: every draft accepted
        drafts = spec.propose_all({k: 60 for k in keys}, agents=8)
        for k in keys:
            spec.record(k, drafts[k] + [5], len(drafts[k]))
    assert max(len(d) for d in spec.propose_all({k: 60 for k in keys}, agents=8).values()) == 4


def test_propose_all_cuts_every_agent_to_one_width():
    t = times_of({0: 1.0, 1: 1.05, 2: 1.1, 3: 5.0, 4: 6.0})  # widths beyond 2 are expensive
    spec = Speculator(None, None, "cpu", times=t)
    spec.add("a", [1], SpecConfig("prompt_lookup", 4))
    spec.add("b", [1], SpecConfig("prompt_lookup", 4))
    spec.add("fixed", [1], SpecConfig("prompt_lookup", 4, adaptive=False))
    for key in ("a", "b", "fixed"):
        spec._agents[key].drafter = type("D", (), {"propose": lambda self, ctx, k: list(range(10, 10 + k))})()
        spec._agents[key].length.acc, spec._agents[key].length.rej = 9.0, 1.0
    out = spec.propose_all({"a": 60, "b": 1}, agents=8)
    assert out == {"a": [10, 11], "b": [10]}  # w = 2; b's own limit is 1
    assert spec.stats()["widths"] == {2: 1}
    out = spec.propose_all({"a": 60, "fixed": 60}, agents=8)
    assert out["fixed"] == [10, 11, 12, 13] and out["a"] == [10, 11, 12, 13]  # the fixed agent sets the width


def test_a_static_batch_weighs_the_agents_that_finish_last():
    """Static batch (no prompt waiting): the call ends with its last answer, so each agent's
    expected tokens count by exp((left_i - L) / sqrt(L)). An agent far behind the others and without
    drafts keeps the step plain, however well the others would speculate (tokens per second would
    widen); agents level with each other count alike, as without weights."""
    T = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    planner = WidthPlanner(4, times_of(T, agents=4))
    quoting = [(0.9, 4), (0.9, 4), (0.9, 4), (0.2, 0)]
    assert planner.choose(quoting, 4) == 4  # tokens per second: the three quoting agents pay
    assert planner.choose(quoting, 4, left=[20, 20, 20, 60]) == 0  # the last one cannot quote
    assert planner.choose(quoting, 4, left=[60, 40, 40, 20]) == 4  # the last one quotes
    assert planner.choose(quoting[:3], 5, left=[20, 20, 20], rest=60) == 0  # one outside the list is last
    level = [(0.6, 4), (0.3, 2), (0.5, 0), (0.9, 3)]
    assert planner.best(level, 4, left=[30] * 4) == planner.best(level, 4)
    # exactly the weighted sum over the measured T(w)
    left = [25, 40, 12, 44]
    weights, _ = finish_weights(left)
    assert weights == pytest.approx([math.exp((n - 44) / math.sqrt(44)) for n in left])
    score = {w: sum(g * expected_tokens(a, min(k, w)) for g, (a, k) in zip(weights, level)) / T[w] for w in T}
    w, scores = planner.best(level, 4, left)
    assert w == max(score, key=score.get)
    assert scores == pytest.approx([score[w] for w in range(5)])


def test_a_static_batch_forecasts_drafts_before_drafting():
    """Once a static batch's planner turns plain, `plain_next` forecasts each agent's drafts from its
    last drafting: an agent that found none is taken to find none, so the next steps are known plain
    before drafting (pipelined) while the critical agent found nothing — where the bound of full
    drafts (a batch with prompts waiting) drafts on every step."""
    t = times_of({w: 1.0 + 0.1 * w for w in range(5)}, agents=4)
    spec = Speculator(None, None, "cuda", times=t)
    for key in range(4):
        spec.add(key, [1], SpecConfig("prompt_lookup", 4))
        spec._agents[key].length.acc, spec._agents[key].length.rej = 9.0, 1.0
        found = key < 3  # agent 3 never finds a draft
        spec._agents[key].drafter = type("D", (), {"propose": lambda self, ctx, k, f=found: [9] * k if f else []})()
    limits = {0: 20, 1: 20, 2: 20, 3: 60}  # agent 3: far the most tokens left
    assert max(map(len, spec.propose_all(limits, 4).values())) == 4  # tokens per second: widen
    assert max(map(len, spec.propose_all(limits, 4, static=True).values())) == 0  # static: plain
    assert spec.plain_next(limits, 4, static=True)  # forecast: agent 3 finds nothing again
    assert not spec.plain_next(limits, 4)  # the bound: agent 3 might draft 4
    spec._agents[3].found = True
    assert not spec.plain_next(limits, 4, static=True)
    assert Speculator._left({0: 5, 1: 9, 2: 2}, [0, 2]) == ([6, 3], 10)


def test_plain_next_never_approves_a_step_no_agent_needs():
    """While T(0) is calibrated the planner approves any plain step, and the loop launches the
    approved step beside the one it is about to run: where every agent's next step is its last
    (limits of the step after it all below 0), approving it made a speculative call one batch step
    longer than plain decoding (test_spec_host's flake: 9 steps against 8)."""
    t = StepTimes()
    t.observe(4, 2, 1.0)  # a verify step measured, T(0) not yet: calibrating
    spec = Speculator(None, None, "cuda", times=t)
    for key in range(4):
        spec.add(key, [1], SpecConfig("prompt_lookup", 4))
    assert spec.planner._calibrating(4)
    assert spec.plain_next({0: 0, 1: -1, 2: -1, 3: -1}, 4)  # agent 0 still emits in that step
    assert not spec.plain_next({0: -1, 1: -1, 2: -1, 3: -1}, 4)
    assert spec.pipelined_steps == 1
