"""Speculative generation through the pool: lossless greedy and seeded sampling, rollback, stats,
persistence of the n-gram index (tiny random models; the real model: test_real_model.py)."""

from __future__ import annotations

import pytest
import torch

from polykv import SharedKVPool
from polykv.spec.invariant import row_invariant
from tests.pool.conftest import CharTok, tiny_llama
from tests.spec.helpers import DOC, PROMPTS, greedy_plain_and_spec

PROMPTS = PROMPTS[:6]


@pytest.mark.parametrize("method", ["prompt_lookup", "suffix_tree"])
def test_greedy_is_token_identical(setup, method):
    model, pool, doc = setup
    plain, spec, st = greedy_plain_and_spec(model, pool, doc, PROMPTS, method, 40)
    assert spec == plain
    assert st["accepted"] > 0 and st["accepted"] < st["drafted"]  # both accept and reject paths ran
    assert st["steps"] < pool.last_generate["steps"] + 1
    assert {"steps", "drafted", "accepted", "tokens"} <= set(st)
    assert st["tokens"] == st["accepted"] + st["agent_steps"]
    # the decode steps were timed with their draft width (the adaptive length's measured cost)
    assert 0 < max(st["timed_widths"]) <= 4 and st["cost_per_draft"] >= 0


def test_seeded_sampling_is_token_identical(setup):
    """Each column's token is the agent's own counter-based draw at that index (verify.py): the
    same seed gives the same tokens with or without speculation."""
    model, pool, doc = setup
    kw = dict(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=11)
    with row_invariant(model):
        pool.generate(doc, PROMPTS, **kw)
        plain = pool.last_generate["answer_ids"]
        pool.generate(doc, PROMPTS, speculative={"method": "suffix_tree", "num_draft_tokens": 3, "adaptive": False},
                      **kw)
    assert pool.last_generate["speculative"]["accepted"] > 0
    assert pool.last_generate["answer_ids"] == plain
    pool.generate(doc, PROMPTS, **dict(kw, seed=12))
    assert pool.last_generate["answer_ids"] != plain  # the seed matters: the comparison can fail


def test_stop_and_eos_rules_hold_inside_accepted_runs(setup):
    model, pool, doc = setup
    with row_invariant(model):
        a = pool.generate(doc, PROMPTS, max_new_tokens=25, stop=["x", "q"])
        b = pool.generate(doc, PROMPTS, max_new_tokens=25, stop=["x", "q"], speculative="prompt_lookup:4")
    assert a == b
    assert all(n <= 25 for n in pool.last_generate["new_tokens"])


def _logits_after(pool, doc, prompt, fed, drafts=None):
    """Fresh batch: prompt, then each token of `fed` alone; with drafts, the last one is fed with
    those drafts and verified. Returns (batch logits for the next token, suffix length)."""
    b = pool.open_batch(doc)
    a = b.add(prompt)
    b.step()
    for t in fed[:-1]:
        b.feed({a: t})
        b.step()
    b.feed({a: fed[-1]})
    if drafts:
        b.feed_drafts({a: drafts})
        out = b.step_verify()[a]
        b.feed({a: out[-1]})
        emitted = out
    else:
        emitted = None
    lg = b.step()[a].clone() if drafts else b.step()[a].clone()
    n = b.suffix_length(a)
    toks = b.tokens(a)
    b.close()
    return lg, n, toks, emitted


def test_rollback_leaves_the_cache_as_if_never_fed():
    model, tok = tiny_llama(seed=4), CharTok()
    pool = SharedKVPool(model, tok, k="f16", v="f16")
    doc = pool.add_document(DOC)
    prompt = [5, 6, 7, 8]
    with row_invariant(model):
        b = pool.open_batch(doc)
        a = b.add(prompt)
        t0 = int(b.step()[a].argmax())
        b.feed({a: t0})
        b.feed_drafts({a: [3, 3, 3, 3, 3]})  # wrong guesses (or right: both fine)
        out = b.step_verify()[a]
        m = len(out) - 1
        assert b.suffix_length(a) == len(prompt) + 1 + m
        assert b.tokens(a) == prompt + [t0] + out[:-1]
        b.feed({a: out[-1]})
        spec_logits = b.step()[a].clone()
        b.close()
        # fresh, plain: prompt, t0, the accepted drafts, the corrected token, one at a time
        fresh, n, toks, _ = _logits_after(pool, doc, prompt, [t0] + out)
    assert toks == prompt + [t0] + out
    assert torch.allclose(spec_logits, fresh, atol=1e-4, rtol=0)


