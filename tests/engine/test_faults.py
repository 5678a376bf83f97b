"""A request's failure stays its own: a failing step fails only the agent whose input caused it,
a loop failure does not stop the engine, and admission respects the pool's KV budget."""

import time

import pytest

from polykv.engine import DenseBatch, Engine, GenerationRequest, SamplingParams
from polykv.errors import BudgetExceededError

from ._faults import POISON, FaultyBatch, FaultyPool, InjectedFault
from ._models import make_pool, tiny_model

DOC = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_model()
    pool = make_pool(model, tok)
    doc = pool.add_document(DOC, name="fox")
    return model, tok, pool, doc


def _params(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _prompts(tok, n):
    return [tok(f"Question {i}: where is the fox?", add_special_tokens=False)["input_ids"] for i in range(n)]


def _engine(pool, model, faulty: bool):
    if faulty:
        return Engine(FaultyPool(pool), model=model, tok=pool.tok,
                      plain_batch_factory=lambda: FaultyBatch(DenseBatch(model)))
    return Engine(pool)


def _reference(setup, document, prompts, n):
    model, tok, pool, doc = setup
    with Engine(pool) as eng:
        return [eng.submit(GenerationRequest(p, _params(n), document=document)).result_sync(120)[0]
                for p in prompts]


@pytest.mark.parametrize("use_doc", [True, False], ids=["document", "plain"])
def test_failing_request_among_good_ones(setup, use_doc):
    """Two good agents decode; a poisoned request joins with two more good ones (its prompt fails the
    step in which it is prefilled, after the step did its work): only it fails, every good one
    completes with the answer it gives without the poisoned neighbour."""
    model, tok, pool, doc = setup
    document = doc if use_doc else None
    prompts = _prompts(tok, 4)
    n = 8
    ref = _reference(setup, document, prompts, n)
    with _engine(pool, model, faulty=True) as eng:
        early = [eng.submit(GenerationRequest(p, _params(n), document=document)) for p in prompts[:2]]
        head = [next(h.iter_sync(timeout=60)).text for h in early]  # both decoding before the poison
        eng.call(time.sleep, 0.2)  # hold the loop so the next three join in one step
        bad = eng.submit(GenerationRequest(prompts[2][:3] + [POISON], _params(n), document=document))
        late = [eng.submit(GenerationRequest(p, _params(n), document=document)) for p in prompts[2:]]
        with pytest.raises(InjectedFault):
            bad.result_sync(timeout=60)
        got = [t + "".join(e.text for e in h.iter_sync(timeout=60) if e.kind == "token") for t, h in zip(head, early)]
        got += [h.result_sync(timeout=60)[0] for h in late]
        assert eng.step_failures >= 1 and eng.running
        assert eng.live_agents() == 0 and eng.users_of(doc) == 0
    assert got == ref


@pytest.mark.parametrize("use_doc", [True, False], ids=["document", "plain"])
def test_transient_step_failure_fails_nobody(setup, use_doc):
    model, tok, pool, doc = setup
    document = doc if use_doc else None
    prompts = _prompts(tok, 3)
    fpool = FaultyPool(pool, fail_steps=1)
    plain = [FaultyBatch(DenseBatch(model), fail_steps=1)]
    eng = Engine(fpool, model=model, tok=tok, plain_batch_factory=lambda: plain.pop() if plain else DenseBatch(model))
    with eng:
        eng.call(time.sleep, 0.2)
        hs = [eng.submit(GenerationRequest(p, _params(5), document=document)) for p in prompts]
        res = [h.result_sync(timeout=60) for h in hs]
        assert eng.step_failures == 1
    assert [r[2]["completion_tokens"] for r in res] == [5, 5, 5]
    assert [r[0] for r in res] == _reference(setup, document, prompts, 5)


def test_loop_failure_restarts_the_loop(setup, monkeypatch):
    """An exception outside the step (here: in the cancellation sweep) fails the running request;
    the supervisor restarts the loop and later requests are served."""
    model, tok, pool, doc = setup
    p = _prompts(tok, 1)[0]
    with Engine(pool) as eng:
        running = eng.submit(GenerationRequest(p, _params(400), document=doc))
        next(running.iter_sync(timeout=60))
        real = eng._reap_cancelled
        calls = []

        def broken():
            if not calls:
                calls.append(1)
                raise RuntimeError("bug in the loop")
            real()

        monkeypatch.setattr(eng, "_reap_cancelled", broken)
        evs = list(running.iter_sync(timeout=60))
        assert evs[-1].kind == "error" and "bug in the loop" in str(evs[-1].error)
        assert eng.running and eng.restarts == 1
        after = eng.submit(GenerationRequest(p, _params(3), document=doc)).result_sync(timeout=60)
        assert after[2]["completion_tokens"] == 3
        assert eng.users_of(doc) == 0


def test_admission_counts_agent_storage(setup):
    """budget_bytes covers documents + agent storage up to what each admitted agent may hold
    (prompt + max_tokens): with room for the document and one such agent, a second request is
    refused (BudgetExceededError) while the first runs, and admitted again after it finished."""
    model, tok, _, _ = setup
    pool = make_pool(model, tok)
    doc = pool.add_document(DOC)
    shared = pool.memory_report()["kv_bytes_shared"]
    p = _prompts(tok, 1)[0]
    with pool.open_batch(doc) as b:  # one agent's first allocation; the closed batch is parked
        b.add(p)
        b.step()
    with pool.open_batch(doc) as b:  # ... and taken over by the engine's
        held, one, two = b.nbytes(), b.growth_bytes([len(p) + 300]), b.growth_bytes([len(p) + 300] * 2)
    assert two > one
    pool.budget_bytes = shared + held + one
    with Engine(pool) as eng:
        first = eng.submit(GenerationRequest(p, _params(300), document=doc))
        next(first.iter_sync(timeout=60))
        with pytest.raises(BudgetExceededError) as e:
            eng.submit(GenerationRequest(p, _params(300), document=doc)).result_sync(timeout=60)
        assert e.value.used > e.value.budget == pool.budget_bytes
        first.cancel()
        assert list(first.iter_sync(timeout=60))[-1].finish_reason == "cancelled"
        again = eng.submit(GenerationRequest(p, _params(2), document=doc)).result_sync(timeout=60)
        assert again[2]["completion_tokens"] == 2
