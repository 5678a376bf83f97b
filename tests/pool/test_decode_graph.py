"""The static decode step of AgentBatch (decode_graph.py) — the code a CUDA graph captures — run
eagerly on CPU: it must reproduce the eager step exactly (same packed rows, same logits), with
padded bucket rows that touch nothing, and survive removal and storage growth."""

import pytest
import torch

from polykv.generation import stop_token_ids
from polykv.pool import SharedKVPool
from polykv.pool.decode_graph import DecodeGraphs, bucket

DOC = list(range(3, 50))


def _run(model, tok, k, v, static: bool, feeds, sufs, **pool_kw):
    """Logits of every step, the storage rows and lengths after them: a batch of `sufs` fed `feeds`
    (the first agent removed after two steps), eager or through the static step (checked to run)."""
    pool = SharedKVPool(model, tok, k=k, v=v, prefill_chunk=16, **pool_kw)
    doc = pool.add_document(DOC)
    logits = []
    with pool.open_batch(doc, capacity=2, seq_capacity=4) as b:
        if static:
            b._graphs = DecodeGraphs(model, b.cache, pool._pad_id, capture=False)
        aids = [b.add(s) for s in sufs]
        b.step()
        for i, f in enumerate(feeds):
            b.feed({a: t for a, t in zip(aids, f) if a in b.agents()})
            logits.append(torch.stack([lg for _, lg in sorted(b.step().items())]))
            if i == 1:
                b.remove(aids[0])  # slot compaction: the last agent (its window too) moves to slot 0
        if static:
            assert b._graphs.captures > 0  # the static step really ran
        rows = [t.clone() for t in b.cache.tensors()]
        lens = b.cache.lens.clone()
        pages = [list(p) for p in b.cache.pages.owned], b.cache.pages.page_size
    return logits, rows, lens, pages


def _slot_rows(x: torch.Tensor, pages: tuple, slot: int, n: int) -> torch.Tensor:
    """The first n suffix rows of `slot` in storage tensor x [.., rows, ..] (dim 1), page by page:
    the two runs may take their pages from the free list in another order."""
    owned, size = pages
    idx = torch.tensor([owned[slot][r // size] * size + r % size for r in range(n)], dtype=torch.long)
    return x[:, idx]


@pytest.mark.parametrize("k,v", [("q8_0", "turbo3"), ("f16", "f16"), ("turbo4", "q4_0")])
def test_static_step_equals_eager(tiny, k, v):
    model, tok = tiny
    sufs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]  # 4 agents -> bucket 4; 3 after removal
    feeds = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31], [32, 33, 34, 35],
             [36, 37, 38, 39]]  # 5 decode steps: suffixes outgrow seq_capacity 4 (storage grows)
    a_logits, a_rows, a_lens, a_pages = _run(model, tok, k, v, False, feeds, sufs)
    b_logits, b_rows, b_lens, b_pages = _run(model, tok, k, v, True, feeds, sufs)
    assert torch.equal(a_lens, b_lens)
    for x, y in zip(a_logits, b_logits):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    # every live row equal (the scratch row and dead slots may differ). f16 rows are the projections
    # themselves: the static step's GEMMs run at the bucket's row count, and CPU GEMM kernels (AVX-512
    # oneDNN) may round the last bit differently per row count — one fp16 ulp; a quantized codec
    # absorbs that and must match bit for bit
    for x, y in zip(a_rows, b_rows):
        for slot, n in enumerate(a_lens.tolist()):
            xs, ys = _slot_rows(x, a_pages, slot, n), _slot_rows(y, b_pages, slot, n)
            if k == "f16" and xs.is_floating_point():
                torch.testing.assert_close(xs, ys, rtol=1e-3, atol=2e-7)
            else:
                assert torch.equal(xs, ys)


def test_static_step_pads_to_bucket_and_step_tokens(tiny):
    """3 agents run in a bucket of 4: the padded row must not change any agent's result, and
    step_tokens' greedy ids are the argmax of step()'s logits."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    doc = pool.add_document(DOC)
    assert bucket(3) == 4 and bucket(1) == 1 and bucket(5) == 8
    with pool.open_batch(doc, capacity=4, seq_capacity=8) as b, \
            pool.open_batch(doc, capacity=4, seq_capacity=8) as e:
        b._graphs = DecodeGraphs(model, b.cache, pool._pad_id, capture=False)
        for batch in (b, e):
            aids = [batch.add(s) for s in ([5, 6], [7], [8, 9, 10])]
            batch.step()
            batch.feed({a: 40 + i for i, a in enumerate(aids)})
        toks = b.step_tokens()
        ref = e.step()
        assert set(b._graphs._graphs) == {(4, 1)}
        assert toks == {a: int(torch.argmax(lg)) for a, lg in ref.items()}
        assert torch.equal(b.cache.lens, e.cache.lens)


def test_generate_greedy_unchanged_by_step_tokens(tiny):
    """pool.generate chooses tokens on the device now; greedy answers equal a step()+argmax loop."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    doc = pool.add_document(DOC)
    prompts = [[5, 6, 7], [8], [9, 10]]
    pool.generate(doc, prompts, max_new_tokens=5)
    got = pool.last_generate["answer_ids"]
    with pool.open_batch(doc) as b:
        aids = [b.add(p) for p in prompts]
        want = {a: [] for a in aids}
        for _ in range(5):
            lg = b.step()
            nxt = {a: int(torch.argmax(lg[a])) for a in aids}
            for a in aids:
                want[a].append(nxt[a])
            b.feed(nxt)
    eos = stop_token_ids(pool.tok, pool.model)
    for a, g in zip(aids, got):
        w = want[a]
        cut = next((i for i, t in enumerate(w) if t in eos), len(w))
        assert g == w[:cut]


