"""Pipelined decoding (`AgentBatch.step_tokens_ahead`, `SharedKVPool.generate(pipelined=True)`): the
ids a step chooses feed the next step on the device and reach the host one step late. It must give
the synchronous loop's tokens exactly (greedy and seeded sampling), keep no token an agent chose
after it stopped, and leave lengths and pages as if the stopped agent had never taken the extra
step. Run on the eager path (CPU default) and through the static decode step (`capture=False`: the
code a CUDA graph captures)."""

import functools
import itertools

import pytest
import torch

from polykv.pool import SharedKVPool
from polykv.pool.agents import AgentBatch, _ON_DEVICE
from polykv.pool.decode_graph import DecodeGraphs

DOC = list(range(3, 50)) * 2
PROMPTS = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15, 16]]  # 5 agents: bucket 8
N = 12


@pytest.fixture(params=["eager", "static"])
def path(request, monkeypatch):
    """eager: the CPU default (no captured steps); static: batches build their decode steps as on
    CUDA, run eagerly (`DecodeGraphs(capture=False)`), so the feedback goes through `_replay`."""
    if request.param == "static":
        from polykv.pool import decode_graph

        monkeypatch.setattr(decode_graph, "graphs_supported", lambda cache: True)
        monkeypatch.setattr(decode_graph, "DecodeGraphs", functools.partial(DecodeGraphs, capture=False))
    return request.param


def _pool(tiny):
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", prefill_chunk=32)
    return pool, pool.add_document(DOC)


def _consistent(batch: AgentBatch) -> None:
    """Live agents own slots 0..n-1, each slot's length is its agent's processed tokens and it holds
    exactly the pages that length needs; every other slot is empty, no page is lost or shared."""
    cache, pages, n = batch.cache, batch.cache.pages, len(batch)
    for aid in batch.agents():
        a = batch._agents[aid]
        assert a.slot < n and int(cache.lens[a.slot]) == len(a.tokens)
        assert len(pages.owned[a.slot]) == pages.pages_for(len(a.tokens))
    assert cache.lens[n:].eq(0).all() and all(not o for o in pages.owned[n:])
    held = [p for o in pages.owned for p in o]
    assert len(set(held)) == len(held) and sorted(held + pages.free_pages) == list(range(pages.n_pages))


@pytest.fixture
def checked_removals(monkeypatch):
    """Check `_consistent` after every removal; count the removals."""
    removed = []
    remove = AgentBatch.remove

    def checked(self, aid):
        remove(self, aid)
        _consistent(self)
        removed.append(aid)

    monkeypatch.setattr(AgentBatch, "remove", checked)
    return removed


def _free_run(pool, doc, monkeypatch, **kw):
    """Answers of a run nothing stops but max_new_tokens (no eos id)."""
    monkeypatch.setattr("polykv.generation.stop_token_ids", lambda tok, model=None: set())
    pool.generate(doc, PROMPTS, max_new_tokens=N, pipelined=False, **kw)
    return pool.last_generate["answer_ids"]


def _eos_ids(free: list[list[int]]) -> set[int]:
    """One or two stop ids that end the agents at the most different steps, one of them (at least)
    by max_new_tokens: the first such set in a fixed order (deterministic)."""
    best = (0, set())
    tokens = sorted({t for ids in free for t in ids})
    for k in (1, 2):
        for eos in itertools.combinations(tokens, k):
            lens = {len(_cut(ids, set(eos))) for ids in free}
            if N in lens and len(lens) > best[0]:
                best = (len(lens), set(eos))
    return best[1]


def _cut(ids: list[int], eos: set[int]) -> list[int]:
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


SAMPLED = dict(temperature=1.0, top_p=0.9, top_k=20, seed=11)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_pipelined_equals_synchronous_with_eos_at_different_steps(tiny, path, monkeypatch, sampling,
                                                                  checked_removals):
    """Agents ending on an eos id at different steps (one by max_new_tokens): pipelined answers equal
    the synchronous loop's token for token, and both equal the free run cut before the first eos id
    — no token chosen after an agent stopped (its extra step's token) is kept. Every removal leaves
    lengths and pages consistent. Each agent that stopped on eos cost at most one extra step."""
    pool, doc = _pool(tiny)
    free = _free_run(pool, doc, monkeypatch, **sampling)
    eos = _eos_ids(free)
    want = [_cut(ids, eos) for ids in free]
    assert len({len(w) for w in want}) >= 3 and N in {len(w) for w in want}  # stops at different steps
    monkeypatch.setattr("polykv.generation.stop_token_ids", lambda tok, model=None: eos)
    pool.generate(doc, PROMPTS, max_new_tokens=N, pipelined=False, **sampling)
    sync = pool.last_generate
    checked_removals.clear()
    pool.generate(doc, PROMPTS, max_new_tokens=N, **sampling)
    piped = pool.last_generate
    assert sync["answer_ids"] == want and sync["pipelined"] is False
    assert piped["answer_ids"] == want and piped["pipelined"] is True
    assert sorted(checked_removals) == list(range(len(PROMPTS)))  # every agent left the batch
    # the last agent ends by count: no extra step for it; one step ahead is the most it costs
    assert piped["steps"] == sync["steps"]
    assert sum(piped["step_ms"]["count_by_width"].values()) == piped["steps"] - 1


