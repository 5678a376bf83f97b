"""Residency tiers (polykv/pool/residency.py): GPU / host / evicted moves, both budgets, LRU and
refcounts, the streamed prefix cascade, identical outputs across tiers. On CPU the "gpu" tier is the
pool's device memory and the "host" tier a separate budget on the same memory (real copies)."""

from __future__ import annotations

import pytest
import torch

from polykv.cache import storage_bytes
from polykv.codecs import get_codec
from polykv.kernels.reference import quantize_ref
from polykv.pool import DocumentInUseError, SharedKVPool
from polykv.pool.attention import PrefixStreamer, cascade_attention, streamed_cascade_attention
from polykv.pool.residency import HostLayer, host_nbytes, to_device, to_host

from .conftest import CharTok, tiny_gemma, tiny_llama

DOC = list(range(3, 60)) + list(range(10, 40))  # 87 tokens
DOCS = [DOC, DOC[::-1], [t + 1 for t in DOC], [t + 2 for t in DOC[::-1]]]  # same size, other content
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]


def tiers(pool) -> dict[str, str]:
    return {d["id"]: d["tier"] for d in pool.documents()}


def run_agents(pool, doc, steps: int = 4) -> tuple[list[torch.Tensor], list[list[int]], object]:
    """Logits (per step, [agents, vocab]) and greedy tokens of PROMPTS over `doc` (in its tier: no
    promotion); also the batch's streamer (None on the GPU tier) as it was after the run."""
    logits, toks = [], [[] for _ in PROMPTS]
    with pool.open_batch(doc, graphs=False, promote=False) as b:
        aids = [b.add(p) for p in PROMPTS]
        streamer = b.cache.streamer
        for _ in range(steps):
            out = b.step()
            logits.append(torch.stack([out[a] for a in aids]))
            nxt = {a: int(out[a].argmax()) for a in aids}
            for i, a in enumerate(aids):
                toks[i].append(nxt[a])
            b.feed(nxt)
    return logits, toks, streamer


# --- the streamed cascade against the unchunked one -----------------------------------------------
@pytest.mark.parametrize("k,v,window,P,chunk", [
    ("q8_0", "turbo3", None, 37, 8),
    ("turbo4", "turbo2", None, 64, 16),
    ("f16", "q4_0", 6, 23, 5),       # sliding window: chunks straddle the window edge
    ("q8_0", "turbo3", 9, 8, 3),
])
def test_streamed_cascade_matches_whole_prefix(k, v, window, P, chunk):
    torch.manual_seed(0)
    N, Hq, Hkv, n_q, D, S = 3, 4, 2, 2, 32, 6
    kc, vc = get_codec(k, D), get_codec(v, D)
    pk = quantize_ref(torch.randn(1, Hkv, P, D), kc)
    pv = quantize_ref(torch.randn(1, Hkv, P, D), vc)
    sk = quantize_ref(torch.randn(N, Hkv, S, D), kc)
    sv = quantize_ref(torch.randn(N, Hkv, S, D), vc)
    lens = torch.tensor([S, 3, 0])
    q = torch.randn(N, Hq, n_q, D)
    kw = dict(window=window, prefix_start=40 - P if window else 0, sm_scale=0.2)

    from polykv.cache.layer import CompressedLayer

    layer = CompressedLayer(kc, vc, 1, Hkv)
    layer.k, layer.v, layer.length = pk, pv, P
    (host,) = to_host([layer], chunk, pin=False)
    assert len(host.chunks) == -(-P // chunk) > 1
    want, want_lse = cascade_attention(q, pk, pv, sk, sv, lens, kc, vc, prefix_end=40, **kw)
    st = PrefixStreamer("cpu")
    got, got_lse = streamed_cascade_attention(q, st.chunks(host), sk, sv, lens, kc, vc, prefix_end=40, **kw)
    assert st.chunks_read == len(host.chunks) and st.bytes_read == storage_bytes(host.tensors())
    if window is None:  # full attention: one cascade over the chunks, the whole prefix's values
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got_lse))
    torch.testing.assert_close(got_lse[fin], want_lse[fin], atol=2e-6, rtol=1e-5)