def test_paged_agents_cost_what_they_use_and_never_copy(tiny):
    """Agents of very different lengths hold only the pages they need; growing inside the reserved
    pages never reallocates the pools (same storage); a removed agent's pages are reused by the
    next one; results equal a plain forward of doc + suffix."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="f16", v="f16", prefill_chunk=16)
    doc = pool.add_document(DOC)
    with pool.open_batch(doc, capacity=3, seq_capacity=64) as b:
        pages = b.cache.pages
        assert pages.n_pages == 3
        ptrs = [t.data_ptr() for t in b.cache.tensors()]
        long_ids = list(range(3, 100))  # 97 tokens: 2 pages
        a_long, a_short = b.add(long_ids), b.add([7, 8])
        lg = b.step()
        assert pages.counts[:2] == [2, 1] and pages.n_pages == 3
        assert [t.data_ptr() for t in b.cache.tensors()] == ptrs  # no reallocation, no copy
        with torch.no_grad():
            ref = model(torch.tensor([DOC + long_ids])).logits[0, -1]
        torch.testing.assert_close(lg[a_long], ref, rtol=1e-4, atol=1e-4)
        b.remove(a_long)  # its 2 pages go back to the free list; a_short's row moves to slot 0
        assert pages.counts[:2] == [1, 0] and pages.used_pages() == 1
        a_new = b.add(list(range(10, 80)))  # 70 tokens: 2 pages, taken from the free list
        lg = b.step()
        assert pages.n_pages == 3 and pages.used_pages() == 3
        with torch.no_grad():
            ref = model(torch.tensor([DOC + list(range(10, 80))])).logits[0, -1]
            ref_short = model(torch.tensor([DOC + [7, 8]])).logits[0, -1]
        torch.testing.assert_close(lg[a_new], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lg[a_short], ref_short, rtol=1e-4, atol=1e-4)


def test_budget_counts_agent_pages(tiny):
    """budget_bytes covers the agents' suffix pages too: opening a batch whose pages push the total
    over the budget evicts the unreferenced document (LRU), never the one in use."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    a = pool.add_document(DOC)
    b = pool.add_document(list(range(60, 100)))
    docs = {d["id"]: d["bytes"] for d in pool.documents()}
    pool.budget_bytes = docs[a] + docs[b] + 1000  # both documents fit, with little room to spare
    with pool.open_batch(a, capacity=2, seq_capacity=16) as small:  # 2 pages: still fits? no eviction
        assert small.nbytes() > 0
        fits = docs[a] + docs[b] + small.nbytes() <= pool.budget_bytes
        assert {d["id"]: d["resident"] for d in pool.documents()} == {a: True, b: fits}
    pool.add_document(list(range(60, 100)))  # re-prefill b if it was evicted
    with pool.open_batch(a, capacity=8, seq_capacity=256) as big:  # 32 pages: over the budget
        assert docs[a] + docs[b] + big.nbytes() > pool.budget_bytes
        resident = {d["id"]: d["resident"] for d in pool.documents()}
        assert resident == {a: True, b: False}  # b evicted for a's agents; a (in use) kept


