"""`SharedKVPool.generate(max_batch=)`: continuous batching — at most max_batch agents decode at
once, waiting prompts join as agents finish, and every prompt's answer is the one it gets with all
prompts in one batch (plain, pipelined, speculative, seeded sampling; on the eager path and on the
static steps a CUDA graph replays)."""

from __future__ import annotations

import pytest

from polykv.pool.agents import AgentBatch
from polykv.spec.invariant import row_invariant
from tests.spec.helpers import PROMPTS


@pytest.fixture
def widths(monkeypatch):
    """The batch's agent count at every `add` (what max_batch bounds)."""
    seen: list[int] = []
    add = AgentBatch.add

    def counted(self, prompt_ids):
        aid = add(self, prompt_ids)
        seen.append(len(self))
        return aid

    monkeypatch.setattr(AgentBatch, "add", counted)
    return seen


def _answers(pool, doc, **kw):
    texts = pool.generate(doc, PROMPTS, **kw)
    return texts, pool.last_generate["answer_ids"]


CASES = {
    "sync": dict(pipelined=False),
    "pipelined": dict(pipelined=True),
    "speculative": dict(speculative={"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": False}),
    "sampled": dict(temperature=0.9, top_p=0.95, seed=5, pipelined=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("steps", ["eager", "static"])
def test_answers_do_not_depend_on_max_batch(setup, widths, request, case, steps):
    if steps == "static":
        request.getfixturevalue("static_steps")
    model, pool, doc = setup
    # prompts of different lengths finish at different steps (stop strings, max_new_tokens)
    kw = dict(CASES[case], max_new_tokens=24, stop=["q"])
    with row_invariant(model):
        texts, ids = _answers(pool, doc, **kw)
        assert max(widths) == len(PROMPTS) and pool.last_generate["step_ms"]["joins"] == 0
        widths.clear()
        texts_2, ids_2 = _answers(pool, doc, max_batch=3, **kw)
    assert max(widths) == 3 and len(widths) == len(PROMPTS)  # every prompt joined, never more than 3 at once
    lg = pool.last_generate
    assert lg["max_batch"] == 3
    # the steps whose period held a joining prompt's prefill are counted apart from the decode steps
    ms = lg["step_ms"]
    assert 0 < ms["joins"] <= 2 * (len(PROMPTS) - 3) and ms["joins_ms"] > 0
    assert sum(ms["count_by_width"].values()) + ms["joins"] == lg["steps"] - 1
    assert ids_2 == ids and texts_2 == texts
    assert sum(map(len, ids)) > 0


def test_joining_prompts_fill_freed_slots(setup, widths):
    """With max_batch=1 the prompts run one after another in one batch: each joins when the one
    before it finished, and the answers are those of separate calls."""
    model, pool, doc = setup
    with row_invariant(model):
        alone = [pool.generate(doc, [p], max_new_tokens=10)[0] for p in PROMPTS[:3]]
        widths.clear()
        together = pool.generate(doc, PROMPTS[:3], max_new_tokens=10, max_batch=1)
    assert widths == [1, 1, 1]
    assert together == alone


def test_max_batch_checks_and_edges(setup):
    _, pool, doc = setup
    with pytest.raises(ValueError, match="max_batch"):
        pool.generate(doc, PROMPTS, max_batch=0)
    assert pool.generate(doc, PROMPTS[:3], max_new_tokens=0, max_batch=2) == ["", "", ""]
    assert pool.generate(doc, PROMPTS[:2], max_new_tokens=4, max_batch=8) == pool.generate(doc, PROMPTS[:2],
                                                                                           max_new_tokens=4)
