"""SharedKVPool with recent windows (polykv.pool.ring) on tiny random models: where R comes from,
R = 0 is today's path bit for bit, a window over q8_0 rows changes nothing when the codec is q8_0
too, per-query windows (one multi-token forward = token by token; speculation and pipelining equal
plain greedy), reuse of a parked batch, and measured bytes."""

import pytest
import torch

from polykv.cache.accounting import storage_bytes
from polykv.pool import SharedKVPool
from tests.pool.conftest import CharTok, tiny_gemma

DOC = list(range(3, 50))
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20]]


@pytest.fixture(params=["llama", "gemma"])
def model_tok(request, tiny):
    return tiny if request.param == "llama" else (tiny_gemma(), CharTok())


def _logits(pool, prompts=PROMPTS, feeds=((30, 31, 32, 33), (34, 35, 36, 37), (38, 39, 40, 41))):
    doc = pool.add_document(DOC)
    out = []
    with pool.open_batch(doc, capacity=len(prompts)) as b:
        aids = [b.add(p) for p in prompts]
        out.append(torch.stack([b.step()[a] for a in aids]))
        for f in feeds:
            b.feed(dict(zip(aids, f)))
            out.append(torch.stack([b.step()[a] for a in aids]))
    return out


def test_where_r_comes_from(tiny):
    from polykv.presets import PRESETS

    model, tok = tiny
    assert SharedKVPool(model, tok).recent == 8  # the default preset's R
    assert SharedKVPool(model, tok, preset="balanced").recent == PRESETS["balanced"].recent == 64
    assert SharedKVPool(model, tok, k="q8_0", v="turbo3").recent == 0  # explicit types: none
    assert SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=5).recent == 5
    assert SharedKVPool(model, tok, preset="max", recent=0).recent == 0
    with pytest.raises(ValueError):
        SharedKVPool(model, tok, recent=-1)


def test_r0_is_the_path_without_windows(tiny):
    """recent=0: no ring tensor, no segment, and the same logits bit for bit as explicit types."""
    model, tok = tiny
    plain = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16)
    zero = SharedKVPool(model, tok, preset="default", recent=0, prefill_chunk=16)
    for x, y in zip(_logits(plain), _logits(zero)):
        assert torch.equal(x, y)
    doc = zero.add_document(DOC)
    with zero.open_batch(doc) as b:
        b.add([5, 6])
        b.step()
        assert b.cache.rings is None and b.cache.ring_tensors() == []
        assert zero.memory_report()["kv_bytes_ring"] == 0


def test_q8_window_over_q8_codec_changes_nothing(model_tok):
    """K and V q8_0 (true space, no InnerQ): a window row is the pool's own row, so every alignment
    of the segments (prompts, decode, left padding, sliding layers) must give R = 0's logits."""
    model, tok = model_tok
    base = _logits(SharedKVPool(model, tok, k="q8_0", v="q8_0", prefill_chunk=16))
    for R in (1, 3, 12):
        got = _logits(SharedKVPool(model, tok, k="q8_0", v="q8_0", recent=R, prefill_chunk=16))
        for x, y in zip(base, got):
            # the same rows, attended in two segments merged by LSE instead of one: float32
            # rounding only (up to 3e-5 on AVX-512 CPUs); a misaligned segment moves logits ~1e-2
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


def test_window_is_read(tiny):
    """With V turbo3 the window changes the logits (it is really read), the more the larger R."""
    model, tok = tiny
    base = _logits(SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=16))
    ring = _logits(SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=4, prefill_chunk=16))
    assert all((x - y).abs().max() > 1e-4 for x, y in zip(base, ring))


def test_window_indices_are_made_once_per_forward(tiny, monkeypatch):
    """The ring rows, positions and masks depend on the forward's slots and lengths and on (R, C)
    only: the first layer makes them (`AgentRings._indices`), the other layers reuse them — one
    set per forward, not one per layer (a captured step's kernels)."""
    from polykv.pool.agent_cache import AgentCache
    from polykv.pool.ring import AgentRings

    model, tok = tiny
    made, begun = [], []
    real, begin = AgentRings._indices, AgentCache.begin
    monkeypatch.setattr(AgentRings, "_indices", staticmethod(lambda *a: made.append(a[4]) or real(*a)))
    monkeypatch.setattr(AgentCache, "begin", lambda self, *a: begun.append(a) or begin(self, *a))
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=3, prefill_chunk=16)
    assert model.config.num_hidden_layers > 1
    _logits(pool)
    assert len(begun) >= 4 and len(made) == len(begun)  # every forward: once, not once per layer