def test_rollback_then_regrowth_reuses_the_rows():
    """Rejected rows are overwritten by the next forward: many verify steps with bad drafts on one
    agent end where plain decoding ends."""
    model, tok = tiny_llama(seed=5), CharTok()
    pool = SharedKVPool(model, tok, k="f16", v="f16")
    doc = pool.add_document(DOC)
    prompt = [9, 10, 11]
    with row_invariant(model):
        b = pool.open_batch(doc)
        a = b.add(prompt)
        t = int(b.step()[a].argmax())
        seq = [t]
        for i in range(70):  # crosses a page boundary (64 rows) while rolling back
            b.feed({a: t})
            b.feed_drafts({a: [(i * 7) % 100 + 3] * 3})
            out = b.step_verify()[a]
            seq += out
            t = out[-1]
        b.feed({a: t})
        lg = b.step()[a].clone()
        n = b.suffix_length(a)
        b.close()
        fresh, n2, toks, _ = _logits_after(pool, doc, prompt, seq)
    assert n == n2 == len(prompt) + len(seq)
    assert torch.allclose(lg, fresh, atol=1e-4, rtol=0)


def test_step_tokens_refuses_pending_drafts(setup):
    _, pool, doc = setup
    with pool.open_batch(doc) as b:
        a = b.add([5, 6])
        b.step_tokens()
        b.feed({a: 7})
        b.feed_drafts({a: [8]})
        with pytest.raises(RuntimeError):
            b.step_tokens()
        b.step_verify()
        with pytest.raises(ValueError):  # nothing pending for the drafts to follow
            b.feed_drafts({a: [4]})


def test_ngram_index_is_persisted_and_rebuilt(tmp_path):
    model, tok = tiny_llama(seed=0), CharTok()
    pool = SharedKVPool(model, tok)
    doc = pool.add_document(DOC)
    sa = pool._docs[doc].ngram.sa.clone()
    pool.save(tmp_path / "a")
    from safetensors import safe_open

    gen = sorted((tmp_path / "a").iterdir())[-1]
    with safe_open(str(gen / "pool.safetensors"), framework="pt") as f:
        assert "doc.0.ngram" in f.keys()
        assert torch.equal(f.get_tensor("doc.0.ngram"), sa)
    loaded = SharedKVPool.load(tmp_path / "a", model, tok)
    assert torch.equal(loaded._docs[doc].ngram.sa, sa)
    # a pool saved without an index (as before issue I) rebuilds it on load
    pool._docs[doc].ngram = None
    pool.save(tmp_path / "b")
    gen = sorted((tmp_path / "b").iterdir())[-1]
    with safe_open(str(gen / "pool.safetensors"), framework="pt") as f:
        assert "doc.0.ngram" not in f.keys()
    again = SharedKVPool.load(tmp_path / "b", model, tok)
    assert torch.equal(again._docs[doc].ngram.sa, sa)


def test_verify_step_through_the_static_graph_matches_eager(setup):
    """With captured steps (DecodeGraphs, run eagerly on CPU), a verification forward goes through
    run_columns: the same logits per real column as the eager left-padded forward, the same lengths."""
    from polykv.pool.decode_graph import DecodeGraphs

    model, pool, doc = setup
    sufs, drafts = [[5, 6, 7], [8], [9, 10]], [[11, 12, 13], [], [14]]
    out = []
    for static in (False, True):
        with pool.open_batch(doc, capacity=4) as b, torch.no_grad():  # _forward is step_verify's, without its no_grad
            if static:
                b._graphs = DecodeGraphs(model, b.cache, pool._pad_id, capture=False)
            aids = [b.add(s) for s in sufs]
            b.step()
            b.feed({a: 20 + i for i, a in enumerate(aids)})
            group = [b._get(a) for a in aids]
            for a, d in zip(group, drafts):
                a.pending.extend(d)
            logits, _ = b._forward(group, keep=4)
            if static:
                assert set(k for k in b._graphs._graphs if k[1] > 1) == {(4, 4)}
                # one per (bucket, width), and the prompts' prefill step
                assert b.graph_captures == len(b._graphs.widths()) + len(b._graphs.prefill_widths()) >= 2
            else:
                assert b.graph_captures == 0
            out.append((logits.float(), b.cache.lens[:3].clone()))
    (le, ne), (ls, ns) = out
    assert torch.equal(ne, ns)
    for g, d in enumerate(drafts):
        real = slice(4 - len(d) - 1, 4)
        torch.testing.assert_close(ls[g, real], le[g, real], rtol=1e-4, atol=1e-4)


