"""Plain stretches of the speculative loop run pipelined (`SharedKVPool._spec_plain_stretch`): while
the width planner has decided the coming steps plain before drafting (backed off, or measuring
T(0)), `generate` launches each step before it reads the one in flight, as plain decoding does —
the same answers as plain decoding and as the synchronous loop, on the eager path and on the static
steps a CUDA graph replays, with continuous batching and with sampling."""

from __future__ import annotations

import pytest

from polykv.spec.invariant import row_invariant
from polykv.spec.speculator import Speculator
from tests.spec.helpers import PROMPTS

# a draft column priced at 5 plain steps: verifying never pays, the planner backs off and only probes
COSTLY = {"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": True, "cost_per_draft": 5.0,
          "min_ngram": 1}
CASES = {
    "greedy": dict(),
    "greedy, continuous batching": dict(max_batch=3),
    "sampled": dict(temperature=0.9, top_p=0.95, seed=7),
    "stops": dict(stop=["q", "x"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("steps", ["eager", "static"])
def test_stretches_keep_every_answer(setup, request, case, steps):
    if steps == "static":
        request.getfixturevalue("static_steps")
    model, pool, doc = setup
    kw = dict(CASES[case], max_new_tokens=40)
    with row_invariant(model):
        plain = pool.generate(doc, PROMPTS, **kw), pool.last_generate["answer_ids"]
        pool.generate(doc, PROMPTS, speculative=COSTLY, pipelined=False, **kw)
        sync = pool.last_generate
        pool.generate(doc, PROMPTS, speculative=COSTLY, **kw)
        piped = pool.last_generate
    assert sync["answer_ids"] == plain[1] and piped["answer_ids"] == plain[1]
    assert sync["speculative"]["pipelined_steps"] == 0
    st = piped["speculative"]
    assert st["pipelined_steps"] > 0  # plain steps ran in stretches
    assert st["steps"] > 0  # the planner still probed with verify steps between them
    assert all(n <= 40 for n in piped["new_tokens"])


def test_stretches_feed_the_drafters(setup, monkeypatch):
    """Tokens read inside a stretch reach the speculator (`record`) as the synchronous loop's do:
    after the call, every agent's drafting context was its prompt + its whole answer."""
    model, pool, doc = setup
    contexts = {}
    remove = Speculator.remove

    def keep(self, key):
        st = self._agents.get(key)
        if st is not None:
            contexts[key] = list(st.context)
        remove(self, key)

    monkeypatch.setattr(Speculator, "remove", keep)
    with row_invariant(model):
        pool.generate(doc, PROMPTS, speculative=COSTLY, max_new_tokens=30)
    lg = pool.last_generate
    assert lg["speculative"]["pipelined_steps"] > 0
    got = sorted(contexts.values())
    want = sorted(list(s) + list(a) for s, a in zip(lg["suffix_ids"], lg["answer_ids"]))
    assert len(got) == len(PROMPTS) and got == want