def test_segment_carries_the_real_lengths(model_tok, monkeypatch):
    """The pool hands each layer's segment the agents' suffix lengths it already holds
    (`RecentSegment.real`: no per-layer derivation, four elementwise kernels per sliding layer in a
    captured step); they equal what the segment derives from the older rows' lengths and kv_start,
    in plain steps and multi-token forwards (an agent shorter than its window included)."""
    from polykv.pool import agent_cache

    model, tok = model_tok
    seen = []
    real = agent_cache.cascade_attention

    def spy(*a, recent=None, **kw):
        if recent is not None:
            seen.append(recent.real is not None and torch.equal(
                recent.real, recent._replace(real=None).lengths(a[5])))
        return real(*a, recent=recent, **kw)

    monkeypatch.setattr(agent_cache, "cascade_attention", spy)
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=3, prefill_chunk=16)
    _logits(pool)
    assert len(seen) >= 4 * model.config.num_hidden_layers and all(seen)


def test_one_forward_equals_token_by_token(model_tok):
    """Per-query windows: a prompt fed in one forward and the same tokens fed one per step read the
    same rows (the last logits agree to float rounding)."""
    model, tok = model_tok
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=3, prefill_chunk=16)
    doc = pool.add_document(DOC)
    ids = [9, 10, 11, 12, 13, 14, 15, 16]
    with pool.open_batch(doc) as b:
        one = b.add(ids)
        many = b.add(ids[:1])
        b.step()
        for t in ids[1:]:
            b.feed({many: t})
            b.step()
        b.feed({one: 40, many: 40})
        out = b.step()
        torch.testing.assert_close(out[one], out[many], rtol=1e-5, atol=1e-5)


SPEC = {"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": False, "min_ngram": 1}


def test_speculation_and_pipelining_equal_plain_greedy(model_tok):
    """Verify steps read each query's own window and rejected drafts are rolled back exactly, so
    greedy answers with drafts (and pipelined) equal the plain loop's."""
    model, tok = model_tok
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=4, prefill_chunk=16)
    doc = pool.add_document(DOC * 2)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    plain = pool.generate(doc, prompts, max_new_tokens=24, pipelined=False)
    assert pool.generate(doc, prompts, max_new_tokens=24) == plain
    assert pool.generate(doc, prompts, max_new_tokens=24, speculative=SPEC) == plain
    st = pool.last_generate["speculative"]
    if model_tok[0].config.model_type == "gemma3_text":  # the tiny llama ends on eos after 1-18 tokens
        assert 0 < st["accepted"] < st["drafted"]  # drafts accepted and rejected (rolled back)
    assert pool.generate(doc, prompts, max_new_tokens=24) == plain  # a parked batch, reset


def test_memory_report_counts_the_windows(tiny):
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=6, prefill_chunk=16)
    doc = pool.add_document(DOC)
    with pool.open_batch(doc, capacity=3) as b:
        for p in PROMPTS[:3]:
            b.add(p)
        b.step()
        rep = pool.memory_report()
        ring = storage_bytes(b.cache.ring_tensors())
        # 2 layers x K and V x 2 KV heads x (3 slots x 6 rows + scratch) x 34 bytes (q8_0, D 32: 32 + 2)
        assert rep["kv_bytes_ring"] == ring == 2 * 2 * 2 * (3 * 6 + 1) * 34
        assert rep["kv_bytes_agents"] == storage_bytes(b.cache.tensors())
        pages = storage_bytes([t for st in b.cache.store for t in st.tensors()])
        assert rep["kv_bytes_agents"] == pages + ring and rep["recent"] == 6
        assert pool._gpu_tier_bytes() >= rep["kv_bytes_agents"]


