"""SharedKVPool on a tiny random Llama (fast, CPU): correctness vs the plain model, batching
equivalence, lifecycle, threads (persistence: test_persist.py)."""

import threading

import pytest
import torch

from polykv.cache import storage_bytes
from polykv.pool import DocumentInUseError, SharedKVPool

from .conftest import CharTok, tiny_gemma

DOC = list(range(3, 60)) + list(range(10, 40))  # 87 tokens


def _tv(p_logits, q_logits):
    return 0.5 * (torch.softmax(p_logits, -1) - torch.softmax(q_logits, -1)).abs().sum().item()


def test_f16_pool_matches_full_forward(tiny):
    """With f16 storage the cascade must reproduce a plain forward over doc + suffix (positions,
    masking, per-agent lengths, removal/compaction)."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="f16", v="f16", prefill_chunk=16)
    doc = pool.add_document(DOC)
    sufs = [[5, 6, 7], [8, 9, 10, 11, 12], [3]]
    with pool.open_batch(doc) as b:
        aids = [b.add(s) for s in sufs]
        lg = b.step()
        b.feed({aids[0]: 20, aids[1]: 21})
        lg2 = b.step()
        b.remove(aids[0])
        b.feed({aids[2]: 30, aids[1]: 31})
        lg3 = b.step()
    with torch.no_grad():
        def ref(ids):
            return model(torch.tensor([DOC + ids])).logits[0, -1]
        for a, s in zip(aids, sufs):
            torch.testing.assert_close(lg[a], ref(s), atol=1e-3, rtol=0)
        torch.testing.assert_close(lg2[aids[0]], ref(sufs[0] + [20]), atol=1e-3, rtol=0)
        torch.testing.assert_close(lg3[aids[1]], ref(sufs[1] + [21, 31]), atol=1e-3, rtol=0)
        torch.testing.assert_close(lg3[aids[2]], ref(sufs[2] + [30]), atol=1e-3, rtol=0)
    assert pool.documents()[0]["refs"] == 0


def test_sliding_window_layers_match_full_forward():
    """Gemma-3-style sliding layers: the pool keeps only window-1 prefix rows and still matches."""
    model = tiny_gemma(heads=2, kv_heads=1)
    pool = SharedKVPool(model, CharTok(), k="f16", v="f16", prefill_chunk=8)
    doc_ids = list(range(3, 33))
    doc = pool.add_document(doc_ids)
    d = pool._docs[doc]
    assert d.layers[0].length == 7 and d.prefix_start[0] == 23 and d.layers[2].length == 30
    with pool.open_batch(doc) as b:
        a1, a2 = b.add([40, 41, 42, 43, 44, 45, 46, 47, 48, 49]), b.add([50])
        lg = b.step()
        b.feed({a2: 51})
        lg2 = b.step()
    with torch.no_grad():
        ref1 = model(torch.tensor([doc_ids + list(range(40, 50))])).logits[0, -1]
        ref2 = model(torch.tensor([doc_ids + [50, 51]])).logits[0, -1]
    torch.testing.assert_close(lg[a1], ref1, atol=1e-3, rtol=0)
    torch.testing.assert_close(lg2[a2], ref2, atol=1e-3, rtol=0)


def test_batched_agents_equal_one_at_a_time(tiny):
    """DESIGN §7 TV metric: batched (different suffix lengths in one batch) vs each agent alone."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    doc = pool.add_document(DOC)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21]]
    batched = pool.generate(doc, prompts, max_new_tokens=6)
    single = [pool.generate(doc, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == single
    # teacher-forced logits: TV per position
    tvs = []
    with pool.open_batch(doc) as b:
        aids = [b.add(p) for p in prompts]
        lb = [b.step()]
        for t in range(3):
            b.feed({a: 40 + t for a in aids})
            lb.append(b.step())
    for i, p in enumerate(prompts):
        with pool.open_batch(doc) as b:
            a = b.add(p)
            ls = [b.step()[a]]
            for t in range(3):
                b.feed({a: 40 + t})
                ls.append(b.step()[a])
        tvs += [_tv(lb[s][aids[i]], ls[s]) for s in range(4)]
    assert max(tvs) < 1e-4, tvs


def test_refcount_eviction_reprefill(tiny):
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    a = pool.add_document(DOC, name="a")
    one = pool.documents()[0]["bytes"]
    pool.budget_bytes = int(one * 1.5)  # room for one document
    want = pool.generate(a, [[5, 6]], max_new_tokens=4)
    batch = pool.open_batch(a)
    assert pool.documents()[0]["refs"] == 1
    with pytest.raises(DocumentInUseError):
        pool.remove_document(a)
    with pytest.warns(UserWarning, match="in use"):
        b = pool.add_document(DOC[::-1], name="b")  # a is in use: not evicted, over budget
    assert all(d["resident"] for d in pool.documents())
    batch.close()  # releasing `a` makes it the most recently used: `b` is the LRU victim
    res = {d["id"]: d["resident"] for d in pool.documents()}
    assert res[a] and not res[b]
    with pytest.warns(UserWarning, match="evicted; re-prefilling"):
        pool.generate(b, [[5, 6]], max_new_tokens=2)  # b back, a (unreferenced, LRU) out
    res = {d["id"]: d["resident"] for d in pool.documents()}
    assert res[b] and not res[a]
    with pytest.warns(UserWarning, match="evicted; re-prefilling"):
        again = pool.generate(a, [[5, 6]], max_new_tokens=4)
    assert again == want  # exact re-prefill from the kept token ids
    pool.remove_document(b)
    assert [d["id"] for d in pool.documents()] == [a]
    rep = pool.memory_report()
    assert rep["kv_bytes_shared"] == one and rep["kv_bytes_agents"] == 0 and rep["ratio"] > 2


def test_memory_report_counts_live_agents(tiny):
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(DOC)
    with pool.open_batch(doc, capacity=3, seq_capacity=8) as b:
        for p in ([5, 6], [7], [8, 9, 10]):
            b.add(p)
        b.step()
        rep = pool.memory_report()
        assert rep["agents"] == 3 and rep["kv_bytes_agents"] == b.nbytes() > 0
        # one page per agent (3 reserved up front), each page holding the same bytes per row as
        # the document's rows; plus one scratch row per layer
        pages = b.cache.pages
        assert pages.used_pages() == pages.n_pages == 3
        rows = 3 * pages.page_size + 1
        # (the default preset's recent windows are agent storage too, measured apart: test_ring_pool)
        assert rep["kv_bytes_agents"] - rep["kv_bytes_ring"] == rep["kv_bytes_shared"] * rows // len(DOC)
    assert pool.memory_report()["kv_bytes_agents"] == 0


def test_two_threads_generate(tiny):
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(DOC)
    p1, p2 = [[5, 6, 7], [9]], [[11, 12], [13, 14, 15, 16]]
    want = [pool.generate(doc, p1, max_new_tokens=5), pool.generate(doc, p2, max_new_tokens=5)]
    got, errs = [None, None], []

    def run(i, p):
        try:
            for _ in range(3):
                got[i] = pool.generate(doc, p, max_new_tokens=5)
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(0, p1)), threading.Thread(target=run, args=(1, p2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs and got == want
    assert pool.documents()[0]["refs"] == 0


def test_sampling_seeded_and_stop(tiny):
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(DOC)
    a = pool.generate(doc, [[5, 6]] * 3, max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    b = pool.generate(doc, [[5, 6]] * 3, max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    assert a == b
    assert len(set(a)) > 1  # the same prompt three times: each agent has its own stream (seed + i)
    # agent i of a call draws with seed + i whatever its neighbours are: the second agent of a
    # two-agent call answers as a lone agent seeded one higher
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20)
    pair = pool.generate(doc, [[9, 10, 11], [5, 6]], seed=7, **kw)
    assert pair[1] == pool.generate(doc, [[5, 6]], seed=8, **kw)[0] == a[1]
    full = pool.generate(doc, [[40, 41, 42]], max_new_tokens=8)[0]  # 8 tokens: no eos on the way
    assert len(full) == 8, full
    cut = pool.generate(doc, [[40, 41, 42]], max_new_tokens=8, stop=[full[2:4]])[0]
    assert cut == full[: full.index(full[2:4])].strip()
    assert len(pool.last_generate["answer_ids"][0]) < 8  # the stop string ended the generation


def test_innerq_turbo_keys_and_persistence(tiny, tmp_path):
    """InnerQ scales (turbo K): keys stored as K*s, queries q/s — results stay close to f16 storage,
    and the table round-trips through save/load (hash in the manifest)."""
    from polykv.codecs import InnerQTable

    model, tok = tiny
    torch.manual_seed(3)
    table = InnerQTable(scales={i: (torch.rand(2, 32) + 0.5) for i in range(2)})
    ref = SharedKVPool(model, tok, k="f16", v="f16", prefill_chunk=32)
    pool = SharedKVPool(model, tok, k="turbo8", v="q8_0", innerq=table, prefill_chunk=32)
    doc = ref.add_document(DOC)
    assert pool.add_document(DOC) == doc
    assert pool._docs[doc].layers[0].key_scales is not None
    outs = []
    for p in (ref, pool):
        with p.open_batch(doc) as b:
            a = b.add([5, 6, 7])
            outs.append(b.step()[a])
    assert _tv(outs[0], outs[1]) < 0.02
    pool.save(tmp_path / "iq")
    loaded = SharedKVPool.load(tmp_path / "iq", model, tok)
    torch.testing.assert_close(loaded.innerq.layer(1), table.layer(1))
    with loaded.open_batch(doc) as b:
        a = b.add([5, 6, 7])
        torch.testing.assert_close(b.step()[a], outs[1])


def test_naive_f16_figure_measured_without_a_whole_copy(tiny):
    """add_document measures the naive f16 bytes layer by layer; it must equal the bytes of a real f16
    DynamicCache built alongside the prefill (the benchmarks' shadow copy)."""
    model, tok = tiny
    ids = list(range(3, 100)) * 3
    a = SharedKVPool(model, tok, k="q8_0", v="turbo3", progress=False)
    a.add_document(ids)
    b = SharedKVPool(model, tok, k="q8_0", v="turbo3", progress=False)
    _, shadow = b._add_document_with_f16(ids)
    naive = a.memory_report()["kv_bytes_naive_f16"]
    assert naive == b.memory_report()["kv_bytes_naive_f16"] == storage_bytes(shadow.tensors())
    layers, heads, dim = 2, 2, 32
    assert naive == layers * 2 * heads * len(ids) * dim * 2  # f16 K and V, each row once


def _park(pool, doc, capacity=2):
    with pool.open_batch(doc, capacity=capacity) as b:
        b.add([5, 6])
        b.step()
        cache = b.cache
    assert pool._docs[doc].parked.cache is cache
    return cache


def test_parked_batches_are_counted_and_dropped(tiny):
    """A closed batch's storage parked for reuse is measured (kv_bytes_parked, inside gpu_tier_bytes)
    and freed when its document's layers go (evict, move to the host tier, re-prefill, removal),
    on pool.close(), beyond max_parked_batches (least recently parked first) and before any
    document under GPU budget pressure."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32, host_budget_bytes=10**9)
    docs = [pool.add_document(DOC), pool.add_document(DOC[::-1]), pool.add_document([t + 1 for t in DOC])]
    a, b, c = docs
    cache = _park(pool, a)
    rep = pool.memory_report()
    assert rep["parked_batches"] == 1 and rep["kv_bytes_parked"] == storage_bytes(cache.tensors()) > 0
    assert rep["gpu_tier_bytes"] == rep["kv_bytes_gpu"] + rep["kv_bytes_parked"]
    pool.evict(a)
    assert pool._docs[a].parked is None and pool.memory_report()["kv_bytes_parked"] == 0
    with pytest.warns(UserWarning, match="re-prefilling"):
        _park(pool, a)
    pool.move(a, "host")  # the parked batch read the GPU layers
    assert pool._docs[a].parked is None
    pool.move(a, "gpu")
    _park(pool, a)
    pool.remove_document(a)
    assert pool.memory_report()["parked_batches"] == 0
    pool.max_parked_batches = 1  # a second document's batch pushes the first one out
    _park(pool, b)
    _park(pool, c)
    assert pool._docs[b].parked is None and pool.memory_report()["parked_batches"] == 1
    pool.close()
    assert pool.memory_report()["parked_batches"] == 0 and pool.generate(c, [[5]], max_new_tokens=2)
    # budget pressure: both documents fit, the parked pages do not -> the parked batch goes, no document
    pool.max_parked_batches = 4
    _park(pool, b, capacity=8)
    rep = pool.memory_report()
    pool.gpu_budget_bytes = rep["kv_bytes_gpu"] + rep["kv_bytes_parked"] // 2
    with pool.open_batch(c, capacity=1, seq_capacity=1) as small:
        assert pool._docs[b].parked is None and pool._docs[b].tier == "gpu"
        assert pool._docs[c].parked is None or small.cache is not pool._docs[c].parked.cache
    # an open batch that grows past the budget pushes parked storage out (the engine admits
    # requests by gpu_tier_bytes), and moves no document
    pool.gpu_budget_bytes = None
    _park(pool, b, capacity=8)
    pool.gpu_budget_bytes = pool.memory_report()["gpu_tier_bytes"] + 64
    with pool.open_batch(c, capacity=1) as grow:
        assert pool._docs[b].parked is not None  # still fits
        grow.reserve([200] * 4)
        assert pool._docs[b].parked is None and pool._docs[b].tier == "gpu"


def test_threads_share_parked_batches(tiny):
    """generate from several threads over one document: each batch owns its storage (a parked set is
    handed to one batch at a time), answers equal the sequential ones, one set stays parked."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(DOC)
    ps = [[[5, 6, 7], [9]], [[11, 12], [13, 14, 15, 16]], [[17], [18, 19]]]
    want = [pool.generate(doc, p, max_new_tokens=5) for p in ps]
    got, errs = [None] * len(ps), []
    owners: dict = {}
    real = pool._unpark

    def unpark(d, *args):
        p = real(d, *args)
        if p is not None:
            assert id(p.cache) not in owners.values()  # nobody holds it now
            owners[threading.get_ident()] = id(p.cache)
        return p

    release = pool._release

    def released(batch, parked=None):
        for k in [k for k, v in owners.items() if parked is not None and v == id(parked.cache)]:
            del owners[k]
        release(batch, parked)

    pool._unpark, pool._release = unpark, released

    def run(i):
        try:
            for _ in range(4):
                got[i] = pool.generate(doc, ps[i], max_new_tokens=5)
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs and got == want
    assert pool.documents()[0]["refs"] == 0 and pool.memory_report()["parked_batches"] == 1


def test_a_failed_forward_is_not_parked(tiny, monkeypatch):
    """A batch whose forward raised (a failed capture, a kernel error) frees its storage at close
    instead of handing it to the next batch."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(DOC)
    b = pool.open_batch(doc)
    a = b.add([5, 6])
    b.step()
    monkeypatch.setattr(type(b), "_forward_once", lambda self, group, keep: 1 / 0)
    b.feed({a: 7})
    with pytest.raises(ZeroDivisionError):
        b.step()
    b.close()
    assert pool._docs[doc].parked is None
    monkeypatch.undo()
    _park(pool, doc)


def test_a_parked_batch_over_a_new_budget_is_not_reused(tiny):
    """A budget set (or lowered) after a batch was parked: the next batch starts fresh (holding only
    what its agents need) instead of taking over storage that no longer fits — the engine admits
    requests by gpu_tier_bytes (tests/engine/test_faults.py::test_admission_counts_agent_storage)."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(DOC)
    big = _park(pool, doc, capacity=8)
    rep = pool.memory_report()
    pool.gpu_budget_bytes = rep["kv_bytes_gpu"] + rep["kv_bytes_parked"] // 4
    with pool.open_batch(doc, capacity=1) as b:
        assert b.cache is not big and pool._docs[doc].parked is None
        assert pool.memory_report()["gpu_tier_bytes"] <= pool.gpu_budget_bytes
    pool.gpu_budget_bytes = None
    big = _park(pool, doc, capacity=8)
    with pool.open_batch(doc, capacity=1) as b:  # without the budget: reused
        assert b.cache is big


@pytest.mark.parametrize("rows", [[70], [3, 200], [64, 64, 129]])
def test_growth_bytes_bounds_what_agents_take(tiny, rows):
    """`AgentBatch.growth_bytes(rows)` (the engine's admission count) is at least what agents of
    those suffix rows make the page pools grow by, measured, and 0 once they are held."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(DOC)
    with pool.open_batch(doc, graphs=False) as b:
        before, bound = b.nbytes(), b.growth_bytes(rows)
        aids = [b.add([5 + i]) for i in range(len(rows))]
        b.step()
        for t in range(1, max(rows)):
            b.feed({a: 7 for a, r in zip(aids, rows) if t < r})
            b.step()
        assert [b.suffix_length(a) for a in aids] == rows
        grown = b.nbytes() - before
        assert 0 < grown <= bound, (grown, bound)
        assert b.growth_bytes(rows) == 0


def test_bad_arguments_are_refused(tiny):
    """generate and the budgets refuse values that would otherwise be read as something else (a
    negative max_new_tokens as 0, a negative temperature as greedy); a tokenizer's [1, T] ids tensor
    is a document."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, prefill_chunk=32)
    doc = pool.add_document(torch.tensor([DOC]))
    assert doc == pool.add_document(DOC)  # the same document
    with pytest.raises(ValueError, match="1-D"):
        pool.add_document(torch.tensor([DOC, DOC]))
    for kw, words in (({"max_new_tokens": -5}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
                      ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"),
                      ({"top_k": -1}, "top_k")):
        with pytest.raises(ValueError, match=words):
            pool.generate(doc, [[5, 6]], **{"max_new_tokens": 2, **kw})
    assert pool.generate(doc, [[5, 6]], max_new_tokens=0) == [""]
    for kw in ({"budget_bytes": -1}, {"gpu_budget_bytes": -1}, {"host_budget_bytes": -2}):
        with pytest.raises(ValueError, match="must be >= 0"):
            SharedKVPool(model, tok, **kw)
    with pytest.raises(ValueError, match="must be >= 0"):
        pool.budget_bytes = -1
