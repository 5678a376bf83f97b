"""Speculative requests through the engine and the HTTP server (tiny random model, SmolLM2's
tokenizer): the same text as without speculation, stats in usage, bad configs refused."""

from __future__ import annotations

import httpx
import pytest

from polykv.engine import Engine, GenerationRequest, SamplingParams
from polykv.spec import SpecConfig
from polykv.spec.invariant import row_invariant
from tests.engine._models import make_pool, tiny_model

DOC = ("The lighthouse keeper of Varnholm logged every ship that passed the northern cape. "
       "In the winter of 1911 the logbook records eleven ships, three of them whalers. ") * 3


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def _run(engine, doc, prompts, spec, **params):
    hs = [engine.submit(GenerationRequest(p, SamplingParams(**params), document=doc, speculative=spec))
          for p in prompts]
    return [h.result_sync(timeout=120) for h in hs]


def test_engine_speculative_matches_plain(tiny):
    model, tok = tiny
    pool = make_pool(model, tok)
    doc = pool.add_document(DOC)
    prompts = [pool.prompt_ids(doc, q) for q in ("Ships:", "The keeper", "whalers in 1911", "cape")]
    with row_invariant(model), Engine(pool) as eng:
        plain = _run(eng, doc, prompts, None, max_tokens=24, temperature=0)
        spec = _run(eng, doc, prompts, SpecConfig(method="suffix_tree", num_draft_tokens=3, adaptive=False),
                    max_tokens=24, temperature=0)
        sampled = _run(eng, doc, prompts, None, max_tokens=16, temperature=0.9, seed=5)
        sampled_spec = _run(eng, doc, prompts, SpecConfig(num_draft_tokens=2, adaptive=False), max_tokens=16,
                            temperature=0.9, seed=5)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    assert [u["completion_tokens"] for _, _, u in spec] == [u["completion_tokens"] for _, _, u in plain]
    stats = [u["speculative"] for _, _, u in spec]
    assert all(s["method"] == "suffix_tree" for s in stats)
    assert sum(s["drafted"] for s in stats) > 0 and sum(s["accepted"] for s in stats) > 0
    assert "speculative" not in plain[0][2]
    assert [t for t, _, _ in sampled_spec] == [t for t, _, _ in sampled]


def test_server_accepts_speculative_and_reports_usage(tiny):
    from polykv.server import ServerThread, create_app

    model, tok = tiny
    app = create_app(make_pool(model, tok), model_name="tiny-test")
    with ServerThread(app) as srv:
        doc = httpx.post(srv.url + "/v1/documents", json={"text": DOC}, timeout=60).json()
        body = {"prompt": "Ships:", "max_tokens": 12, "temperature": 0, "document": doc["id"]}
        plain = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json=dict(body, speculative={"method": "prompt_lookup", "num_draft_tokens": 3}))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert {"drafted", "accepted", "steps", "acceptance"} <= set(usage["speculative"])
        assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
        bad = httpx.post(srv.url + "/v1/completions", timeout=60,
                         json=dict(body, speculative={"method": "telepathy"}))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_engine_prices_draft_columns_from_its_decode_steps(tiny, monkeypatch):
    """The engine feeds each speculating batch's decode steps (never a step that prefilled a prompt)
    with their draft width to the batch's Speculator (`StepCost`)."""
    from polykv.spec import Speculator

    model, tok = tiny
    pool = make_pool(model, tok)
    doc = pool.add_document(DOC)
    prompts = [pool.prompt_ids(doc, q) for q in ("Ships:", "The keeper")]
    seen = []
    observe = Speculator.observe_step
    monkeypatch.setattr(Speculator, "observe_step",
                        lambda self, w, s, agents=None: (seen.append((w, s)), observe(self, w, s, agents)))
    with Engine(pool) as eng:
        _run(eng, doc, prompts, SpecConfig(method="suffix_tree", num_draft_tokens=3, adaptive=False),
             max_tokens=16, temperature=0)
        steps = eng.steps
    assert seen and max(w for w, _ in seen) > 0 and all(s > 0 for _, s in seen)
    assert len(seen) < steps  # the prompt prefill step is not timed


