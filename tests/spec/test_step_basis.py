"""What a speculative step's measured time covers (spec/adaptive.py, "What T(w) covers"): the host
work that prepared it (drafting, record, feed) as well as its launch and wait, billed to the width
its drafts made — the basis of the pipelined plain loop's T(0) — and what the planner does with it:
no speculation when drafting costs more than the drafts bring, and no drafting for a step it
already knows is plain."""

from __future__ import annotations

import time

from polykv.engine import Engine
from polykv.spec import SpecConfig, Speculator
from polykv.spec.adaptive import StepTimes
from polykv.spec.drafters import PromptLookup
from polykv.spec.invariant import row_invariant
from tests.spec.helpers import DOC, PROMPTS, spec_pool

SLOW = 0.05  # seconds of host drafting per agent and step (the tiny model's step: a few ms)


def _slow_lookup(monkeypatch, calls: list):
    propose = PromptLookup.propose

    def slow(self, context, k):
        calls.append(k)
        time.sleep(SLOW)
        return propose(self, context, k)

    monkeypatch.setattr(PromptLookup, "propose", slow)


def _spy_times(monkeypatch) -> list:
    seen = []
    observe = StepTimes.observe
    monkeypatch.setattr(StepTimes, "observe", lambda self, n, w, s: (seen.append((n, w, s)), observe(self, n, w, s)))
    return seen


def test_a_verify_step_is_timed_with_its_drafting(monkeypatch):
    """Drafting runs on the host between two steps; a step with drafts (fixed length: every agent
    drafts every step) is timed with the drafting that made them. Before the fix its time ran from
    its launch to its ids only, under SLOW whatever the drafting cost."""
    model, pool, doc = spec_pool(DOC)
    calls = []
    _slow_lookup(monkeypatch, calls)
    seen = _spy_times(monkeypatch)
    pool.generate(doc, PROMPTS[:4], max_new_tokens=8,
                  speculative={"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": False, "min_ngram": 1})
    wide = [s for _, w, s in seen if w > 0]
    assert calls and wide
    assert min(wide) >= SLOW  # at least one agent drafted (slept) for each step with drafts
    by = pool.last_generate["step_ms"]["by_width"]
    assert all(ms >= SLOW * 1e3 for w, ms in by.items() if w > 0)  # the reported step times too


def test_the_planner_refuses_speculation_when_drafting_is_slow(monkeypatch):
    """Every draft right (an oracle: the plain answer's next tokens) but drafting costs 8 x SLOW per
    step: a step of 5 tokens per agent is not worth it against a plain step of a few ms. The planner
    turns plain after its first measured verify step and drafts again only to probe; before the fix
    (T(w) without the drafting) it verified 4 drafts nearly every step. Greedy stays token-identical."""
    model, pool, doc = spec_pool(DOC)
    n = 40
    with row_invariant(model):
        pool.generate(doc, PROMPTS, max_new_tokens=n)  # plain: T(0) of bucket 8, pipelined
        plain = pool.last_generate["answer_ids"]
        answers = {tuple(s): a for s, a in zip(pool.last_generate["suffix_ids"], plain)}
        calls = []

        class Oracle:
            def __init__(self, prompt):
                self.n, self.answer = len(prompt), answers[tuple(prompt)]

            def propose(self, context, k):
                calls.append(k)
                time.sleep(SLOW)
                m = len(context) - self.n
                return list(self.answer[m:m + k])

        add = Speculator.add

        def add_oracle(self, key, prompt_ids, config):
            add(self, key, prompt_ids, config)
            self._agents[key].drafter = Oracle(prompt_ids)

        monkeypatch.setattr(Speculator, "add", add_oracle)
        pool.generate(doc, PROMPTS, max_new_tokens=n, speculative={"method": "prompt_lookup", "num_draft_tokens": 4})
    lg = pool.last_generate
    assert lg["answer_ids"] == plain
    widths = lg["speculative"]["widths"]
    verify = sum(c for w, c in widths.items() if w > 0)
    assert widths.get(0, 0) >= 20 and verify <= 5, widths
    assert lg["speculative"]["acceptance"] > 0.9  # the drafts were good: time alone decided
    assert len(calls) <= 8 * (2 * verify + 1)  # plain steps the planner knew of drafted nothing


def _speculator(times: StepTimes, n: int = 8):
    calls = []

    class Drafter:
        def propose(self, context, k):
            calls.append(k)
            return [7] * k

    spec = Speculator(None, None, "cpu", times=times)
    for key in range(n):
        spec.add(key, [1, 2, 3], SpecConfig("prompt_lookup", 4))
        spec._agents[key].drafter = Drafter()
    return spec, calls


