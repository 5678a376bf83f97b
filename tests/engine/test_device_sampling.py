"""The engine's device path: every request, greedy or sampled, chooses its token where the logits
are (AgentBatch.set_sampling + step_tokens), one device-to-host copy of the ids per step, with each
request's draws independent of what runs beside it."""

import pytest

from polykv.engine import Engine, GenerationRequest, SamplingParams

from ._models import shared_pool


@pytest.fixture(scope="module")
def setup():
    model, tok, pool = shared_pool()
    doc = pool.add_document("The quick brown fox jumps over the lazy dog. " * 8, name="fox-sampling")
    return model, tok, pool, doc


def _run(batch, agents: dict, steps: int) -> dict:
    """Step `batch` `steps` times feeding back every chosen token; {aid: tokens}."""
    out = {aid: [] for aid in agents}
    for _ in range(steps):
        chosen = batch.step_tokens()
        for aid, t in chosen.items():
            out[aid].append(t)
        batch.feed(chosen)
    return out


def test_seeded_agent_same_alone_and_in_any_batch(setup):
    """Agent X (seeded, sampling) draws the same tokens alone as in a batch with greedy and other
    sampling agents, in another slot, with a neighbour removed mid-way (X's slot moves)."""
    _, tok, pool, doc = setup
    x = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    xp = dict(temperature=1.0, top_p=0.9, top_k=50, seed=42)
    with pool.open_batch(doc) as b:
        aid = b.add(x)
        b.set_sampling(aid, **xp)
        alone = _run(b, {aid: 0}, 8)[aid]
    assert len(set(alone)) > 1
    with pool.open_batch(doc) as b:
        g = b.add(tok("Greedy one", add_special_tokens=False)["input_ids"])
        b.set_sampling(g, 0.0)
        o = b.add(tok("Another, longer prompt here", add_special_tokens=False)["input_ids"])
        b.set_sampling(o, 1.5, 1.0, 0, seed=7)
        legacy = b.add([5, 6, 7])  # no set_sampling: the call's arguments (greedy)
        aid = b.add(x)
        b.set_sampling(aid, **xp)
        got = _run(b, {g: 0, o: 0, legacy: 0, aid: 0}, 3)
        b.remove(g)  # the last slot (X) moves into slot 0
        more = _run(b, {o: 0, legacy: 0, aid: 0}, 5)
    assert got[aid] + more[aid] == alone
    with pool.open_batch(doc) as b:  # a different seed draws differently
        aid = b.add(x)
        b.set_sampling(aid, **dict(xp, seed=43))
        assert _run(b, {aid: 0}, 8)[aid] != alone


def test_greedy_agents_equal_argmax_of_step(setup):
    """Own greedy rows are the argmax of step()'s logits (bit-identical to the greedy path)."""
    _, tok, pool, doc = setup
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("A", "B c d", "What jumps")]
    with pool.open_batch(doc) as b1, pool.open_batch(doc) as b2:
        a1 = [b1.add(p) for p in prompts]
        a2 = [b2.add(p) for p in prompts]
        for a in a2:
            b2.set_sampling(a, 0.0, 1.0, 0, seed=a)
        for _ in range(4):
            want = {a: int(lg.argmax()) for a, lg in b1.step().items()}
            got = b2.step_tokens()
            assert [got[a] for a in a2] == [want[a] for a in a1]
            b1.feed(want)
            b2.feed(got)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_engine_mixed_batch_one_host_copy_per_step(setup, monkeypatch, pipelined):
    """A document batch of greedy and sampling requests (joining at different steps, so prefill and
    decode forwards share a step) makes exactly one device-to-host copy of ids per step and never
    copies logits (step() is not called); a seeded request's answer does not depend on its
    neighbours, and the greedy one equals its answer alone. Pipelined: every step is a
    step_tokens_ahead whose ids are read once (PendingTokens.result), none through step_tokens."""
    from polykv.pool import agents

    _, tok, pool, doc = setup
    copies, steps, reads = [], [], []
    orig_copy = agents._to_host
    stepper = "step_tokens_ahead" if pipelined else "step_tokens"
    orig_tokens, orig_result = getattr(agents.AgentBatch, stepper), agents.PendingTokens.result

    def copy(ids):
        copies.append(ids.numel())
        return orig_copy(ids)

    def step_tokens(self, *a, **k):
        steps.append(len(self))
        return orig_tokens(self, *a, **k)

    def result(self):
        if self._out is None:
            reads.append(len(self.agents))
        return orig_result(self)

    def no_step(self):
        raise AssertionError("AgentBatch.step() copies logits to the host")

    monkeypatch.setattr(agents, "_to_host", copy)
    monkeypatch.setattr(agents.AgentBatch, stepper, step_tokens)
    monkeypatch.setattr(agents.PendingTokens, "result", result)
    monkeypatch.setattr(agents.AgentBatch, "step", no_step)
    p = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    q = tok("What jumps", add_special_tokens=False)["input_ids"]
    seeded = dict(max_tokens=6, temperature=0.9, top_p=0.95, top_k=40, seed=11, ignore_eos=True)
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(pool, max_prefill_per_step=1, pipelined=pipelined) as eng:
        alone_s = eng.submit(GenerationRequest(p, SamplingParams(**seeded), document=doc)).result_sync(60)[0]
        alone_g = eng.submit(GenerationRequest(q, SamplingParams(**greedy), document=doc)).result_sync(60)[0]
        n_alone = len(steps)
        hs = [eng.submit(GenerationRequest(q, SamplingParams(**greedy), document=doc)),
              eng.submit(GenerationRequest(q, SamplingParams(max_tokens=5, temperature=1.3, ignore_eos=True),
                                           document=doc)),
              eng.submit(GenerationRequest(p, SamplingParams(**seeded), document=doc)),
              eng.submit(GenerationRequest(p, SamplingParams(**dict(seeded, seed=12, top_k=0)), document=doc))]
        res = [h.result_sync(60)[0] for h in hs]
    assert res[0] == alone_g and res[2] == alone_s
    if pipelined:  # ends by max_tokens only: every launched step is read, once
        assert not copies and len(reads) == len(steps) and len(steps) >= 12
    else:
        assert len(copies) == len(steps) and len(steps) >= 12 and not reads
    assert max(steps[n_alone:]) >= 3  # requests did share batch steps
