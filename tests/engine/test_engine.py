import asyncio
import threading
import time

import pytest
import torch

from polykv.engine import Engine, EngineClosedError, GenerationRequest, SamplingParams

from ._models import make_pool, tiny_model


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_model()
    pool = make_pool(model, tok)
    doc = pool.add_document("The quick brown fox jumps over the lazy dog. " * 8, name="fox")
    return model, tok, pool, doc


def _reference_greedy(model, prefix_ids, n):
    """Plain transformers greedy decode of n tokens after prefix_ids (no cache tricks)."""
    ids = list(prefix_ids)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            lg = model(input_ids=torch.tensor([ids])).logits[0, -1]
            t = int(lg.argmax())
            out.append(t)
            ids.append(t)
    return out


def test_plain_greedy_matches_reference(setup):
    model, tok, pool, _ = setup
    prompt = tok("Hello there, how are", add_special_tokens=False)["input_ids"]
    with Engine(pool) as eng:
        h = eng.submit(GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
        text, reason, usage = h.result_sync(timeout=60)
    ref = _reference_greedy(model, prompt, 8)
    assert reason == "length"
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}
    assert text == tok.decode(ref, skip_special_tokens=True)


def test_many_requests_join_and_leave(setup):
    model, tok, pool, doc = setup
    steps = []
    with Engine(pool, max_prefill_per_step=2, on_step=lambda dt, n: steps.append(n)) as eng:
        hs = []
        for i in range(10):
            p = tok(f"Question {i}:", add_special_tokens=False)["input_ids"]
            hs.append(eng.submit(GenerationRequest(
                p, SamplingParams(max_tokens=3 + i % 4, temperature=0.8, seed=i, ignore_eos=True),
                document=doc if i % 3 else None)))
            if i == 4:
                time.sleep(0.05)  # later ones join while earlier ones decode
        results = [h.result_sync(timeout=120) for h in hs]
        for i, (text, reason, usage) in enumerate(results):
            assert reason == "length"
            assert usage["completion_tokens"] == 3 + i % 4
        assert eng.live_agents() == 0 and eng.users_of(doc) == 0
        assert max(steps) > 1  # agents were batched together
        assert eng.call(lambda: dict(eng._batches)).result(10) == {}  # batches closed when empty