def test_static_multi_column_step_matches_plain_forward(tiny):
    """run_columns (the captured verification step: each agent feeds 1..n tokens, left-padded to the
    widest agent's exact width, captured per (bucket, width)) gives every real column the logits of a plain forward over doc + suffix +
    those tokens, advances each agent by its own count, and leaves a cache the next step reads."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="f16", v="f16", prefill_chunk=16)
    doc = pool.add_document(DOC)
    sufs = [[5, 6], [7], [8, 9, 10]]
    cols = [[40, 41, 42], [43], [44, 45]]  # widest 3 -> n_q 3 (exact: no power-of-two rounding)

    def ref(ids, n):
        with torch.no_grad():
            return model(torch.tensor([DOC + ids])).logits[0, -n:]

    with pool.open_batch(doc, capacity=4, seq_capacity=16) as b:
        b._graphs = DecodeGraphs(model, b.cache, pool._pad_id, capture=False)
        aids = [b.add(s) for s in sufs]
        b.step()
        got = b._graphs.run_columns(cols, keep=3)
        assert got.shape[:2] == (3, 3) and set(b._graphs._graphs) == {(4, 3)}
        for g, (s, c) in enumerate(zip(sufs, cols)):
            torch.testing.assert_close(got[g, 3 - len(c):], ref(s + c, len(c)), rtol=1e-4, atol=1e-4)
        assert b.cache.lens[:3].tolist() == [len(s) + len(c) for s, c in zip(sufs, cols)]
        for a in aids:  # the agents' own token lists follow what the static step consumed
            b._get(a).tokens.extend(cols[aids.index(a)])
        b.feed({a: 50 + i for i, a in enumerate(aids)})
        nxt = b.step()
        for i, a in enumerate(aids):
            torch.testing.assert_close(nxt[a], ref(sufs[i] + cols[i] + [50 + i], 1)[0], rtol=1e-4, atol=1e-4)


@pytest.fixture
def static_graphs(monkeypatch):
    """Batches build their decode steps as on CUDA, run eagerly (capture=False): the captured
    path of `AgentBatch` on CPU, captures counted as on the GPU."""
    import functools

    from polykv.pool import decode_graph

    monkeypatch.setattr(decode_graph, "graphs_supported", lambda cache: True)
    monkeypatch.setattr(decode_graph, "DecodeGraphs", functools.partial(DecodeGraphs, capture=False))


SPEC = {"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": False, "min_ngram": 1}  # drafts every step


@pytest.mark.parametrize("spec", [None, SPEC])
def test_second_generate_reuses_the_captured_steps(tiny, static_graphs, spec):
    """A closed batch's cache and captured steps are parked with the pool; the next generate call
    over the document takes them over: same tokens as a pool that never reuses (and as the first
    call), and no new capture (`graph_captures` counts the captures of that call only)."""
    model, tok = tiny
    doc_ids = DOC * 2
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15]]  # 5 agents: bucket 8, then fewer
    fresh = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    fresh.max_parked_batches = 0  # every call builds and captures anew (the behaviour before reuse)
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    doc = pool.add_document(doc_ids)
    assert fresh.add_document(doc_ids) == doc
    got, caps = [], []
    for _ in range(3):
        pool.generate(doc, prompts, max_new_tokens=9, speculative=spec)
        got.append(pool.last_generate["answer_ids"])
        caps.append(pool.last_generate["graph_captures"])
        fresh.generate(doc, prompts, max_new_tokens=9, speculative=spec)
        assert fresh.last_generate["answer_ids"] == got[-1]
        assert fresh.last_generate["graph_captures"] == caps[0] > 0
    assert got[0] == got[1] == got[2]
    assert caps[1] == caps[2] == 0  # every step was captured by the first call
    widths = {w for _, w in pool._docs[doc].parked.graphs.widths()}
    if spec is not None:  # verify steps ran, through captured steps of their exact widths
        assert pool.last_generate["speculative"]["drafted"] > 0 and max(widths) > 1
    else:
        assert widths == {1}
    rep = pool.memory_report()
    parked = pool._docs[doc].parked
    assert rep["parked_batches"] == 1 and rep["kv_bytes_parked"] == parked.nbytes() > 0
    assert rep["kv_bytes_agents"] == 0 and rep["gpu_tier_bytes"] == rep["kv_bytes_gpu"] + rep["kv_bytes_parked"]
    assert fresh.memory_report()["parked_batches"] == 0


def test_reused_batch_starts_like_a_fresh_one(tiny, static_graphs):
    """Reuse resets the slots, lengths and free pages (in a fresh table's order) and the per-batch
    capture count, keeps storage and graphs: a second batch's logits and page layout equal a fresh
    pool's exactly, whatever the first batch left behind (removals, rollbacks, a sampled agent)."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    ref = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    doc = pool.add_document(DOC)
    ref.add_document(DOC)
    with pool.open_batch(doc, capacity=4, seq_capacity=8) as b:
        aids = [b.add(s) for s in ([5, 6, 7], list(range(20, 90)), [8])]
        b.set_sampling(aids[2], temperature=1.0, seed=3, start=5)
        b.step_tokens()
        b.remove(aids[0])
        b.feed({a: 40 for a in aids[1:]})
        b.feed_drafts({aids[1]: [41, 42]})
        b.step_verify()
        first = b.cache, b._graphs
        assert b.graph_captures > 0
    assert pool._docs[doc].parked.cache is first[0]

    def run(p):
        out = []
        with p.open_batch(doc, capacity=4, seq_capacity=8) as b2:
            aids2 = [b2.add(s) for s in ([9, 10], [11, 12, 13])]
            b2.set_sampling(aids2[1], temperature=0.9, seed=5)
            out.append(b2.step())
            b2.feed({a: 30 for a in aids2})
            out.append(b2.step_tokens())
            b2.feed({a: 31 for a in aids2})
            out.append(b2.step())
            return out, [list(x) for x in b2.cache.pages.owned[:2]], b2.cache.lens[:4].tolist(), (b2.cache, b2._graphs)

    got, pages, lens, held = run(pool)
    want, ref_pages, ref_lens, _ = run(ref)
    assert held[0] is first[0] and held[1] is first[1]  # the same storage and steps, not a copy
    assert pages == ref_pages and lens == ref_lens
    assert got[1] == want[1]
    for g, w in zip((got[0], got[2]), (want[0], want[2])):
        assert g.keys() == w.keys() and all(torch.equal(g[a], w[a]) for a in g)


def test_reuse_needs_capacity_and_one_owner(tiny):
    """A parked batch goes to one new batch at a time, only with enough slots (fewer would
    reallocate the page table and lose every captured step); the larger of two is kept."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    doc = pool.add_document(DOC)
    b = pool.open_batch(doc, capacity=2)
    small = b.cache
    b.close()
    with pool.open_batch(doc, capacity=8) as big, pool.open_batch(doc, capacity=2) as other:
        assert big.cache is not small  # 2 slots < 8: a fresh batch
        assert other.cache is small  # the parked one, taken out
        assert pool._docs[doc].parked is None
        with pool.open_batch(doc, capacity=2) as third:
            assert third.cache not in (small, big.cache)  # one owner at a time
        big_cache = big.cache
    assert pool._docs[doc].parked.cache is big_cache  # 8 slots beat 2 (and beat the third's 4)
    with pool.open_batch(doc, capacity=2, backend="reference") as ref_b:
        assert ref_b.cache is not big_cache  # another backend: not reused
    with pool.open_batch(doc) as again:
        assert again.cache is big_cache


def test_bucket_follows_the_batch_not_the_parked_graphs(tiny, static_graphs):
    """Agents finishing within a batch keep replaying its larger captured bucket (no capture for the
    last steps); a new batch that starts smaller, reusing those graphs, captures its own bucket
    (else every 3-agent step of it would pay for 8 rows)."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    doc = pool.add_document(DOC)

    def decode(b, aids, steps=2):
        for _ in range(steps):
            b.feed({a: 40 for a in aids})
            b.step_tokens()

    with pool.open_batch(doc, capacity=8) as b:
        aids = [b.add([5 + i]) for i in range(8)]
        b.step_tokens()
        decode(b, aids)
        for a in aids[3:]:
            b.remove(a)
        decode(b, aids[:3])
        assert b._graphs.widths() == [(8, 1)] and b.graph_captures == 1
    with pool.open_batch(doc, capacity=3) as b:
        aids = [b.add([5 + i]) for i in range(3)]
        b.step_tokens()
        decode(b, aids)
        assert b._graphs.widths() == [(4, 1), (8, 1)] and b.graph_captures == 1


@pytest.mark.parametrize("adaptive", [False, True])
def test_speculation_captures_every_width_before_the_hot_loop(tiny, static_graphs, monkeypatch, adaptive):
    """With speculation on, the first replay of a bucket builds every width 1..k+1 of it: no step
    after the first captures (a width first chosen mid-run used to capture there: 1.4 s inside a
    timed H200 run), and the timed steps of the run skip none. Outputs unchanged."""
    model, tok = tiny
    replays, at, prefills = [0], [], []
    run = DecodeGraphs._replay
    cap = DecodeGraphs._capture

    def count_replay(self, *a, **kw):
        replays[0] += 1
        return run(self, *a, **kw)

    def record_capture(self, B, n_q, last=False, wide=None):
        (prefills if last else at).append((replays[0], B, n_q))
        return cap(self, B, n_q, last, wide)

    monkeypatch.setattr(DecodeGraphs, "_replay", count_replay)
    monkeypatch.setattr(DecodeGraphs, "_capture", record_capture)
    spec = dict(SPEC, adaptive=adaptive)
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15]]  # 5 agents: bucket 8
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    doc = pool.add_document(DOC * 2)
    pool.generate(doc, prompts, max_new_tokens=9, speculative=spec)
    k = spec["num_draft_tokens"]
    assert sorted((B, w) for _, B, w in at) == [(8, w) for w in range(1, k + 2)]
    # all inside the first decode replay of the batch, after the prompts' prefill step (replay 1)
    assert prefills == [(1, 8, 8)] and {r for r, _, _ in at} == {2}
    assert pool.last_generate["graph_captures"] == k + 2
    first = pool.last_generate["answer_ids"]
    at.clear()
    pool.generate(doc, prompts, max_new_tokens=9, speculative=spec)
    assert at == [] and len(prefills) == 1 and pool.last_generate["answer_ids"] == first
    pool.generate(doc, prompts, max_new_tokens=9)  # plain: nothing more to capture, same tokens
    assert at == [] and len(prefills) == 1 and pool.last_generate["answer_ids"] == first