def test_host_copy_round_trip_is_bit_exact():
    model, tok = tiny_gemma(), CharTok()
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    d = pool._docs[pool.add_document(DOC)]
    host = to_host(d.layers, 5, pin=False)
    assert sum(storage_bytes(h.tensors()) for h in host) == host_nbytes(d.layers, 5)
    back = to_device(host, "cpu")
    for a, h, b in zip(d.layers, host, back):
        assert isinstance(h, HostLayer) and h.length == a.length == b.length
        for x, y, z in ((a.keys(), h.keys(), b.keys()), (a.values(), h.values(), b.values())):
            assert torch.equal(x.codes, y.codes) and torch.equal(x.codes, z.codes)
            assert torch.equal(x.scales, y.scales) and torch.equal(x.scales, z.scales)
            assert y.codes.data_ptr() != x.codes.data_ptr()  # a real copy
        assert storage_bytes([b.k.codes, b.k.scales, b.v.codes, b.v.scales]) == \
            storage_bytes([a.k.codes, a.k.scales, a.v.codes, a.v.scales])


# --- identical outputs across tiers ----------------------------------------------------------------
@pytest.mark.parametrize("arch,chunk", [("llama", 16), ("gemma", 5)])
def test_outputs_identical_gpu_vs_host_tier(arch, chunk):
    model = tiny_llama() if arch == "llama" else tiny_gemma(heads=2, kv_heads=1)
    pool = SharedKVPool(model, CharTok(), k="q8_0", v="turbo3", prefill_chunk=32,
                        stream_chunk_rows=chunk, host_budget_bytes=1 << 30)
    doc = pool.add_document(DOC)
    want, want_toks, none = run_agents(pool, doc)
    assert none is None and tiers(pool)[doc] == "gpu"
    pool.move(doc, "host")
    assert tiers(pool)[doc] == "host"
    got, got_toks, st = run_agents(pool, doc)
    assert tiers(pool)[doc] == "host"
    layers = pool._docs[doc].layers
    n_chunks = sum(len(l.chunks) for l in layers)
    assert max(len(l.chunks) for l in layers) > 1  # several chunks merged per layer
    # one read per chunk per layer per forward, shared by all agents: 2 forwards (the prompts of
    # several tokens, then the one-token prompt [8]) at step 1, one decode forward per later step
    assert st.chunks_read == n_chunks * (2 + 3)
    assert got_toks == want_toks
    for g, w in zip(got, want):
        if arch == "llama":  # full attention: bit for bit (Gemma's window layers merge per chunk)
            assert torch.equal(g, w)
        torch.testing.assert_close(g, w, atol=2e-6, rtol=0)  # measured: <= 3e-7
    # generate() over the host tier gives the same answers
    pool.move(doc, "gpu")
    a = pool.generate(doc, ["hello", "xy"], max_new_tokens=6)
    pool.move(doc, "host")
    with pytest.MonkeyPatch.context() as mp:  # generate() over the host tier, streamed
        mp.setattr(pool, "_promote", lambda d: False)
        assert pool.generate(doc, ["hello", "xy"], max_new_tokens=6) == a
    assert tiers(pool)[doc] == "host"
    pool.generate(doc, ["hello"], max_new_tokens=1)  # unbounded GPU budget: promoted on use
    assert tiers(pool)[doc] == "gpu"


# --- transitions, budgets, LRU, refcounts ---------------------------------------------------------
def sized_pool(gpu_docs: float, host_docs: float, **kw):
    """A pool whose GPU budget holds `gpu_docs` DOC-sized documents and host budget `host_docs`."""
    model, tok = tiny_llama(), CharTok()
    probe = SharedKVPool(model, tok, prefill_chunk=32, stream_chunk_rows=32)
    one = probe.documents()[0]["bytes"] if probe.add_document(DOC) else 0
    host_one = host_nbytes(probe._docs[probe.documents()[0]["id"]].layers, 32)
    return SharedKVPool(model, tok, prefill_chunk=32, stream_chunk_rows=32, gpu_budget_bytes=int(one * gpu_docs),
                        host_budget_bytes=int(host_one * host_docs), **kw), one


