"""The batch-wide host paths of a verify step (2026-12-02, issue I) against what they replaced:
greedy ids of every column computed inside the (static) step, one copy; the step's rows /
positions / tokens as NumPy over [agents, columns]; rollbacks through a view of the host lengths;
`feed` with drafts in one call; the generate loop's whole-run append. Through `DecodeGraphs` with
capture=False (the GPU loop's host path, run eagerly on the CPU), speculative greedy and seeded
sampling stay token-identical to plain decoding."""

from __future__ import annotations

import random

import pytest
import torch

from polykv.generation import greedy_ids
from polykv.spec.invariant import row_invariant
from polykv.spec.verify import accept_greedy
from tests.spec.helpers import PROMPTS, greedy_plain_and_spec



@pytest.mark.parametrize("shape", [(1, 7), (5, 3), (4, 5, 33), (2, 1, 9)])
def test_greedy_ids_equal_torch_argmax(shape):
    """First maximum on ties, NaN as the maximum, -inf rows, non-contiguous views, other dtypes."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(-3, 3, shape, generator=g).float()  # many ties
    x.view(-1, shape[-1])[0, -1] = float("nan")
    x.view(-1, shape[-1])[-1, :] = float("-inf")
    for t in (x, x.transpose(0, -2) if x.dim() == 3 else x, x.to(torch.bfloat16), x.double()):
        assert torch.equal(greedy_ids(t), torch.argmax(t, dim=-1)), t.dtype
        assert greedy_ids(t).dtype == torch.int64


def test_rollback_cuts_several_slots_and_refuses_too_much(setup):
    _, pool, doc = setup
    with pool.open_batch(doc, capacity=4) as b:
        for p in ([5, 6, 7], [8], [9, 10], [11, 12, 13, 14]):
            b.add(p)
        b.step()
        lens = b.cache.lens
        assert lens[:4].tolist() == [3, 1, 2, 4]
        b.cache.rollback([3, 0], [2, 1])
        assert lens[:4].tolist() == [2, 1, 2, 2] and b.cache.lens is lens  # in place
        with pytest.raises(ValueError):
            b.cache.rollback([1, 2], [1, 3])
        with pytest.raises(ValueError):
            b.cache.rollback([2], [-1])
        assert lens[:4].tolist() == [2, 1, 2, 2]  # a refused rollback changes nothing


@pytest.mark.parametrize("static", [False, True])
def test_step_verify_emits_the_accepted_prefix_of_every_column(setup, static, request):
    """step_verify against accept_greedy over the argmax of each agent's own eager forward (pending
    token + drafts): mixed draft counts, agents without drafts, a first draft always rejected, and
    the lengths rolled back to the kept tokens."""
    if static:
        request.getfixturevalue("static_steps")
    model, pool, doc = setup
    rng = random.Random(5)
    sufs = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15, 16]]
    with row_invariant(model), pool.open_batch(doc, capacity=8) as b:
        aids = [b.add(s) for s in sufs]
        first = b.step_tokens()
        ctx = {a: list(s) for a, s in zip(aids, sufs)}
        for rnd in range(4):
            feed = {a: first[a] for a in aids}
            drafts = {}
            for i, a in enumerate(aids):
                ref = _greedy_run(pool, doc, ctx[a] + [feed[a]], 4)  # the true continuation
                n = (i + rnd) % 5
                d = ref[:n]
                if n and (i + rnd) % 3 == 0:
                    d = d[: rng.randrange(n)] + [(ref[min(len(d), n - 1)] + 1) % 60]  # a wrong draft
                drafts[a] = d[:n]
            b.feed(feed, {a: d for a, d in drafts.items() if d})
            out = b.step_verify()
            for a in aids:
                ref = _greedy_run(pool, doc, ctx[a] + [feed[a]], len(drafts[a]) + 1)
                assert out[a] == accept_greedy(drafts[a], ref), (rnd, a)
                ctx[a] += [feed[a]] + out[a][:-1]
                assert b.suffix_length(a) == len(ctx[a])
                assert b.tokens(a) == ctx[a]
                first[a] = out[a][-1]


def _greedy_run(pool, doc, ids, n):
    """n greedy tokens after suffix ids, one plain step each in a fresh batch."""
    with pool.open_batch(doc, graphs=False) as b:
        a = b.add(ids)
        out = []
        for _ in range(n):
            t = b.step_tokens()[a]
            out.append(t)
            b.feed({a: t})
        return out


@pytest.mark.parametrize("method", ["prompt_lookup", "suffix_tree"])
def test_static_speculative_generate_is_token_identical(setup, static_steps, method):
    """generate through the static steps (the GPU loop's host path): greedy speculative == plain,
    with accepted and rejected drafts, agents finishing at max_new_tokens inside accepted runs."""
    model, pool, doc = setup
    plain, spec, st = greedy_plain_and_spec(model, pool, doc, PROMPTS, method, 33)
    assert spec == plain
    assert st["accepted"] > 0 and (method == "suffix_tree" or st["accepted"] < st["drafted"])
    assert pool.last_generate["new_tokens"] == [33] * len(PROMPTS)


def test_static_speculative_stops_and_sampling_are_token_identical(setup, static_steps):
    """Stop strings and seeded sampling through the static steps (the sampled path keeps its own
    per-column draws)."""
    model, pool, doc = setup
    with row_invariant(model):
        a = pool.generate(doc, PROMPTS, max_new_tokens=25, stop=["x", "q"])
        ids = pool.last_generate["answer_ids"]
        b = pool.generate(doc, PROMPTS, max_new_tokens=25, stop=["x", "q"], speculative="prompt_lookup:4")
        assert a == b and pool.last_generate["answer_ids"] == ids
        kw = dict(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=11)
        pool.generate(doc, PROMPTS, **kw)
        plain = pool.last_generate["answer_ids"]
        pool.generate(doc, PROMPTS, speculative={"method": "suffix_tree", "num_draft_tokens": 3, "adaptive": False}, **kw)
    assert pool.last_generate["speculative"]["accepted"] > 0
    assert pool.last_generate["answer_ids"] == plain


def test_eos_inside_an_accepted_run_ends_the_agent(setup, static_steps, monkeypatch):
    """An eos id among a step's emitted tokens ends the agent there (the tokens after it are not
    kept) — the loop's whole-run append only when no emitted token is an eos id."""
    from polykv import generation

    model, pool, doc = setup
    with row_invariant(model):
        pool.generate(doc, PROMPTS, max_new_tokens=30)
        plain = pool.last_generate["answer_ids"]
    # an eos id that plain decoding emits mid-answer for some agents
    eos = next(t for ids in plain for t in ids[5:20])
    monkeypatch.setattr(generation, "stop_token_ids", lambda tok, model=None: frozenset({eos}))
    with row_invariant(model):
        pool.generate(doc, PROMPTS, max_new_tokens=30)
        want = pool.last_generate["answer_ids"]
        pool.generate(doc, PROMPTS, max_new_tokens=30, speculative={"method": "prompt_lookup", "num_draft_tokens": 4,
                                                                    "adaptive": False})
    assert pool.last_generate["answer_ids"] == want
    assert any(len(w) < 30 for w in want) and all(eos not in w for w in want)