def test_finishing_agents_never_capture_a_smaller_bucket(tiny, static_graphs):
    """A smaller bucket with only some widths captured ((4, 1), say from an earlier plain batch)
    serves the widths it has when a speculative batch of 5 shrinks to 3; the other widths replay
    the batch's own bucket 8: nothing is captured after the first decode step."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    doc = pool.add_document(DOC)
    with pool.open_batch(doc, capacity=8, seq_capacity=16) as b:
        b._graphs._capture(4, 1)
        b.expect_drafts(3)
        aids = [b.add([5 + i, 6]) for i in range(5)]
        b.step_tokens()
        b.feed({a: 40 for a in aids})
        b.feed_drafts({aids[0]: [41, 42, 43]})
        b.step_verify()  # first decode step: bucket 8, widths 1..4
        assert b._graphs.widths() == [(4, 1)] + [(8, w) for w in range(1, 5)]
        before = b._graphs.total_captures
        for a in aids[3:]:
            b.remove(a)
        b.feed({a: 44 for a in aids[:3]})
        b.step_verify()  # plain step of 3: (4, 1)
        b.feed({a: 45 for a in aids[:3]})
        b.feed_drafts({aids[1]: [46]})
        b.step_verify()  # width 2 of 3 agents: bucket 8's
        assert b._graphs.total_captures == before
        assert b._graphs.widths() == [(4, 1)] + [(8, w) for w in range(1, 5)]


def test_eager_static_step_runs_without_autograd(tiny, static_graphs, monkeypatch):
    """A static step run eagerly (capture=False) does not track gradients: a rotation table cached
    under torch.inference_mode by other code (a CI run's test order did it) would otherwise fail
    "Inference tensors cannot be saved for backward" inside the turbo encode."""
    from polykv.codecs import rotation

    monkeypatch.setattr(rotation, "_DEVICE_CACHE", {})
    with torch.inference_mode():
        rotation.rotation_matrix(32, "cpu")
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    doc = pool.add_document(DOC)
    with pool.open_batch(doc, capacity=4, seq_capacity=16) as b:
        b._graphs._capture(4, 1)  # outside any no_grad, as a direct call is
        assert b._graphs.widths() == [(4, 1)]


def test_static_step_equals_eager_with_sliding_window_layers():
    """A model with sliding-window layers (Gemma-3) takes the static step too: the same logits and
    rows as the eager step, windows reaching back into the shared document (window 8, 47 rows)."""
    from tests.pool.conftest import CharTok, tiny_gemma

    model, tok = tiny_gemma(heads=4, kv_heads=2), CharTok()
    sufs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    feeds = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31], [32, 33, 34, 35],
             [36, 37, 38, 39], [40, 41, 42, 43]]  # past the window: the document drops out of it
    a_logits, a_rows, a_lens, _ = _run(model, tok, "q8_0", "turbo3", False, feeds, sufs)
    b_logits, b_rows, b_lens, _ = _run(model, tok, "q8_0", "turbo3", True, feeds, sufs)
    assert torch.equal(a_lens, b_lens)
    for x, y in zip(a_logits, b_logits):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", [None, SPEC])
def test_prompts_are_prefilled_through_the_static_step(tiny, static_graphs, monkeypatch, spec):
    """With captured steps, the prompts of a batch and the prompts joining it later (continuous
    batching) are prefilled by the captured prefill step (`run_prefill`: columns rounded up to 8,
    16, ...; waiting agents padded), never by an eager forward (`AgentCache.begin`) — answers as
    with eager prefills. A prompt longer than PREFILL_MAX, or a step over the padding budget,
    still prefills eagerly."""
    from polykv.pool import decode_graph
    from polykv.pool.agent_cache import AgentCache
    from polykv.spec.invariant import row_invariant

    model, tok = tiny
    begun = []
    begin = AgentCache.begin
    monkeypatch.setattr(AgentCache, "begin", lambda self, *a, **k: (begun.append(1), begin(self, *a, **k))[1])
    prompts = [[5, 6, 7], [8, 9], [9, 10, 11, 12, 13, 14, 15, 16, 17], [11, 12, 13, 14], [15, 16, 17]]
    kw = dict(max_new_tokens=6, speculative=spec, max_batch=2)
    want = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    doc = pool.add_document(DOC)
    assert want.add_document(DOC) == doc
    with row_invariant(model):
        monkeypatch.setattr(decode_graph, "PREFILL_MAX", 0)  # every prefill eager: the reference
        want.generate(doc, prompts, **kw)
        assert begun
        begun.clear()
        monkeypatch.setattr(decode_graph, "PREFILL_MAX", 8)  # the 9-token prompt: eager
        pool.generate(doc, prompts, **kw)
        assert len(begun) == 1
        begun.clear()
        monkeypatch.setattr(decode_graph, "PREFILL_MAX", 128)
        pool.generate(doc, prompts, **kw)
        assert not begun  # no eager forward at all
        assert pool.last_generate["answer_ids"] == want.last_generate["answer_ids"]
        # the captured prefills are counted: the first step and the later joins (three prompts,
        # joining in two or three steps; two agents: never split)
        lg = pool.last_generate
        assert lg["join_steps_split"] == 0 and 3 <= lg["join_steps_unsplit"] <= 4
        parked = pool._docs[doc].parked.graphs
        assert parked.prefill_widths() == [(2, 8, 2), (2, 16, 2)]  # 9 tokens ran as 16 columns
        parked.prefill_budget = 2 * 8  # 2 agents x 8 columns: the 16-column step is over budget
        pool.generate(doc, prompts, **kw)
    assert len(begun) == 1 and pool.last_generate["answer_ids"] == want.last_generate["answer_ids"]


@pytest.mark.parametrize("family,recent", [("llama", 0), ("llama", 4), ("gemma", 4), ("gemma", 0)])
def test_a_joining_prompt_splits_the_step(static_graphs, monkeypatch, family, recent):
    """A prompt joining agents that decode splits the captured step's attention: every agent at
    its last column, the joining agent at every column (`DecodeGraphs._split`,
    `AgentCache.attend`; 7 agents in a bucket of 8, one joins: 8 x 1 + 2 x 8 of 64 columns) — the eager prefill's
    logits, every step, and the split step really ran. The mixed step (prompts joining agents
    that verify drafts) splits too: `test_joins_split_the_mixed_step`."""
    from polykv.pool import decode_graph
    from polykv.pool.agent_cache import AgentCache
    from polykv.spec.invariant import row_invariant

    from tests.pool.conftest import CharTok, tiny_gemma, tiny_llama

    model, tok = (tiny_llama() if family == "llama" else tiny_gemma()), CharTok()
    split = []
    attend = AgentCache.attend
    monkeypatch.setattr(AgentCache, "attend", lambda self, *a, **k: (
        split.append(self._group.wide is not None), attend(self, *a, **k))[1])
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32, recent=recent)
    pool.max_parked_batches = 0  # each batch its own steps
    doc = pool.add_document(DOC)

    joins = []

    def run():
        out = []
        with pool.open_batch(doc, capacity=8, seq_capacity=16) as b:
            aids = [b.add(p) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19])]
            out.append(b.step())
            joins.append(b.join_steps)
            for t in (20, 21):
                b.feed({a: t for a in aids})
                out.append(b.step())
            aids.append(b.add([30, 31, 32, 33, 34, 35]))  # joins: 6 agents decode beside it
            b.feed({a: 22 for a in aids[:-1]})
            out.append(b.step())
            b.feed({a: 23 for a in aids})
            out.append(b.step())
            joins.append(b.join_steps)
        return out

    with row_invariant(model):
        monkeypatch.setattr(decode_graph, "PREFILL_MAX", 0)  # every prefill eager: the reference
        want = run()
        assert not any(split)
        monkeypatch.setattr(decode_graph, "PREFILL_MAX", 128)
        got = run()
    # the join step, every layer: built (capture=False: one forward) and run
    assert sum(split) == 2 * model.config.num_hidden_layers
    # the batch counts it: the first step (five prompts of several tokens) unsplit, the join split
    assert joins == [(0, 0), (0, 0), (0, 1), (1, 1)]  # (split, unsplit): eager, then captured
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for a in w:
            torch.testing.assert_close(g[a], w[a], rtol=0, atol=1e-5)


@pytest.mark.parametrize("B,n_q,keep,wide,streamed,want", [
    (32, 16, 1, 1, False, 2),  # one prompt joins 31 decoders: 32 + 2 x 16 of 512 columns
    (32, 16, 1, 2, False, 2),
    (32, 16, 1, 3, False, 32),  # more joiners than SPLIT_WIDE: unsplit
    (8, 8, 1, 0, False, 2),  # no joiner feeds more than kept (a mixed step's short prompt)
    (8, 16, 4, 1, False, 2),  # a mixed step: 8 x 4 + 2 x 16 = half of 128
    (8, 8, 4, 1, False, 8),  # 8 x 4 + 2 x 8 > half of 64
    (4, 8, 1, 1, False, 4),  # 4 + 16 > half of 32
    (32, 16, 1, 1, True, 32),  # a host-tier document: each cascade call streams the prefix
])
def test_split_rule(B, n_q, keep, wide, streamed, want):
    """`DecodeGraphs._split`: SPLIT_WIDE agents at every column while at most that many feed more
    than the kept columns and the split attends at most half the columns; else every agent."""
    from types import SimpleNamespace

    graphs = SimpleNamespace(cache=SimpleNamespace(streamed=streamed))
    assert DecodeGraphs._split(graphs, B, n_q, keep, wide) == want


@pytest.mark.parametrize("slots,wide", [([5], 2), ([6, 1], 2), ([], 2)])
def test_wide_plane_names_the_agents_and_their_places(slots, wide):
    """A split step's plane 3: its wide agents (the joiners first, then distinct others) and each
    slot's place among them, -1 elsewhere — the map the ring step writes their segments by (the
    CPU reference gathers by the agents themselves, so only this and the kernels see it)."""
    import numpy as np

    from polykv.pool.decode_graph import _wide_plane

    plane = np.full((8, 8), 99, dtype=np.int64)
    _wide_plane(plane, np.array(slots, dtype=np.int64), wide)
    flat = plane.reshape(-1)
    idx, pos = flat[:wide], flat[wide: wide + 8]
    assert list(idx[: len(slots)]) == slots and len(set(idx)) == wide
    assert [int(pos[s]) for s in idx] == list(range(wide))
    assert sorted(p for p in pos if p >= 0) == list(range(wide)) and (pos == -1).sum() == 8 - wide


def split_and_unsplit(family: str, recent: int, head_dim: int = 32) -> tuple:
    """The same steps split and unsplit (`DecodeGraphs._split` forced to every agent): a prompt
    joining six decoding agents (`run_prefill`), then one joining six that verify drafts
    (`run_mixed`, 4 kept columns). Each: (kept logits per step, suffix page pools, windows without
    their scratch row, lengths, (pages owned, page size), captured prefill and mixed keys)."""
    from tests.pool.conftest import CharTok, tiny_gemma, tiny_llama

    model = tiny_llama(head_dim=head_dim) if family == "llama" else tiny_gemma(head_dim=head_dim)
    tok = CharTok()
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32, recent=recent)
    pool.max_parked_batches = 0
    doc = pool.add_document(DOC)

    def run(split: bool):
        with pool.open_batch(doc, capacity=8, seq_capacity=32) as b:
            g = DecodeGraphs(model, b.cache, pool._pad_id, capture=False)
            if not split:
                g._split = lambda B, n_q, keep, wide: B
            out = [g.run_prefill([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]])[0]]
            out.append(g.run([20, 21, 22, 23, 24, 25])[0])
            # 7 tokens join six agents that decode: 8 columns
            out.append(g.run_prefill([[23], [24], [25], [26], [27], [28], list(range(30, 37))])[0])
            out.append(g.run([26, 27, 28, 29, 30, 31, 32])[0])
            g.expect_columns(4)
            # one waits; then 12 tokens join six agents that verify: 16 columns, 8 x 4 + 2 x 16 of 128
            out.append(g.run_mixed([[40, 41, 42, 43], [44], [45, 46], [], [47], [48], [49, 50]], keep=4)[0])
            out.append(g.run_mixed([[47, 48], [49, 50, 51], [52], [53], [54, 55, 56, 57], [58], [59],
                                    list(range(60, 72))], keep=4)[0])
            keys = sorted(g._prefills) + sorted(g._mixed)
            pools = [t.clone() for st in b.cache.store for t in st.tensors()]
            rings = [t[:, :-1].clone() for t in b.cache.ring_tensors()]  # the last row is scratch
            pages = [list(p) for p in b.cache.pages.owned], b.cache.pages.page_size
            return out, pools, rings, b.cache.lens[:8].clone(), pages, keys

    return run(True), run(False)


@pytest.mark.parametrize("family,recent", [("llama", 0), ("llama", 4), ("gemma", 4), ("gemma", 0)])
def test_split_steps_equal_the_unsplit_ones(family, recent):
    """A split step (every agent attends at its kept columns, the joining prompt at every column)
    equals the same step unsplit (`split_and_unsplit`): every kept logit, every live suffix row and
    window row. Both joins really split (the captured keys); on the kernels:
    test_split_steps_on_triton_kernels_interpreted."""
    got, want = split_and_unsplit(family, recent)
    # (bucket, columns, agents at every column): the batch's first prompts do not split (5 of 6)
    assert got[5] == [(8, 8, 2), (8, 8, 8), (8, 8, 8), (8, 16, 2)]
    assert want[5] == [(8, 8, 8), (8, 8, 8), (8, 16, 8)]
    for x, y in zip(got[0], want[0]):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert torch.equal(got[3], want[3]) and got[4] == want[4]
    for x, y in zip(got[1], want[1]):
        for slot, n in enumerate(got[3].tolist()):
            assert torch.equal(_slot_rows(x, got[4], slot, n), _slot_rows(y, want[4], slot, n))
    for x, y in zip(got[2], want[2]):
        assert torch.equal(x, y)


_SPLIT_SCRIPT = r"""
import json
import torch
from tests.pool.test_decode_graph import split_and_unsplit
# the kernels' page tile needs head_dim 64; two layers: the joiners' every column feeds layer 2
got, want = split_and_unsplit("llama", 4, head_dim=64)
err = max(float((x - y).abs().max()) for x, y in zip(got[0], want[0]))
print(json.dumps({"err": err, "keys": got[5], "lens": torch.equal(got[3], want[3]),
                  "triton": __import__("polykv.kernels.dispatch").kernels.dispatch.use_triton(torch.zeros(1))}))