def test_pipelined_equals_synchronous_with_stop_strings(tiny, path, monkeypatch):
    """A stop string ends agents at different steps (found in the decoded text one step late on the
    host): the same answers as the synchronous loop, cut before the stop string."""
    pool, doc = _pool(tiny)
    free = _free_run(pool, doc, monkeypatch)
    text = [pool.tok.decode(ids) for ids in free]
    stops = sorted({text[0][3:5], text[2][6:8]})
    got = {}
    for pipelined in (False, True):
        got[pipelined] = (pool.generate(doc, PROMPTS, max_new_tokens=N, stop=stops, pipelined=pipelined),
                          pool.last_generate["answer_ids"])
    assert got[True] == got[False]
    lengths = [len(ids) for ids in got[True][1]]
    assert len(set(lengths)) >= 2 and min(lengths) < N
    for s in got[True][0]:
        assert not any(x in s for x in stops)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_count_stops_waste_no_step(tiny, path, monkeypatch, max_new_tokens):
    """Agents that end by max_new_tokens leave the batch before the step their last token would
    feed is launched: as many steps as the synchronous loop, the same tokens."""
    pool, doc = _pool(tiny)
    monkeypatch.setattr("polykv.generation.stop_token_ids", lambda tok, model=None: set())
    pool.generate(doc, PROMPTS, max_new_tokens=max_new_tokens, pipelined=False)
    sync = pool.last_generate
    pool.generate(doc, PROMPTS, max_new_tokens=max_new_tokens)
    assert pool.last_generate["answer_ids"] == sync["answer_ids"]
    assert all(len(a) == max_new_tokens for a in sync["answer_ids"])
    assert pool.last_generate["steps"] == sync["steps"] == max_new_tokens


def test_step_tokens_ahead_equals_step_tokens_and_feed(tiny, path):
    """At the batch level: the same ids as step_tokens + feed, through a removal (the last slot's fed
    token moves with it on the device), an agent added between steps (a prompt prefill beside the
    device-fed decoders), a sampled agent among greedy ones, and an explicit feed on top of a
    device-fed token (two pending tokens: the eager forward reads the feedback row). Token lists
    hold `_ON_DEVICE` until the ids are read, the real ids after; lengths and pages as the
    synchronous batch's."""
    pool, doc = _pool(tiny)
    ref_pool, _ = _pool(tiny)
    with pool.open_batch(doc, capacity=8) as b, ref_pool.open_batch(doc, capacity=8) as r:
        aids = [b.add(p) for p in PROMPTS]
        assert aids == [r.add(p) for p in PROMPTS]
        for x in (b, r):
            x.set_sampling(aids[1], temperature=0.8, top_p=0.9, seed=5)

        def before(x: AgentBatch, k: int) -> None:
            """What happens before step k (to either batch)."""
            if k == 2:  # agents 0 and 2 leave (pipelined: while step 1, which fed them, is out)
                x.remove(aids[0])
                x.remove(aids[2])
            if k == 3:
                assert x.add([20, 21, 22]) == len(PROMPTS)
            if k == 5:  # a token of the caller's on top of the fed one (pipelined: a device-fed one)
                x.feed({aids[3]: 33})

        want = [r.step_tokens()]
        for k in range(1, 7):
            r.feed(want[-1])
            before(r, k)
            want.append(r.step_tokens())
        ahead = b.step_tokens_ahead()
        assert b._agents[aids[0]].pending == [_ON_DEVICE]
        got = []
        for k in range(1, 7):
            before(b, k)
            nxt = b.step_tokens_ahead()  # step k, launched before step k - 1 is read
            got.append(ahead.result())
            ahead = nxt
        got.append(ahead.result())
        assert got == want and len(want[3]) == 4
        assert b._agents[aids[1]].tokens == r._agents[aids[1]].tokens  # the sampled agent's stream
        for a in b.agents():
            assert b.tokens(a)[: len(r.tokens(a))] == r.tokens(a) and _ON_DEVICE not in b.tokens(a)
        assert torch.equal(b.cache.lens, r.cache.lens) and b.cache.pages.owned == r.cache.pages.owned
        _consistent(b)


def test_pending_tokens_ready_and_read_once(tiny):
    """`PendingTokens`: ready on CPU at once; `result` reads once (the same dict again) and writes the
    ids where `_ON_DEVICE` stood — the processed tokens, or the pending one (then an ordinary pending
    token); a batch's `tokens` reads every step not read yet."""
    pool, doc = _pool(tiny)
    with pool.open_batch(doc) as b:
        a = b.add([5, 6])
        first = b.step_tokens_ahead()
        second = b.step_tokens_ahead()
        assert first.ready() and first.agents == [a] and b._agents[a].tokens[-1] == _ON_DEVICE
        toks = b.tokens(a)  # reads both
        assert toks == [5, 6, first.result()[a]] and first.result() is first.result()
        assert b._agents[a].pending == [second.result()[a]] and b._ahead == []
        with pytest.raises(ValueError, match="not negative"):
            b.feed({a: -1})
        b.step_tokens()  # takes the pending token, feeds nothing
        idle = b.step_tokens_ahead()  # no agent has a pending token: an empty step
        assert idle.result() == {} and idle.agents == [] and b._agents[a].pending == []