def test_generate_reports_step_times_by_draft_width(setup):
    """last_generate["step_ms"]: the prefill step apart, then the median step time per widest draft
    count (0 = plain decode) over every later step; graph_captures counts the batch's captured steps
    (none on the CPU). The speculative bench reads both to say what a verify step costs."""
    model, pool, doc = setup
    pool.generate(doc, PROMPTS, max_new_tokens=12)
    lg = pool.last_generate
    assert lg["step_ms"]["first"] > 0 and set(lg["step_ms"]["by_width"]) == {0}
    assert sum(lg["step_ms"]["count_by_width"].values()) == lg["steps"] - 1
    assert lg["graph_captures"] == 0
    pool.generate(doc, PROMPTS, max_new_tokens=12,
                  speculative={"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": False})
    lg = pool.last_generate
    counts = lg["step_ms"]["count_by_width"]
    assert sum(counts.values()) == lg["steps"] - 1
    assert 1 <= max(counts) <= 3
    assert sum(n for w, n in counts.items() if w) == lg["speculative"]["steps"]  # the verify forwards
    assert all(ms > 0 for ms in lg["step_ms"]["by_width"].values())


def test_step_times_persist_across_calls_and_skip_captures(setup, monkeypatch):
    """generate times its decode steps by (agents, width) into the document's StepTimes, plain calls
    included, so the next call's width planner starts from them; a step that captured a graph (here
    a capture made slow on purpose) is never timed."""
    import functools
    import time as _time

    from polykv.pool import decode_graph
    from polykv.pool.decode_graph import DecodeGraphs
    from polykv.spec.adaptive import StepTimes

    model, _, _ = setup
    pool = SharedKVPool(model, CharTok(), k="q8_0", v="turbo3")
    doc = pool.add_document(DOC)

    class Slow(DecodeGraphs):
        def _capture(self, B, n_q, last=False, wide=None):
            _time.sleep(0.25)
            return super()._capture(B, n_q, last, wide)

    monkeypatch.setattr(decode_graph, "graphs_supported", lambda cache: True)
    monkeypatch.setattr(decode_graph, "DecodeGraphs", functools.partial(Slow, capture=False))
    seen = []
    observe = StepTimes.observe
    monkeypatch.setattr(StepTimes, "observe", lambda self, n, w, s: (seen.append((n, w, s)), observe(self, n, w, s)))
    pool.generate(doc, PROMPTS, max_new_tokens=10)
    lg = pool.last_generate
    times = pool._docs[doc].step_times
    # untimed: the first step (the prompts' prefill, which captured the prefill step) and each
    # decode step that captured
    assert lg["graph_captures"] > 1 and len(seen) == lg["steps"] - 1 - (lg["graph_captures"] - 1)
    assert all(s < 0.25 for _, _, s in seen) and {w for _, w, _ in seen} == {0}
    assert times.estimate(len(PROMPTS), 0) is not None
    seen.clear()
    # synchronous (pipelined=False: a pipelined call times its plain steps in stretches only,
    # tests/spec/test_step_basis.py)
    pool.generate(doc, PROMPTS, max_new_tokens=10, speculative={"method": "prompt_lookup", "num_draft_tokens": 3,
                                                                "min_ngram": 1}, pipelined=False)
    lg = pool.last_generate
    assert pool._docs[doc].step_times is times and seen and all(s < 0.25 for _, _, s in seen)
    # the first decode step captures every verify width of bucket 8 at once (2, 3, 4; 1 exists):
    # untimed, as the prefill; every later step is timed
    assert lg["graph_captures"] == 3 and len(seen) == lg["steps"] - 2
    st = lg["speculative"]
    assert st["step_times_ms"][8][0] > 0  # the plain call's T(0), read by this call's planner
    assert sum(st["widths"].values()) >= 1