"""


def test_split_steps_on_triton_kernels_interpreted():
    """`split_and_unsplit` on Triton's kernels (interpreter, fresh process): the narrow columns read
    a view of the window segment, the wide agents a gathered copy — the unsplit step's logits
    within the kernels' rounding (different splits of the same sums)."""
    from tests.pool.conftest import run_interpreted

    got = run_interpreted(_SPLIT_SCRIPT)
    assert got["triton"] and got["lens"]
    assert got["keys"] == [[8, 8, 2], [8, 8, 8], [8, 8, 8], [8, 16, 2]]
    assert got["err"] < 1e-3


def test_prefill_budget_follows_the_weights_per_layer():
    """The captured prefill step's padded columns are bounded by what an eager forward's host time
    would buy (PREFILL_FLOPS_PER_LAYER): a SmolLM2-135M-shape layer affords every step up to 32
    agents x PREFILL_MAX columns, a Llama-3-8B-shape layer a few hundred columns."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from polykv.pool import decode_graph

    with torch.device("meta"):
        small = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                             tie_word_embeddings=True))
        big = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                           num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    assert decode_graph.layer_weights(small) == 3540115  # q, k, v, o, gate, up, down, 2 norms
    assert decode_graph.layer_weights(big) == 218114048
    budget = {name: int(decode_graph.PREFILL_FLOPS_PER_LAYER / (2 * decode_graph.layer_weights(m)))
              for name, m in (("small", small), ("big", big))}
    assert budget["small"] >= 32 * decode_graph.PREFILL_MAX and 100 < budget["big"] < 1000


@pytest.mark.gpu
def test_captured_prefill_step_on_cuda(monkeypatch):
    """On CUDA the prefill step is a real captured graph: a batch's prompts and a prompt joining it
    two steps later get the logits of the eager prefill (bf16 tolerance), and the step was captured
    (`prefill_widths`)."""
    from polykv.pool import decode_graph

    model = _llama_2layers().to("cuda", torch.bfloat16)
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False, recent=4)
    doc = pool.add_document(list(range(3, 250)) * 4)
    prompts = [[5, 6, 7], [8, 9], list(range(10, 23)), [24], [25, 26], [27, 28, 29]]
    joiner = list(range(30, 50))

    def run():
        out = []
        with pool.open_batch(doc, capacity=8, seq_capacity=64) as b:
            aids = [b.add(p) for p in prompts]
            out.append(b.step())
            for t in (60, 61):
                b.feed({a: t for a in aids})
                out.append(b.step())
            aids.append(b.add(joiner))
            b.feed({a: 62 for a in aids[:-1]})
            out.append(b.step())
            widths = b._graphs.prefill_widths() if b._graphs is not None else []
        return out, widths

    monkeypatch.setattr(decode_graph, "PREFILL_MAX", 0)
    pool.max_parked_batches = 0  # each batch its own graphs
    want, _ = run()
    monkeypatch.setattr(decode_graph, "PREFILL_MAX", 128)
    got, widths = run()
    # the prompts (13 tokens: 5 of 6 feed several, no split) and the joiner (20: split, it and one
    # other agent at every column)
    assert widths == [(8, 16, 8), (8, 32, 2)]
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for a in w:
            torch.testing.assert_close(g[a].float(), w[a].float(), rtol=0.05, atol=0.05)


@pytest.mark.gpu
def test_captured_mixed_step_on_cuda(monkeypatch):
    """On CUDA a step where a prompt joins agents that verify drafts is one captured mixed step
    (`run_mixed`): the verifiers' logits of the kept columns equal the separate verify step's
    (`run_columns`, with the joiner prefilled apart: PREFILL_MAX 0) within bf16 tolerance."""
    model = _llama_2layers().to("cuda", torch.bfloat16)
    assert _mixed_against_columns(model, monkeypatch) == ("run_mixed", "run_columns")


def test_mixed_step_equals_the_verify_step(monkeypatch):
    """The mixed step's logic on the CPU (static steps, capture=False): `test_captured_mixed_step_on_cuda`'s
    comparison in float32."""
    import functools

    from polykv.pool import decode_graph

    monkeypatch.setattr(decode_graph, "graphs_supported", lambda cache: True)
    monkeypatch.setattr(decode_graph, "DecodeGraphs", functools.partial(decode_graph.DecodeGraphs, capture=False))
    assert _mixed_against_columns(_llama_2layers(), monkeypatch) == ("run_mixed", "run_columns")


def _llama_2layers():
    """A seeded 2-layer random Llama (head_dim 64, 2 q heads / 1 KV head, 256 tokens), float32 on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()


