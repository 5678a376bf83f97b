"""The engine's pipelined decode (`Engine(pipelined=True)`: `AgentBatch.step_tokens_ahead`, ids read
one step late) gives every request exactly the events of the synchronous loop (`pipelined=False`):
the same token events (text and ids, in order), finish reasons, usage and errors — for greedy and
seeded sampling, eos and stop strings at different steps, max_tokens, a cancel mid-run, newcomers
admitted mid-run, a failing agent isolated, several batches at once.

Runs are scripted on the engine thread (requests submitted in one loop iteration, mid-run actions
taken right after a request's n-th token), so admission does not depend on timing, and under
`row_invariant` (tests/spec), so a token does not depend on how many rows ran beside it: a pipelined
step holds, for one step, the rows of agents that end on the token read after its launch."""

from __future__ import annotations

import pytest

from polykv.engine import DenseBatch, Engine, GenerationRequest, SamplingParams
from polykv.pool.agents import AgentBatch
from polykv.spec.invariant import row_invariant

from ._faults import POISON, FaultyBatch, FaultyPool, InjectedFault
from ._models import shared_pool

DOC = "The quick brown fox jumps over the lazy dog. " * 8
DOC2 = "A completely different second document about tides and harbours. " * 4
QUESTIONS = ("Where is the fox?", "What jumps", "Tell me about the dog", "Once upon a time", "abc")


@pytest.fixture(scope="module")
def setup():
    model, tok, pool = shared_pool()
    return model, tok, pool, pool.add_document(DOC, name="fox-pipe"), pool.add_document(DOC2, name="tides-pipe")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _req(tok, i, document, **params):
    params = dict(dict(max_tokens=10, temperature=0, ignore_eos=True), **params)
    return GenerationRequest(_ids(tok, QUESTIONS[i % len(QUESTIONS)]), SamplingParams(**params), document=document)


def _ev(ev):
    return (ev.kind, ev.text, ev.token_id, ev.finish_reason, ev.usage, type(ev.error).__name__ if ev.error else None)


def _run(setup, pipelined: bool, requests, actions=(), eos=None, faulty=False, drawn=None, **engine_kw):
    """(events of every request in submission order, step failures): `requests` submitted in one
    loop iteration; `actions` = [(request index, n, fn)]: fn(engine, handles) runs on the engine
    thread right after that request's n-th token went through eos / stop / max_tokens
    (`Engine._advance`); `drawn` (a dict): filled with each request's token ids."""
    model, tok, pool, _, _ = setup
    if faulty:
        eng = Engine(FaultyPool(pool), model=model, tok=tok, pipelined=pipelined,
                     plain_batch_factory=lambda: FaultyBatch(DenseBatch(model)), **engine_kw)
    else:
        eng = Engine(pool, pipelined=pipelined, **engine_kw)
    if eos is not None:
        eng.eos_ids = frozenset(eos)
    handles, seen = [], {}
    advance = eng._advance

    def scripted(st, tok_id):
        going = advance(st, tok_id)
        i = next(j for j, h in enumerate(handles) if h is st.handle)
        seen[i] = seen.get(i, 0) + 1
        if drawn is not None:
            drawn.setdefault(i, []).append(tok_id)
        for j, n, fn in actions:
            if j == i and n == seen[i]:
                fn(eng, handles)
        return going

    eng._advance = scripted
    launches = []
    ahead = AgentBatch.step_tokens_ahead
    AgentBatch.step_tokens_ahead = lambda self: (launches.append(len(self)), ahead(self))[1]
    try:
        with row_invariant(model), eng:
            eng.call(lambda: handles.extend(eng.submit(r) for r in requests)).result(60)
            out, i = [], 0
            while i < len(handles):  # newcomers join the list before the request that admits them ends
                out.append([_ev(ev) for ev in handles[i].iter_sync(timeout=120)])
                i += 1
            assert eng.live_agents() == 0 and eng.call(lambda: dict(eng._batches)).result(60) == {}
            failures = eng.step_failures
    finally:
        AgentBatch.step_tokens_ahead = ahead
    assert bool(launches) == pipelined  # the loop under test did run (or not) one step ahead
    assert all(h._q.empty() for h in handles)  # engine joined: nothing came after a request's end
    return out, failures


def _same(setup, *args, **kw):
    """Both loops' events (asserted equal); returns them."""
    sync = _run(setup, False, *args, **kw)
    pipe = _run(setup, True, *args, **kw)
    assert pipe == sync
    return sync[0]


def _finish(events):
    return [(evs[-1][3], evs[-1][4]["completion_tokens"] if evs[-1][4] else None) for evs in events]


def test_greedy_and_seeded_over_several_batches(setup):
    """Greedy and seeded sampling requests over two documents and a plain (dense) batch, ending by
    max_tokens at different steps."""
    _, tok, _, doc, doc2 = setup
    seeded = dict(temperature=0.9, top_p=0.95, top_k=40)
    reqs = [_req(tok, 0, doc, max_tokens=7), _req(tok, 1, doc, max_tokens=12, seed=3, **seeded),
            _req(tok, 2, doc2, max_tokens=5, seed=4, temperature=1.2), _req(tok, 3, doc2, max_tokens=1),
            _req(tok, 4, None, max_tokens=6), _req(tok, 1, doc, max_tokens=9, seed=5, temperature=0.7, top_k=0)]
    events = _same(setup, reqs)
    assert _finish(events) == [("length", n) for n in (7, 12, 5, 1, 6, 9)]