def _launches_then_reads(pool, doc, prompts, steps, guard):
    """(synchronous tokens, pipelined tokens) of `steps` decode steps after the prompts' prefill:
    first a batch of step_tokens + feed (it captures the steps on CUDA and parks them), then one of
    step_tokens_ahead whose launches from step 2 on run inside `guard()` (the reads outside)."""
    with pool.open_batch(doc, capacity=8, seq_capacity=64) as b:
        aids = [b.add(p) for p in prompts]
        want = [b.step_tokens()]
        for _ in range(steps):
            b.feed(want[-1])
            want.append(b.step_tokens())
    with pool.open_batch(doc, capacity=8, seq_capacity=64) as b:
        assert [b.add(p) for p in prompts] == aids
        ahead = b.step_tokens_ahead()
        got = []
        for k in range(steps):
            if k == 0:  # step 1 refreshes the page table the prefill changed (a blocking copy)
                nxt = b.step_tokens_ahead()
            else:
                with guard():
                    nxt = b.step_tokens_ahead()
            got.append(ahead.result())
            ahead = nxt
        got.append(ahead.result())
        captures = b.graph_captures
    return want, got, captures


def test_launch_then_read_on_cpu(tiny, path):
    """The loop of the GPU test below, on CPU (no guard): the same tokens."""
    import contextlib

    pool, doc = _pool(tiny)
    want, got, captures = _launches_then_reads(pool, doc, PROMPTS, 6, contextlib.nullcontext)
    assert got == want and captures == 0


@pytest.mark.gpu
def test_pipelined_launch_never_synchronises():
    """On CUDA, a pipelined launch (a replayed captured step: upload from a pinned buffer, feedback
    copy, replay, id copy to pinned memory, event) makes no synchronising call — torch's sync debug
    mode raises on one (a blocking copy, a stream synchronisation, .item()) — and the pipelined loop
    chooses the synchronous loop's tokens, replaying the steps it captured."""
    import contextlib

    from transformers import LlamaConfig, LlamaForCausalLM

    @contextlib.contextmanager
    def no_sync():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False)
    doc = pool.add_document(list(range(3, 250)) * 4)
    want, got, captures = _launches_then_reads(pool, doc, PROMPTS, 8, no_sync)
    assert got == want and captures == 0


def test_replay_fills_the_pinned_buffers_in_turn(tiny):
    """A replay uploads without waiting, so the next one must not refill the buffer that copy may
    still read: consecutive replays of a step fill its two host buffers in turn (each keeps the
    tokens and positions it was filled with until the replay after next)."""
    pool, doc = _pool(tiny)
    with pool.open_batch(doc, capacity=2, seq_capacity=16) as b:
        b._graphs = DecodeGraphs(pool.model, b.cache, pool._pad_id, capture=False)
        aids = [b.add([5, 6]), b.add([7])]
        b.step_tokens()
        cap = None
        for t in (40, 41):
            b.feed({a: t for a in aids})
            b.step_tokens()
            cap = cap or b._graphs._graphs[(2, 1)]
        tokens = sorted(h[0, :, 0].tolist() for h in cap.hosts)
        positions = sorted(h[2, :, 0].tolist() for h in cap.hosts)
        assert tokens == [[40, 40], [41, 41]]
        assert positions == [[len(DOC) + 2, len(DOC) + 1], [len(DOC) + 3, len(DOC) + 2]]


def test_drafts_verified_after_a_device_fed_token(tiny, path):
    """Drafts may follow a token the host has not read (`feed_drafts` after `step_tokens_ahead`):
    the verify forward takes it from the feedback row (the captured multi-column step or the eager
    forward) and emits what the synchronous step_tokens + feed + feed_drafts emits; rejected drafts
    are rolled back the same way."""
    pool, doc = _pool(tiny)
    ref_pool, _ = _pool(tiny)
    drafts = [[40, 41, 42], [], [43], [44, 45], [46]]
    with pool.open_batch(doc, capacity=8) as b, ref_pool.open_batch(doc, capacity=8) as r:
        aids = [b.add(p) for p in PROMPTS]
        assert aids == [r.add(p) for p in PROMPTS]
        first = r.step_tokens()
        r.feed(first)
        ahead = b.step_tokens_ahead()
        for x in (b, r):
            x.feed_drafts({a: d for a, d in zip(aids, drafts)})
        got, want = b.step_verify(), r.step_verify()
        assert ahead.result() == first and got == want
        assert torch.equal(b.cache.lens, r.cache.lens)
        assert [b.tokens(a) for a in aids] == [r.tokens(a) for a in aids]