def _mixed_against_columns(model, monkeypatch) -> tuple[str, str]:
    """Run a verify step that a prompt joins twice — with the mixed step, then with prefill steps
    off — and compare the verifiers' logits (3 agents; drafts 2 and 1, the third plain). Returns
    the step function each run used."""
    from polykv.pool import decode_graph

    cls = getattr(decode_graph.DecodeGraphs, "func", decode_graph.DecodeGraphs)  # static_steps: a partial
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False, recent=4)
    doc = pool.add_document(list(range(3, 250)) * 4)
    pool.max_parked_batches = 0  # each batch its own steps
    seen = []
    for name in ("run_mixed", "run_columns"):
        fn = getattr(cls, name)

        def spy(self, *a, _fn=fn, _name=name, **kw):
            out = _fn(self, *a, **kw)
            seen.append((_name, out[0].float().clone()))
            return out

        monkeypatch.setattr(cls, name, spy)

    def run():
        seen.clear()
        with pool.open_batch(doc, capacity=4, seq_capacity=64) as b:
            b.expect_drafts(3)
            aids = [b.add(p) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
            b.step_tokens()
            b.feed({a: 60 for a in aids}, {aids[0]: [70, 71], aids[1]: [73]})  # keep 3 of the 4 columns captured
            b.add(list(range(30, 50)))  # joins the verify step
            b.step_verify()
        return seen[-1]

    got = run()
    monkeypatch.setattr(decode_graph, "PREFILL_MAX", 0)
    want = run()
    torch.testing.assert_close(got[1][:3], want[1][:3], rtol=0.05, atol=0.05)
    return got[0], want[0]