def test_engine_plans_one_width_per_batch_step(tiny, monkeypatch):
    """The engine drafts through the batch-level planner (`Speculator.propose_all`, as
    pool.generate), not per agent: every step's drafts share one width, the planner's widths are
    counted, and the text equals plain decoding."""
    from polykv.spec import Speculator

    model, tok = tiny
    pool = make_pool(model, tok)
    doc = pool.add_document(DOC)
    prompts = [pool.prompt_ids(doc, q) for q in ("Ships:", "The keeper", "whalers in 1911", "cape")]
    planners, per_agent = [], []
    propose = Speculator.propose
    monkeypatch.setattr(Speculator, "propose", lambda self, *a, **k: (per_agent.append(a), propose(self, *a, **k))[1])
    choose = Speculator.propose_all

    def spy(self, limits, agents=None):
        planners.append(self)
        return choose(self, limits, agents)

    monkeypatch.setattr(Speculator, "propose_all", spy)
    with row_invariant(model), Engine(pool) as eng:
        plain = _run(eng, doc, prompts, None, max_tokens=24, temperature=0)
        spec = _run(eng, doc, prompts, SpecConfig(method="suffix_tree", num_draft_tokens=3, cost_per_draft=0.0),
                    max_tokens=24, temperature=0)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    assert planners and not per_agent
    assert sum(planners[-1].widths.values()) > 0 and sum(u["speculative"]["drafted"] for _, _, u in spec) > 0


def test_engine_plain_stretches_pipeline_a_speculating_batch(tiny, monkeypatch):
    """When the width planner turns plain (every draft rejected here) a speculating engine batch
    decodes pipelined (`AgentBatch.step_tokens_ahead`) while the planner approves plain steps, as
    `SharedKVPool.generate` does, and drafts again when it stops approving them: the same text as
    without speculation, the stretch steps counted (`pipelined_steps`) and timed as T(0)."""
    from polykv.pool.agents import AgentBatch
    from polykv.spec import Speculator

    model, tok = tiny
    pool = make_pool(model, tok)
    doc = pool.add_document(DOC)
    prompts = [pool.prompt_ids(doc, q) for q in ("Ships:", "The keeper", "whalers in 1911", "cape")]
    add = Speculator.add

    def add_wrong(self, key, prompt_ids, config):
        add(self, key, prompt_ids, config)
        self._agents[key].drafter = type("D", (), {"propose": lambda self, ctx, k: [0] * k})()

    monkeypatch.setattr(Speculator, "add", add_wrong)
    launches, observed = [], []
    ahead = AgentBatch.step_tokens_ahead
    monkeypatch.setattr(AgentBatch, "step_tokens_ahead", lambda self: (launches.append(1), ahead(self))[1])
    observe = Speculator.observe_step
    monkeypatch.setattr(Speculator, "observe_step",
                        lambda self, w, s, agents=None: (observed.append(w), observe(self, w, s, agents)))
    spec = SpecConfig(method="prompt_lookup", num_draft_tokens=3, cost_per_draft=0.3)
    with row_invariant(model), Engine(pool) as eng:
        plain = _run(eng, doc, prompts, None, max_tokens=40, temperature=0, ignore_eos=True)
        launches.clear()
        got = _run(eng, doc, prompts, spec, max_tokens=40, temperature=0, ignore_eos=True)
    assert [t for t, _, _ in got] == [t for t, _, _ in plain]
    assert len(launches) >= 10  # most of the 40 steps ran in stretches
    assert 0 in observed and any(w > 0 for w in observed)  # stretch periods and verify steps timed
    drafted = [u["speculative"]["drafted"] for _, _, u in got]
    assert all(d > 0 for d in drafted) and max(drafted) < 40  # the probes drafted, the stretches did not