def test_demote_promote_evict_lru():
    pool, _ = sized_pool(gpu_docs=1.5, host_docs=1.5)
    a = pool.add_document(DOCS[0])
    assert tiers(pool) == {a: "gpu"}
    b = pool.add_document(DOCS[1])
    assert tiers(pool) == {a: "host", b: "gpu"}  # over the GPU budget: LRU a demoted
    c = pool.add_document(DOCS[2])
    assert tiers(pool) == {a: "evicted", b: "host", c: "gpu"}  # host full: older a dropped for b
    with pool.open_batch(b) as batch:  # promotion: b fits once c (unreferenced) is demoted
        assert tiers(pool) == {a: "evicted", b: "gpu", c: "host"} and not batch.cache.streamed
        with pytest.raises(DocumentInUseError):
            pool.move(b, "host")
        with pytest.raises(DocumentInUseError):
            pool.evict(b)
        with pytest.warns(UserWarning, match="re-prefilling"):
            with pool.open_batch(a) as other:  # b in use: a cannot take the GPU, goes to the host
                assert tiers(pool) == {a: "host", b: "gpu", c: "evicted"}
                assert other.cache.streamed
        assert tiers(pool)[b] == "gpu"  # never moved while in use
    rep = pool.memory_report()
    assert rep["tiers"] == {"gpu": 1, "host": 1, "evicted": 1}


def test_lru_order_and_host_budget():
    pool, _ = sized_pool(gpu_docs=1.2, host_docs=2.5)
    ids = [pool.add_document(d) for d in DOCS[:3]]
    assert [tiers(pool)[i] for i in ids] == ["host", "host", "gpu"]
    pool.generate(ids[0], [[5]], max_new_tokens=1)  # promotes ids[0], demotes ids[2]
    assert [tiers(pool)[i] for i in ids] == ["gpu", "host", "host"]
    d = pool.add_document(DOCS[3])  # ids[0] demoted; the host tier drops its LRU: ids[1]
    assert [tiers(pool)[i] for i in ids] + [tiers(pool)[d]] == ["host", "evicted", "host", "gpu"]
    pool.host_budget_bytes = 0  # budgets can be lowered: the next fit evicts host documents
    pool._enforce_budget()
    assert [tiers(pool)[i] for i in ids] == ["evicted"] * 3


def test_victims_are_least_recently_used_in_both_tiers():
    pool, _ = sized_pool(gpu_docs=2.5, host_docs=1.5)
    a, b = pool.add_document(DOCS[0]), pool.add_document(DOCS[1])
    pool.open_batch(a).close()  # a used after b
    c = pool.add_document(DOCS[2])  # one GPU document must go: b, the least recently used
    assert tiers(pool) == {a: "gpu", b: "host", c: "gpu"}
    pool.open_batch(b, promote=False).close()  # b (host) now used after a and c
    d = pool.add_document(DOCS[3])  # a must leave the GPU; the host holds b, used more recently
    assert tiers(pool) == {a: "evicted", b: "host", c: "gpu", d: "gpu"}  # a dropped, b kept


@pytest.mark.filterwarnings("ignore:polykv pool.*in use:UserWarning")  # two documents in use
def test_host_document_streams_when_gpu_is_full():
    pool, _ = sized_pool(gpu_docs=1.2, host_docs=4)
    a, b = pool.add_document(DOCS[0]), pool.add_document(DOCS[1])
    assert tiers(pool) == {a: "host", b: "gpu"}
    with pool.open_batch(b, capacity=1):
        with pool.open_batch(a) as batch:  # b is in use: a cannot be promoted, the batch streams it
            assert tiers(pool)[a] == "host" and batch.cache.streamed
            batch.add([5, 6])
            batch.step()
            assert batch.cache.streamer.chunks_read == sum(len(l.chunks) for l in pool._docs[a].layers)
            with pool.open_batch(a) as second:  # a is read from the host by a batch: stays there
                assert second.cache.streamed
    assert tiers(pool) == {a: "host", b: "gpu"}


