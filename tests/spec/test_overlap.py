"""The overlapped speculative loop (2026-12-02, issue I): a verify step launched
(`AgentBatch.launch_verify`), the outputs tree's logged tokens added while it runs
(`Speculator.ahead`), its ids read after (`PendingVerify.result`); the tree read one step late
(`SuffixTree.propose(flush=False)`). Greedy stays token-identical to plain decoding (under
`row_invariant`), seeded sampling keeps its draws, prompt lookup drafts exactly as the synchronous
loop, suffix-tree drafts are those of a tree fed one step behind."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polykv.pool import agents
from polykv.spec import NgramIndex, PromptLookup, SpecConfig, Speculator, SuffixTree
from polykv.spec.adaptive import StepTimes
from polykv.spec.invariant import row_invariant
from tests.spec.helpers import PROMPTS



def _run(pool, doc, overlap: bool, **kw):
    saved = pool.spec_overlap
    pool.spec_overlap = overlap
    try:
        pool.generate(doc, PROMPTS, **kw)
    finally:
        pool.spec_overlap = saved
    return pool.last_generate


def test_launch_result_halves_and_the_batch_refused_between(setup, static_steps):
    """launch_verify runs the step (the lengths hold every draft row) and result() does the host
    half once (rollback to the kept rows; a second call returns the same dict, cutting nothing);
    between them feed / remove / another step are refused."""
    model, pool, doc = setup
    with row_invariant(model), pool.open_batch(doc, capacity=4) as b:
        aids = [b.add(s) for s in ([5, 6, 7], [8], [9, 10])]
        first = b.step_tokens()
        b.feed({a: first[a] for a in aids}, {aids[0]: [40, 41, 42], aids[2]: [43]})
        before = [b.suffix_length(a) for a in aids]
        pending = b.launch_verify()
        assert [int(b.cache.lens[i]) for i in range(3)] == [before[0] + 4, before[1] + 1, before[2] + 2]
        assert pending.ready()  # CPU: the copy is made at launch
        for call in (lambda: b.feed({aids[1]: 3}), lambda: b.feed_drafts({aids[1]: [3]}),
                     lambda: b.remove(aids[1]), b.step_tokens, b.step_verify, b.launch_verify):
            with pytest.raises(RuntimeError, match="in flight"):
                call()
        out = pending.result()
        lens = [b.suffix_length(a) for a in aids]
        assert lens == [before[i] + len(out[a]) for i, a in enumerate(aids)]  # rejected rows cut
        assert pending.result() is out and [b.suffix_length(a) for a in aids] == lens
        b.feed({a: out[a][-1] for a in aids})  # the batch takes work again
        b.step_tokens()


@pytest.mark.parametrize("method", ["prompt_lookup", "suffix_tree"])
def test_overlapped_loop_is_token_identical_and_ahead_runs_inside_the_step(setup, static_steps, method, monkeypatch):
    """generate with the overlapped loop: greedy == plain == the synchronous loop, and every verify
    step's `ahead` runs after its launch and before its ids are read (the host work the device's
    step hides on the GPU). Prompt lookup reads no tree: the same steps, drafts and acceptance in
    both loops."""
    model, pool, doc = setup
    calls = []
    for klass, name in ((agents.AgentBatch, "launch_verify"), (agents.PendingVerify, "result"),
                        (Speculator, "ahead")):
        fn = getattr(klass, name)

        def wrap(*a, _fn=fn, _name=name, **kw):
            calls.append(_name)
            return _fn(*a, **kw)

        monkeypatch.setattr(klass, name, wrap)
    spec = {"method": method, "num_draft_tokens": 4, "adaptive": False}
    with row_invariant(model):
        plain = _run(pool, doc, True, max_new_tokens=30)["answer_ids"]
        calls.clear()
        over = _run(pool, doc, True, max_new_tokens=30, speculative=spec)
        order = list(calls)
        sync = _run(pool, doc, False, max_new_tokens=30, speculative=spec)
    assert over["answer_ids"] == plain and sync["answer_ids"] == plain
    assert order[:3] == ["launch_verify", "ahead", "result"] and order == order[:3] * (len(order) // 3)
    assert len(order) // 3 == over["steps"]
    assert "ahead" not in calls[len(order):]  # the synchronous loop never calls it
    assert over["speculative"]["accepted"] > 0
    if method == "prompt_lookup":
        keys = ("steps", "drafted", "accepted", "tokens", "agent_steps", "full_accepts")
        assert {k: over["speculative"][k] for k in keys} == {k: sync["speculative"][k] for k in keys}
        assert over["steps"] == sync["steps"]


def test_overlapped_loop_keeps_seeded_sampling_and_stops(setup, static_steps):
    """Seeded sampling (the counter-based draws, the sampled verify path) and stop strings through
    the overlapped loop: the same tokens as plain decoding."""
    model, pool, doc = setup
    kw = dict(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=11)
    spec = {"method": "suffix_tree", "num_draft_tokens": 3, "adaptive": False}
    with row_invariant(model):
        plain = _run(pool, doc, True, **kw)["answer_ids"]
        got = _run(pool, doc, True, speculative=spec, **kw)
        assert got["answer_ids"] == plain and got["speculative"]["accepted"] > 0
        plain = _run(pool, doc, True, max_new_tokens=25, stop=["x", "q"])["answer_ids"]
        assert _run(pool, doc, True, max_new_tokens=25, stop=["x", "q"], speculative=spec)["answer_ids"] == plain


def _ref_drafts(tree: SuffixTree, lookup: PromptLookup, ctx: list[int], k: int) -> list[int]:
    d = tree.propose(ctx, k)  # flushes what it was given, walks every tail from the root
    return d if d else lookup.propose(ctx, k)[:k]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 6), k=st.integers(1, 4), agents=st.integers(1, 5),
       max_nodes=st.sampled_from([25, 80, 500_000]))
def test_lagged_tree_drafts_equal_a_tree_one_step_behind(data, vocab, k, agents, max_nodes):
    """Speculator(overlap=True), driven as the loop drives it (ahead, record, propose_all), drafts
    what the suffix tree (then prompt lookup) drafts over the same contexts from a tree fed every
    agent's outputs one step late and read by walks from the root: a step's drafts see the outputs
    of the steps before it, not its own, and the tails read from an agent's handle (which lacks
    its last step) followed by that step's tokens are the walked ones — max_nodes clears (stale
    handles) included. Agents leave now and then."""
    doc = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    index = NgramIndex(doc)
    tree = SuffixTree(max_depth=10, max_match=5, max_nodes=max_nodes)
    ref = SuffixTree(max_depth=10, max_match=5, max_nodes=max_nodes)
    ref.fit(k)  # the depth the speculator fits its tree to (the clears count the same nodes)
    spec = Speculator(index, tree, times=StepTimes(), overlap=True)
    cfg = SpecConfig(method="suffix_tree", num_draft_tokens=k, adaptive=False)
    ctx, handles, lookups, log = {}, {}, {}, []
    for i in range(agents):
        p = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        spec.add(i, p, cfg)
        ctx[i], handles[i], lookups[i] = list(p), ref.start(), PromptLookup(index)
    for step in range(data.draw(st.integers(1, 8))):
        spec.ahead()  # (the step is in flight): the tree adds what the earlier steps logged
        for h, e in log:  # the reference gets the earlier steps' outputs now, in their order
            ref.extend_all(h, e)
        log = []
        for i in ctx:
            e = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=k + 1))
            spec.record(i, e, min(len(e) - 1, k))
            ctx[i] += e
            log.append((handles[i], e))
        got = spec.propose_all({i: k for i in ctx})
        for i in ctx:
            assert got[i] == _ref_drafts(ref, lookups[i], ctx[i], k), (step, i)
        if len(ctx) > 1 and data.draw(st.booleans()):
            gone = data.draw(st.sampled_from(sorted(ctx)))
            spec.remove(gone)  # its outputs stay logged, as in the tree
            del ctx[gone], lookups[gone]


def test_ahead_adds_nothing_for_prompt_lookup_agents():
    """A prompt-lookup speculator's ahead leaves the tree's log alone (nothing reads it: the adds
    stay lazy), a suffix-tree one's adds it; the count follows agents leaving."""
    tree = SuffixTree()
    spec = Speculator(NgramIndex([1, 2, 3, 4]), tree, overlap=True)
    spec.add("a", [1, 2], SpecConfig(method="prompt_lookup"))
    spec.record("a", [3, 4], 1)
    spec.ahead()
    assert tree._pending_tokens == 2
    spec.add("b", [2, 3], SpecConfig(method="suffix_tree"))
    spec.ahead()
    assert tree._pending_tokens == 0 and len(tree._count) > 1
    spec.remove("b")
    spec.record("a", [5], 0)
    spec.ahead()
    assert tree._pending_tokens == 1


def test_copy_to_host_copies_on_the_cpu():
    """The CPU 'copy' of launch_verify's ids is a real copy: the static step rewrites its outputs."""
    t = torch.arange(6).reshape(2, 3)
    (h,), event = agents._copy_to_host([t])
    t += 10
    assert event is None and h.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_full_accepts_counted():
    spec = Speculator(NgramIndex([1, 2, 3]), None)
    spec.add(0, [1], SpecConfig(method="prompt_lookup", adaptive=False))
    spec.record(0, [2, 3, 4], 2)  # both drafts accepted
    spec.record(0, [5, 6], 2)  # one of two
    spec.record(0, [7], 0)  # no drafts: not a verify step of this agent
    s = spec.stats()
    assert (s["full_accepts"], s["agent_steps"], s["accepted"]) == (1, 2, 3)