def test_backed_off_steps_draft_nothing():
    """Drafts all rejected: the planner turns plain; while it waits for its next probe (and after a
    failed probe) it knows before drafting that the step is plain, and no agent drafts — the probes
    alone draft. Widths and back-off as before (tests/spec/test_planner.py)."""
    times = StepTimes()
    for w in range(5):
        for _ in range(3):
            times.observe(8, w, 6e-3 * (1 + 0.05 * w))
    spec, calls = _speculator(times)
    keys = list(range(8))
    widths, drafted_steps = [], 0
    for _ in range(80):
        before = len(calls)
        drafts = spec.propose_all({k: 60 for k in keys}, agents=8)
        drafted_steps += len(calls) > before
        widths.append(max(len(d) for d in drafts.values()))
        for k in keys:
            spec.record(k, [5], len(drafts[k]))
    first_off = widths.index(0)
    probes = [i for i in range(first_off, 80) if widths[i]]
    assert probes and all(widths[i] == 2 for i in probes)
    # drafting: the steps before turning plain, the one that turned it, each probe
    assert drafted_steps == first_off + 1 + len(probes)


def test_t0_is_measured_not_extrapolated():
    """Only wider steps measured (their time holds the drafting): the next step is plain and drafts
    nothing, so T(0) is measured; then the planner drafts again."""
    times = StepTimes()
    times.observe(8, 4, 0.010)
    spec, calls = _speculator(times)
    drafts = spec.propose_all({k: 60 for k in range(8)}, agents=8)
    assert not calls and not any(drafts.values()) and spec.stats()["widths"] == {0: 1}
    spec.observe_step(0, 0.008, agents=8)
    drafts = spec.propose_all({k: 60 for k in range(8)}, agents=8)
    assert calls and max(len(d) for d in drafts.values()) > 0


def test_engine_times_a_verify_step_with_its_drafting(monkeypatch):
    """The engine's speculating batch: a step with drafts is timed with the `_apply` before it
    (record, drafting, feed), not from its launch only."""
    from tests.engine._models import make_pool, tiny_model
    from tests.spec.test_engine_server import DOC as EDOC, _run

    model, tok = tiny_model()
    pool = make_pool(model, tok)
    doc = pool.add_document(EDOC)
    prompts = [pool.prompt_ids(doc, q) for q in ("Ships:", "The keeper")]
    calls = []
    _slow_lookup(monkeypatch, calls)
    seen = []
    observe = Speculator.observe_step
    monkeypatch.setattr(Speculator, "observe_step",
                        lambda self, w, s, agents=None: (seen.append((w, s)), observe(self, w, s, agents)))
    with Engine(pool) as eng:
        _run(eng, doc, prompts, SpecConfig(method="prompt_lookup", num_draft_tokens=3, adaptive=False, min_ngram=1),
             max_tokens=12, temperature=0)
    wide = [s for w, s in seen if w > 0]
    assert calls and wide and min(wide) >= SLOW


def test_a_pipelined_call_times_t0_in_its_stretches_only(monkeypatch):
    """In a pipelined speculative call the plain step the planner weighs verify steps against is the
    stretches' period: a plain step run synchronously after drafting (the planner chose w = 0 with
    the drafts in hand) is not timed as T(0). Stretches refused here, so every plain step of the
    call is synchronous: none is timed, where a call with pipelined=False times them (drafts all
    rejected, so that most steps are plain)."""
    model, pool, doc = spec_pool(DOC)
    monkeypatch.setattr(Speculator, "plain_next", lambda self, limits, agents=None, static=False: False)
    add = Speculator.add

    def add_wrong(self, key, prompt_ids, config):  # drafts always rejected: the planner turns plain
        add(self, key, prompt_ids, config)
        self._agents[key].drafter = type("D", (), {"propose": lambda self, ctx, k: [0] * k})()

    monkeypatch.setattr(Speculator, "add", add_wrong)
    observed = []
    observe = Speculator.observe_step
    monkeypatch.setattr(Speculator, "observe_step",
                        lambda self, w, s, agents=None: (observed.append(w), observe(self, w, s, agents)))
    # a fixed draft cost: the planner's widths do not hang on this machine's timings
    spec = {"method": "prompt_lookup", "num_draft_tokens": 3, "min_ngram": 1, "cost_per_draft": 0.3}
    for pipelined in (True, False):
        observed.clear()
        pool.generate(doc, PROMPTS, max_new_tokens=24, speculative=spec, pipelined=pipelined)
        st = pool.last_generate["speculative"]
        assert st["widths"].get(0, 0) >= 5 and st["pipelined_steps"] == 0
        assert (0 in observed) is not pipelined, (pipelined, observed)


def test_the_planner_is_told_when_a_batch_is_static(monkeypatch):
    """`generate(max_batch=)`: while prompts wait to join, the planner maximises tokens per second
    (static=False); once every prompt has joined, the batch's finish (static=True)."""
    model, pool, doc = spec_pool(DOC)
    calls = []
    propose_all = Speculator.propose_all

    def spy(self, limits, agents=None, static=False):
        calls.append(static)
        return propose_all(self, limits, agents, static)

    monkeypatch.setattr(Speculator, "propose_all", spy)
    pool.generate(doc, PROMPTS, max_new_tokens=6, max_batch=3, speculative="prompt_lookup:3")
    assert False in calls and calls[-1] is True
    assert calls == sorted(calls)  # waiting, then static: prompts only ever stop waiting
    calls.clear()
    pool.generate(doc, PROMPTS, max_new_tokens=6, speculative="prompt_lookup:3")
    assert calls and all(calls)