def test_static_step_inputs_equal_the_per_column_lists(setup, static_steps):
    """The tokens / write rows / positions a verify step uploads (NumPy over [agents, columns])
    equal the per-agent, per-column lists they replaced (pages.row per real column, the scratch
    row and clamped earlier positions for left padding), across a page boundary (rows 60..70)."""
    _, pool, doc = setup
    with pool.open_batch(doc, capacity=4) as b:
        sufs = [list(range(5, 5 + n)) for n in (61, 3, 63, 1)]
        aids = [b.add(s) for s in sufs]
        b.step()
        cols = [[20, 21, 22, 23], [24], [25, 26], [27, 28, 29]]
        b.feed({a: c[0] for a, c in zip(aids, cols)}, {a: c[1:] for a, c in zip(aids, cols) if c[1:]})
        base = b.cache.lens[:4].tolist()
        b.step_verify()
        g = b._graphs
        inp = g._graphs[(4, 4)].inp
        pages, scratch = b.cache.pages, b.cache.scratch_row()
        for slot, (s0, col) in enumerate(zip(base, cols)):
            pad = 4 - len(col)
            assert inp[0, slot].tolist() == [pool._pad_id] * pad + col
            assert inp[1, slot].tolist() == [scratch] * pad + [pages.row(slot, s0 + j) for j in range(len(col))]
            new = s0 + len(col)
            assert inp[2, slot].tolist() == [max(0, b.cache.doc_len + new - 4 + j) for j in range(4)]
        assert len(pages.owned[0]) == 2 and len(pages.owned[2]) == 2  # slots 0 and 2 crossed a page boundary


def test_static_step_pads_the_bucket_rows(setup, static_steps):
    """3 agents in bucket 4: the 4th row feeds the pad token, writes the scratch row and sits at
    position doc_len - 1 (an empty suffix) in every column."""
    _, pool, doc = setup
    with pool.open_batch(doc, capacity=4) as b:
        aids = [b.add([5 + i, 6]) for i in range(3)]
        b.step()
        b.feed({a: 20 for a in aids}, {aids[0]: [21, 22]})
        b.step_verify()
        inp = b._graphs._graphs[(4, 3)].inp
        assert inp[:, 3].tolist() == [[pool._pad_id] * 3, [b.cache.scratch_row()] * 3, [b.cache.doc_len - 1] * 3]