def test_seeded_sampling_independent_of_neighbours(setup):
    model, tok, pool, doc = setup
    p = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    params = dict(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    with Engine(pool) as eng:
        alone = eng.submit(GenerationRequest(p, SamplingParams(**params), document=doc)).result_sync(60)[0]
        hs = [eng.submit(GenerationRequest(p, SamplingParams(**dict(params, seed=s)), document=doc))
              for s in (1, 42, 3)]
        together = [h.result_sync(60)[0] for h in hs]
    assert together[1] == alone


def test_stop_string_and_eos(setup):
    model, tok, pool, doc = setup
    p = tok("abc", add_special_tokens=False)["input_ids"]
    with Engine(pool) as eng:
        full = eng.submit(GenerationRequest(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
        full_text = full.result_sync(60)[0]
        assert len(full_text) > 3
        stop = full_text[2:4]
        h = eng.submit(GenerationRequest(p, SamplingParams(max_tokens=10, temperature=0, stop=[stop],
                                                            ignore_eos=True)))
        text, reason, _ = h.result_sync(60)
    assert reason == "stop"
    assert text == full_text[: full_text.find(stop)]


def test_streaming_async_and_cancellation(setup):
    model, tok, pool, doc = setup
    p = tok("Stream me", add_special_tokens=False)["input_ids"]

    async def main(eng):
        loop = asyncio.get_running_loop()
        h = eng.submit(GenerationRequest(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                         document=doc), loop=loop)
        kinds = [ev.kind async for ev in h]
        assert kinds.count("token") >= 1 and kinds[-1] == "done"
        long = eng.submit(GenerationRequest(p, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
                                            document=doc), loop=loop)
        got = 0
        async for ev in long:
            if ev.kind == "token":
                got += 1
                if got == 2:
                    long.cancel()
            elif ev.kind == "done":
                assert ev.finish_reason == "cancelled"
                assert ev.usage["completion_tokens"] < 50
        assert eng.live_agents() == 0

    with Engine(pool) as eng:
        asyncio.run(main(eng))


def test_unknown_document_errors_only_that_request(setup):
    model, tok, pool, doc = setup
    p = tok("x y z", add_special_tokens=False)["input_ids"]
    with Engine(pool) as eng:
        bad = eng.submit(GenerationRequest(p, SamplingParams(max_tokens=2), document="no-such-doc"))
        good = eng.submit(GenerationRequest(p, SamplingParams(max_tokens=2, ignore_eos=True), document=doc))
        with pytest.raises(Exception):
            bad.result_sync(60)
        assert good.result_sync(60)[2]["completion_tokens"] == 2


def test_call_runs_on_engine_thread_and_shutdown_joins(setup):
    model, tok, pool, _ = setup
    before = set(threading.enumerate())
    eng = Engine(pool).start()
    name = eng.call(lambda: threading.current_thread().name).result(10)
    assert name == "polykv-engine"
    p = tok("never finishes", add_special_tokens=False)["input_ids"]
    h = eng.submit(GenerationRequest(p, SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True)))
    time.sleep(0.2)
    eng.shutdown()
    evs = list(h.iter_sync(timeout=10))
    assert evs[-1].kind == "error" and isinstance(evs[-1].error, EngineClosedError)
    assert set(threading.enumerate()) == before
    with pytest.raises(EngineClosedError):
        eng.submit(GenerationRequest(p, SamplingParams(max_tokens=1)))
    with pytest.raises(EngineClosedError):
        eng.call(lambda: 1).result(1)


def test_plain_after_document_agents_still_exact(setup):
    """Plain (dense) requests interleaved with document agents on the same model stay exact."""
    model, tok, pool, doc = setup
    prompt = tok("Plain after shared", add_special_tokens=False)["input_ids"]
    with Engine(pool) as eng:
        hs = [eng.submit(GenerationRequest(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                           document=doc if i else None)) for i in range(4)]
        plain = hs[0].result_sync(timeout=60)[0]
        for h in hs[1:]:
            h.result_sync(timeout=60)
    assert plain == tok.decode(_reference_greedy(model, prompt, 6), skip_special_tokens=True)


def test_two_documents_batched_separately(setup):
    model, tok, pool, doc = setup
    doc2 = pool.add_document("A completely different second document about tides and harbours. " * 4)
    p = tok("Tell me", add_special_tokens=False)["input_ids"]
    with Engine(pool) as eng:
        hs = [eng.submit(GenerationRequest(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                           document=d)) for d in (doc, doc2, doc, doc2)]
        time.sleep(0.05)
        by_doc = eng.agents_by_document()
        res = [h.result_sync(timeout=60)[0] for h in hs]
        assert eng.call(lambda: dict(eng._batches)).result(10) == {}
    assert res[0] == res[2] and res[1] == res[3]  # same doc + prompt + greedy: same answer
    assert set(by_doc) <= {doc, doc2}


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_document_batches_choose_tokens_on_the_device(setup, monkeypatch, pipelined):
    """A document batch steps with AgentBatch.step_tokens (pipelined: step_tokens_ahead; ids chosen
    where the logits are, no logits copied to the host), whether its requests decode greedily or
    sample; greedy answers equal pool.generate's."""
    from polykv.pool.agents import AgentBatch

    model, tok, pool, doc = setup
    stepper = "step_tokens_ahead" if pipelined else "step_tokens"
    calls = {"step": 0, "step_tokens": 0, "step_tokens_ahead": 0}
    for name in calls:
        orig = getattr(AgentBatch, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(AgentBatch, name, spy)
    prompt = tok("What jumps", add_special_tokens=False)["input_ids"]
    with Engine(pool, pipelined=pipelined) as eng:
        greedy = eng.submit(GenerationRequest(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                              document=doc)).result_sync(timeout=60)[0]
    assert calls[stepper] >= 6 and calls["step"] == 0 and sum(calls.values()) == calls[stepper]
    want = pool.generate(doc, [prompt], max_new_tokens=6, pipelined=False)[0]
    assert greedy.strip() == want
    calls.update(step=0, step_tokens=0, step_tokens_ahead=0)
    with Engine(pool, pipelined=pipelined) as eng:
        eng.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4, temperature=0.9, seed=1, ignore_eos=True),
                                     document=doc)).result_sync(timeout=60)
    assert calls[stepper] >= 4 and calls["step"] == 0 and sum(calls.values()) == calls[stepper]