@pytest.mark.parametrize("expect", [True, False])
def test_rejected_drafts_leave_the_windows_exact(model_tok, expect):
    """Verify steps whose drafts are all rejected, between plain steps: each plain step's logits
    equal those of a batch that never saw a draft (the rolled-back rows' slots held window rows
    that the spare rows keep — reserved by expect_drafts, or by feed_drafts when not expected;
    without them the window would be refilled from turbo3 rows)."""
    model, tok = model_tok
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=4, prefill_chunk=16)
    doc = pool.add_document(DOC)
    prompt = [5, 6, 7, 8, 9, 10]
    with pool.open_batch(doc) as a, pool.open_batch(doc) as b:
        x, y = a.add(prompt), b.add(prompt)
        if expect:
            a.expect_drafts(3)
            assert a.cache.rings.spare == 3  # reserved before the first verify step
        # else feed_drafts reserves them
        ta, tb = a.step_tokens()[x], b.step_tokens()[y]
        assert ta == tb
        for i in range(6):
            wrong = [(ta + 1 + j) % 120 + 3 for j in range(3)]  # never the greedy token (checked below)
            a.feed({x: ta}, {x: wrong})
            emitted = a.step_verify()[x]
            assert len(emitted) == 1 and emitted[0] != wrong[0]  # all three rejected, rolled back
            b.feed({y: tb})
            tb = b.step_tokens()[y]
            assert emitted[0] == tb
            a.feed({x: emitted[0]})
            b.feed({y: tb})
            la, lb = a.step()[x], b.step()[y]
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
            ta = tb = int(lb.argmax())


def test_the_store_keeps_the_window(tiny, tmp_path):
    """save records R (manifest codec.recent, only when R > 0); load restores it, load(recent=)
    overrides it; a store without the field loads with R = 0; a bad value is refused by name."""
    from polykv.pool import PoolFormatError
    from tests.pool.test_persist import edit_manifest, read_manifest

    model, tok = tiny
    pool = SharedKVPool(model, tok, recent=5, prefill_chunk=16)
    doc = pool.add_document(DOC)
    want = pool.generate(doc, PROMPTS, max_new_tokens=8)
    pool.save(tmp_path / "s")
    assert read_manifest(tmp_path / "s")["codec"]["recent"] == 5
    loaded = SharedKVPool.load(tmp_path / "s", model, tok)
    assert loaded.recent == 5 and loaded.generate(doc, PROMPTS, max_new_tokens=8) == want
    assert SharedKVPool.load(tmp_path / "s", model, tok, recent=2).recent == 2
    plain = SharedKVPool(model, tok, k="q8_0", v="turbo3")
    plain.add_document(DOC)
    plain.save(tmp_path / "p")
    assert "recent" not in read_manifest(tmp_path / "p")["codec"]
    assert SharedKVPool.load(tmp_path / "p", model, tok).recent == 0
    edit_manifest(tmp_path / "s", lambda m: m["codec"].update(recent=0))
    with pytest.raises(PoolFormatError, match="codec.recent"):
        SharedKVPool.load(tmp_path / "s", model, tok)


def test_host_tier_document_streams_under_the_windows(model_tok):
    """A host-tier document (prefix streamed in chunks) with windows: the resident document's
    logits (full layers: the chunks joined; sliding layers: merged per chunk, float rounding)."""
    model, tok = model_tok
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=3, prefill_chunk=16,
                        host_budget_bytes=1 << 30, stream_chunk_rows=16)
    resident = _logits(pool)
    doc = pool.add_document(DOC)
    pool.move(doc, "host")
    out = []
    with pool.open_batch(doc, capacity=len(PROMPTS), promote=False) as b:
        assert b.cache.streamed and b.cache.rings is not None
        aids = [b.add(p) for p in PROMPTS]
        out.append(torch.stack([b.step()[a] for a in aids]))
        for f in ((30, 31, 32, 33), (34, 35, 36, 37), (38, 39, 40, 41)):
            b.feed(dict(zip(aids, f)))
            out.append(torch.stack([b.step()[a] for a in aids]))
    for x, y in zip(resident, out):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