def test_eos_at_different_steps(setup):
    """Ids of the free answers made eos: requests end with "stop" at different steps (the eos
    counted, not emitted), others by max_tokens; the agents ending on eos are one step late in the
    pipelined loop, and nothing of that step reaches them."""
    _, tok, _, doc, doc2 = setup
    reqs = [_req(tok, i, doc if i % 2 else doc2, max_tokens=12, temperature=1.0, seed=i) for i in range(5)]
    free: dict = {}  # (greedy answers of the tiny model repeat one id: seeded draws vary)
    _run(setup, False, reqs, drawn=free)
    # per request, from a target step on: the first id it has not drawn before
    eos = {next(t for j, t in enumerate(free[i]) if j >= at and t not in free[i][:j])
           for i, at in ((0, 2), (1, 5), (3, 8))}
    for r in reqs:
        r.params.ignore_eos = False
    events = _same(setup, reqs, eos=eos)
    stops = {n for reason, n in _finish(events) if reason == "stop"}
    assert len(stops) >= 2 and max(stops) > 1  # eos at different steps, not only the first


def test_stop_strings(setup):
    """Stop strings found at different places of the free answers: text cut before them, "stop"."""
    _, tok, _, doc, _ = setup
    reqs = [_req(tok, i, doc, max_tokens=14, temperature=1.0, seed=10 + i) for i in range(4)]
    free = ["".join(e[1] for e in evs if e[0] == "token") for evs in _run(setup, False, reqs)[0]]
    cuts = (3, 8, 15)
    for r, text, k in zip(reqs, free, cuts):
        r.params.stop = [text[k: k + 3]]
    events = _same(setup, reqs)
    got = ["".join(e[1] for e in evs if e[0] == "token") for evs in events]
    for text, k, g, (reason, _) in zip(free, cuts, got, _finish(events)):
        assert reason == "stop" and g == text[: text.find(text[k: k + 3])]
    assert _finish(events)[3][0] == "length"


def test_cancel_mid_run(setup):
    """A request cancelled right after its 3rd token ends "cancelled" with 3 tokens; its token of the
    step in flight is never emitted; its neighbours go on."""
    _, tok, _, doc, _ = setup
    reqs = [_req(tok, i, doc, max_tokens=10) for i in range(3)]
    events = _same(setup, reqs, actions=[(1, 3, lambda eng, hs: hs[1].cancel())])
    assert _finish(events) == [("length", 10), ("cancelled", 3), ("length", 10)]


def test_newcomers_admitted_mid_run(setup):
    """Requests submitted after a running one's 2nd and 5th tokens join its batch (their prompt
    prefill rides in the next launched step) or open another one."""
    _, tok, _, doc, doc2 = setup
    reqs = [_req(tok, 0, doc, max_tokens=10), _req(tok, 1, doc2, max_tokens=4)]
    late = [_req(tok, 2, doc, max_tokens=6), _req(tok, 3, doc, max_tokens=5, seed=9, temperature=1.0),
            _req(tok, 4, doc2, max_tokens=3), _req(tok, 0, None, max_tokens=4)]

    def join(*rs):
        return lambda eng, hs: hs.extend(eng.submit(r) for r in rs)

    events = _same(setup, reqs, actions=[(0, 2, join(*late[:2])), (0, 5, join(*late[2:]))])
    assert _finish(events) == [("length", n) for n in (10, 4, 6, 5, 3, 4)]


def test_failing_agent_isolated(setup):
    """A request whose prompt fails the step that prefills it (after the step did its work) joins mid
    run with a good one: only it fails; the batch's agents are re-added with their history, stepped
    alone, and go on (pipelined: the step in flight is dropped unread and recomputed)."""
    _, tok, _, doc, _ = setup
    reqs = [_req(tok, i, doc, max_tokens=8) for i in range(2)]
    bad = GenerationRequest(_ids(tok, "Where")[:3] + [POISON], SamplingParams(max_tokens=8, ignore_eos=True),
                            document=doc)

    def join(eng, hs):
        hs.extend(eng.submit(r) for r in (bad, _req(tok, 2, doc, max_tokens=6)))

    sync = _run(setup, False, reqs, [(0, 3, join)], faulty=True)
    assert _run(setup, True, reqs, [(0, 3, join)], faulty=True) == sync
    events, failures = sync
    assert failures == 1
    assert [evs[-1][0] for evs in events] == ["done", "done", "error", "done"]
    assert events[2][-1][5] == InjectedFault.__name__
    assert _finish([events[i] for i in (0, 1, 3)]) == [("length", 8), ("length", 8), ("length", 6)]


def test_speculating_newcomer_turns_the_batch_synchronous(setup):
    """A speculative request joining a pipelined batch: the step in flight is read first (its ids
    become the agents' pending tokens), then the batch steps synchronously (`step_verify`). Draft
    counts depend on measured step times: usage["speculative"] is left out of the comparison."""
    from polykv.spec import SpecConfig

    _, tok, _, doc, _ = setup
    reqs = [_req(tok, 0, doc, max_tokens=12), _req(tok, 1, doc, max_tokens=10, seed=2, temperature=1.0)]
    spec = _req(tok, 2, doc, max_tokens=8)
    spec.speculative = SpecConfig(method="prompt_lookup", num_draft_tokens=3, adaptive=False)

    def join(eng, hs):
        hs.append(eng.submit(spec))

    def plain(run):
        events, failures = run
        return [[e[:4] + ({k: v for k, v in e[4].items() if k != "speculative"} if e[4] else None,) + e[5:]
                 for e in evs] for evs in events], failures

    sync = plain(_run(setup, False, reqs, [(0, 3, join)]))
    assert plain(_run(setup, True, reqs, [(0, 3, join)])) == sync
    assert _finish(sync[0]) == [("length", 12), ("length", 10), ("length", 8)]