def test_documents_twice_the_gpu_budget_served_without_reprefill():
    pool, one = sized_pool(gpu_docs=2, host_docs=4)  # 4 documents = 2x the GPU budget
    ref = SharedKVPool(pool.model, pool.tok, prefill_chunk=32)
    prefills = []
    real = pool._prefill
    pool._prefill = lambda d, **kw: (prefills.append(d.id), real(d, **kw))[1]
    ids = [pool.add_document(d) for d in DOCS]
    assert len(prefills) == 4 and sum(d["bytes"] for d in pool.documents()) >= 2 * pool.gpu_budget_bytes * 0.99
    assert sorted(tiers(pool).values()) == ["gpu", "gpu", "host", "host"]
    for rnd in range(2):
        for i, doc in enumerate(ids):
            got = pool.generate(doc, [[5, 6], [7]], max_new_tokens=3)
            assert got == ref.generate(ref.add_document(DOCS[i]), [[5, 6], [7]], max_new_tokens=3)
            assert pool.memory_report()["gpu_tier_bytes"] <= pool.gpu_budget_bytes
    assert len(prefills) == 4  # every document stayed resident (GPU or host): no re-prefill
    assert all(d["resident"] for d in pool.documents())


def test_memory_report_bytes_per_tier_are_measured():
    pool, _ = sized_pool(gpu_docs=1.5, host_docs=3)
    a, b = pool.add_document(DOCS[0]), pool.add_document(DOCS[1])
    rep = pool.memory_report()
    gpu_t = [t for l in pool._docs[b].layers for t in (l.k.codes, l.k.scales, l.v.codes, l.v.scales)]
    host_t = [c.data for l in pool._docs[a].layers for c in l.chunks]
    assert rep["kv_bytes_gpu"] == storage_bytes(gpu_t) > 0
    assert rep["kv_bytes_host"] == sum(t.untyped_storage().nbytes() for t in host_t) > 0
    assert rep["kv_bytes_shared"] == rep["kv_bytes_gpu"] + rep["kv_bytes_host"]
    assert {d["id"]: d["bytes"] for d in pool.documents()} == {a: rep["kv_bytes_host"], b: rep["kv_bytes_gpu"]}
    assert rep["gpu_tier_bytes"] == rep["kv_bytes_gpu"] and rep["kv_bytes_stream_buffers"] == 0
    with pytest.warns(UserWarning, match="in use"), pool.open_batch(b, capacity=2, seq_capacity=8):
        rep2 = pool.memory_report()
        assert rep2["gpu_tier_bytes"] == rep2["kv_bytes_gpu"] + rep2["kv_bytes_agents"] > rep["gpu_tier_bytes"]
    assert all(d["resident"] == (d["tier"] != "evicted") for d in pool.documents())


def test_budget_bytes_is_the_old_name_of_the_gpu_budget():
    model, tok = tiny_llama(), CharTok()
    assert SharedKVPool(model, tok, budget_bytes=1000).gpu_budget_bytes == 1000
    assert SharedKVPool(model, tok, budget_bytes=1000, gpu_budget_bytes=1000).budget_bytes == 1000
    with pytest.raises(ValueError, match="budget_bytes"):
        SharedKVPool(model, tok, budget_bytes=1000, gpu_budget_bytes=2000)
    pool = SharedKVPool(model, tok, gpu_budget_bytes=5)
    pool.budget_bytes = 7
    assert pool.gpu_budget_bytes == 7 and pool.memory_report()["gpu_budget_bytes"] == 7
    with pytest.warns(UserWarning, match="in use"):
        doc = pool.add_document(DOC)  # alone over the GPU budget, no host tier: kept, with a warning
    with pytest.raises(ValueError, match="tier"):
        pool.move(doc, "disk")


def test_save_and_load_with_tiers(tmp_path):
    pool, _ = sized_pool(gpu_docs=1.5, host_docs=3)
    a, b = pool.add_document(DOCS[0]), pool.add_document(DOCS[1])
    assert tiers(pool) == {a: "host", b: "gpu"}
    want = [pool.generate(x, [[5, 6]], max_new_tokens=3) for x in (a, b)]
    pool.save(tmp_path / "s")
    back = SharedKVPool.load(tmp_path / "s", pool.model, pool.tok, gpu_budget_bytes=pool.gpu_budget_bytes,
                             host_budget_bytes=pool.host_budget_bytes, stream_chunk_rows=32)
    assert sorted(tiers(back).values()) == ["gpu", "host"]
    assert [back.generate(x, [[5, 6]], max_new_tokens=3) for x in (a, b)] == want
    plain = SharedKVPool.load(tmp_path / "s", pool.model, pool.tok)
    assert set(tiers(plain).values()) == {"gpu"}
