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



def test_prompts_joining_a_stretch_leave_the_decoders_in_slots_0_to_n(setup, static_steps, monkeypatch):
    """Continuous batching with stretches: a prompt that joins while a stretch's step is in flight
    waits for that step's read, so an agent leaving on it cannot move the joiner's slot into its
    own — every decode and verify forward is slots 0..n-1, the static step (a CUDA graph's replay;
    any other slot set runs eagerly, several times slower on the GPU), and the answers stay
    plain's. An answer ends at a length set by its first token (as a model's eos would, at different
    steps for different agents; the same rule on both sides)."""
    from polykv.pool import SharedKVPool
    from polykv.pool.agents import AgentBatch

    model, pool, doc = setup
    forward, took = AgentBatch._forward_once, SharedKVPool._took
    groups = []  # per decode / verify forward: whether its agents held slots 0..n-1

    def spy(self, group, keep):
        if keep or max(len(a.pending) for a in group) == 1:
            groups.append(sorted(a.slot for a in group) == list(range(len(group))))
        return forward(self, group, keep)

    def ends(self, out, t, *rules):
        return took(self, out, t, *rules) or len(out) >= 4 + out[0] % 16

    monkeypatch.setattr(AgentBatch, "_forward_once", spy)
    monkeypatch.setattr(SharedKVPool, "_took", ends)
    # a stop string that never occurs: every token goes through `_took` on both sides. No one-token
    # prompt: its prefill is a one-token forward, grouped with the decoders, and alone beside other
    # joiners' prefills it may hold any slot (an eager step)
    kw = dict(max_new_tokens=30, max_batch=5, stop=["\x00"])
    prompts = [p for p in PROMPTS if len(p) > 1] * 3
    with row_invariant(model):
        pool.generate(doc, prompts, **kw)
        plain = pool.last_generate["answer_ids"]
        groups.clear()
        pool.generate(doc, prompts, speculative=COSTLY, **kw)
    lg = pool.last_generate
    assert lg["answer_ids"] == plain and lg["speculative"]["pipelined_steps"] > 0
    assert len({len(a) for a in plain}) >= 3  # the agents leave at different steps
    assert groups and all(groups), f"{groups.count(False)} of {len(groups)} forwards not in slots 0..n-1"


def test_prompts_joining_verifying_agents_take_one_forward(setup, static_steps, monkeypatch):
    """Continuous batching with drafts every step (fixed length): a step where prompts join agents
    that verify drafts runs one captured mixed step (`DecodeGraphs.run_mixed`: the prompts' prefill
    and the verification together) instead of the prefill step and then the verify step — the same
    answers as plain decoding, greedy and sampled (joins where no agent has drafts take the prefill
    step alone, as before)."""
    from polykv.pool import decode_graph

    DecodeGraphs = decode_graph.DecodeGraphs.func  # static_steps made it a partial (capture=False)
    model, pool, doc = setup
    calls = {"mixed": 0}
    mixed = DecodeGraphs.run_mixed
    monkeypatch.setattr(DecodeGraphs, "run_mixed",
                        lambda self, *a, **kw: (calls.__setitem__("mixed", calls["mixed"] + 1), mixed(self, *a, **kw))[1])
    fixed = {"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": False, "min_ngram": 1}
    prompts = [p for p in PROMPTS if len(p) > 1] * 2
    for kw in (dict(), dict(temperature=0.9, top_p=0.95, seed=7)):
        kw.update(max_new_tokens=12, max_batch=4)
        with row_invariant(model):
            pool.generate(doc, prompts, **kw)
            plain = pool.last_generate["answer_ids"]
            calls.update(mixed=0)
            pool.generate(doc, prompts, speculative=fixed, **kw)
        assert pool.last_generate["answer_ids"] == plain
        assert calls["mixed"] >= 3  # joins beside verifying agents: one forward each
