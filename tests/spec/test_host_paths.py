"""The cheaper host paths of a speculative step equal the ones they replaced, on random inputs:
the lazily added outputs tree (reads at any point, clears, partial flushes, a deeper fit), drafts
from an agent's tree handle instead of walks, the tree's per-token child dicts against the flat
(id << 32 | token) dict they replaced, prompt lookup's own-token index by min_ngram keys, the
planner's per-agent rows, the memoised step times, the speculator's inlined drafter calls."""

from __future__ import annotations

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from polykv.spec import NgramIndex, PromptLookup, SpecConfig, Speculator, SuffixTree
from polykv.spec.adaptive import StepTimes, WidthPlanner, agent_bucket, expected_tokens

from .test_drafters import _ref_lookup, _RefTree

FAST = settings(max_examples=60, deadline=None, database=None, derandomize=True)


@FAST
@given(st.data(), st.integers(2, 6), st.sampled_from([40, 300, 500_000]), st.sampled_from([0, 3, 1 << 16]))
def test_lazy_tree_equals_the_eager_object_tree(data, vocab, max_nodes, max_pending):
    """Sequences extended in random order, read at random points (every read flushes the log), a
    max_nodes clear, a bounded log flushed in part: every draft, with and without the sequence's
    handle, and the node count equal the object tree's (extended eagerly)."""
    lazy = SuffixTree(max_depth=10, max_match=6, max_nodes=max_nodes, max_pending=max_pending)
    ref = _RefTree(max_depth=10, max_match=6, max_nodes=max_nodes)
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=5)) for _ in range(3)]
    seqs = [[] for _ in prompts]
    hl, hr = [lazy.start() for _ in prompts], [ref.start() for _ in prompts]
    for _ in range(data.draw(st.integers(1, 60))):
        i = data.draw(st.integers(0, len(seqs) - 1))
        toks = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5))
        seqs[i] += toks
        lazy.extend_all(hl[i], toks)
        for t in toks:
            ref.extend(hr[i], t)
        if data.draw(st.integers(0, 4)) == 0:  # a read: the log is added now
            j, k = data.draw(st.integers(0, len(seqs) - 1)), data.draw(st.integers(1, 4))
            ctx = prompts[j] + seqs[j]
            want = ref.propose(ctx, k)
            assert lazy.propose(ctx, k, hl[j]) == want
            assert lazy.propose(ctx, k) == want
            assert lazy.nodes == ref.nodes
    assert lazy.nodes == ref.nodes


@FAST
@given(st.data(), st.integers(1, 4))
def test_a_deeper_fit_adds_the_log_at_the_old_depth(data, k):
    """fit(k) while tokens are logged: they are added at the depth they were extended at, then the
    tree deepens — the drafts of a tree that added every token at once."""
    eager = SuffixTree(max_depth=24, max_match=4, max_pending=0)  # max_pending 0: added at extend
    lazy = SuffixTree(max_depth=24, max_match=4)
    for t in (eager, lazy):
        t.fit(1)
    hs = [(eager.start(), lazy.start(), []) for _ in range(3)]
    for step in range(data.draw(st.integers(1, 40))):
        he, hl, seq = hs[data.draw(st.integers(0, 2))]
        toks = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
        seq += toks
        eager.extend_all(he, toks)
        lazy.extend_all(hl, toks)
        if step == 10:
            eager.fit(k + 2)
            lazy.fit(k + 2)
    assert lazy.depth == eager.depth
    for _, hl, seq in hs:
        for j in range(1, k + 3):
            assert lazy.propose(seq, j, hl) == eager.propose(seq, j)
    assert lazy.nodes == eager.nodes


class _FlatTree(SuffixTree):
    """The outputs tree before the per-token child dicts (polykv 0a6ab2d): one dict keyed by
    (id << 32 | token), every logged entry added token by token with the clear checked each time."""

    def _clear(self):
        super()._clear()
        self._child = {}

    def flush(self, tokens=None):
        while self._pending and (tokens is None or tokens > 0):
            handle, toks = self._pending.popleft()
            self._pending_tokens -= len(toks)
            if tokens is not None:
                tokens -= len(toks)
            self._add(handle, toks)

    def _add(self, handle, tokens):
        for t in tokens:
            if len(self._count) > self.max_nodes:
                self.generation += 1
                self._clear()
            if handle[0] != self.generation:
                handle[0], handle[1] = self.generation, []
            child, count, total, best, tok = self._child, self._count, self._total, self._best, self._tok
            t = int(t)
            live = handle[1]
            new = []
            for node in live + [0]:
                key = node << 32 | t
                c = child.get(key)
                if c is None:
                    c = child[key] = len(count)
                    count.append(1)
                    total.append(0)
                    best.append(-1)
                    tok.append(t)
                    if best[node] < 0:
                        best[node] = c
                else:
                    n = count[c] = count[c] + 1
                    b = best[node]
                    if c != b and (n > count[b] or (n == count[b] and c < b)):
                        best[node] = c
                total[node] += 1
                new.append(c)
            handle[1] = new[1:] if len(live) >= self.depth - 1 else new

    def _walk(self, pattern):
        node = 0
        for t in pattern:
            node = self._child.get(node << 32 | int(t))
            if node is None:
                return None
        return node


@FAST
@given(st.data(), st.integers(2, 7), st.integers(2, 12), st.sampled_from([25, 120, 500_000]),
       st.sampled_from([0, 4, 1 << 16]))
def test_token_child_dicts_equal_the_flat_dict_tree(data, vocab, depth, max_nodes, max_pending):
    """Entries of several tokens from several sequences, clears falling inside an entry (small
    max_nodes: `flush`'s token-by-token path), stale handles, partial flushes, a deeper fit, reads
    at random points: the node ids, counts, totals, best children and tokens, the generation and
    every draft (with the handle and walked) equal the flat dict tree's."""
    new = SuffixTree(max_depth=depth, max_match=data.draw(st.integers(1, depth)), max_nodes=max_nodes,
                     max_pending=max_pending)
    old = _FlatTree(max_depth=new.max_depth, max_match=new.max_match, max_nodes=max_nodes, max_pending=max_pending)
    k0 = data.draw(st.integers(1, 4))
    new.fit(k0)
    old.fit(k0)
    seqs = [[] for _ in range(data.draw(st.integers(1, 4)))]
    hn, ho = [new.start() for _ in seqs], [old.start() for _ in seqs]
    for step in range(data.draw(st.integers(1, 50))):
        i = data.draw(st.integers(0, len(seqs) - 1))
        if data.draw(st.integers(0, 19)) == 0:  # a new sequence in this slot (its old handle left stale)
            seqs[i], hn[i], ho[i] = [], new.start(), old.start()
        toks = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        seqs[i] += toks
        new.extend_all(hn[i], toks)
        old.extend_all(ho[i], toks)
        if step == 7:
            k = data.draw(st.integers(1, 6))
            new.fit(k)
            old.fit(k)
        if data.draw(st.integers(0, 3)) == 0:
            j, k = data.draw(st.integers(0, len(seqs) - 1)), data.draw(st.integers(1, 5))
            probe = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
            for ctx, h_new, h_old in ((seqs[j], hn[j], ho[j]), (probe, None, None)):
                assert new.propose(ctx, k, h_new) == old.propose(ctx, k, h_old)
            assert (new._count, new._total, new._best, new._tok) == (old._count, old._total, old._best, old._tok)
            assert new.generation == old.generation and new.depth == old.depth
    assert new.nodes == old.nodes
    assert (new._count, new._total, new._best, new._tok) == (old._count, old._total, old._best, old._tok)
    for j, seq in enumerate(seqs):
        assert new.propose(seq, 4, hn[j]) == old.propose(seq, 4, ho[j]) == new.propose(seq, 4)


@FAST
@given(st.data(), st.integers(2, 8), st.integers(1, 3), st.integers(0, 4))
def test_prompt_lookup_own_index_equals_a_scan(data, vocab, min_ngram, extra):
    """Contexts grown by appending and asked at random points (the index catches up lazily), now
    and then rewritten: every draft equals the full scan's, with and without a document."""
    max_ngram = min_ngram + extra
    doc = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=60))
    for index in (NgramIndex(doc), None):
        pl = PromptLookup(index, max_ngram, min_ngram)
        ctx = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
        for _ in range(data.draw(st.integers(1, 40))):
            ctx.extend(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4)))
            if data.draw(st.integers(0, 9)) == 0:
                ctx[-3:] = data.draw(st.lists(st.integers(0, vocab - 1), min_size=3, max_size=3))
            if data.draw(st.booleans()):
                k = data.draw(st.integers(1, 5))
                assert pl.propose(ctx, k) == _ref_lookup(index, ctx, k, max_ngram, min_ngram)


def _old_best(planner: WidthPlanner, agents, n_agents):
    """WidthPlanner.best before the per-agent rows: one expected_tokens call per (agent, width)."""
    n = max(len(agents), n_agents)
    costs = planner.step_costs(n)
    others = n - len(agents)
    scores = [(others + sum(expected_tokens(a, min(k, w)) for a, k in agents)) / max(costs[w], 1e-12)
              for w in range(planner.k_max + 1)]
    w = 0
    for j in range(1, planner.k_max + 1):
        if scores[j] > scores[w] * 1.0001:
            w = j
    return w, scores


acceptance = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.5, 1.0, 1 / 3]))


@FAST
@given(st.lists(st.tuples(acceptance, st.integers(0, 6)), max_size=40), st.integers(1, 6), st.integers(0, 8),
       st.lists(st.floats(0.5, 3.0), min_size=0, max_size=7))
def test_planner_rows_equal_expected_tokens_per_width(agents, k_max, others, times):
    """The same scores bit for bit (same operations, same order of the sum) and the same width."""
    t = StepTimes()
    for w, s in enumerate(times):
        t.observe(len(agents) + others or 1, w, s)
    planner = WidthPlanner(k_max, t, prior=0.1)
    assert planner.best(agents, len(agents) + others) == _old_best(planner, agents, len(agents) + others)


@FAST
@given(st.lists(st.tuples(st.sampled_from([1, 3, 8, 30]), st.integers(0, 4), st.floats(0.1, 5.0)),
                max_size=80), st.integers(1, 6))
def test_step_times_memo_equals_a_fresh_estimate(observations, window):
    """seen() kept between observations equals the median / min of each width's window now."""
    t = StepTimes(window=window)
    obs: dict = {}
    for agents, w, s in observations:
        t.observe(agents, w, s)
        obs.setdefault((agent_bucket(agents), w), []).append(s)
        for b in {agent_bucket(a) for a, _, _ in observations}:
            want = {}
            for (bb, ww), xs in sorted(obs.items()):
                xs = xs[-window:]
                if bb == b:
                    want[ww] = statistics.median(xs) if len(xs) >= 3 else min(xs)
            assert t.seen(b) == want


def _old_propose_all(spec: Speculator, limits: dict, agents=None) -> dict:
    """Speculator.propose_all at f6fd9db: each agent's drafts through `_draft` (prompt lookup
    called directly), `length.acceptance` read through its property."""
    out = {}
    adaptive, wants, fixed_w = [], [], 0
    get, draft = spec._agents.get, spec._draft
    for key, limit in limits.items():
        st_ = get(key)
        if st_ is None:
            continue
        length = st_.length
        k = min(length.k_max, int(limit))
        drafter = st_.drafter
        if type(drafter) is PromptLookup and k > 0:
            d = out[key] = drafter.propose(st_.context, k)
        else:
            d = out[key] = draft(st_, k)
        if length.fixed:
            fixed_w = max(fixed_w, len(d))
        else:
            length.planned = True
            adaptive.append(key)
            wants.append((length.acceptance, len(d)))
    if spec.planner is None or not adaptive:
        return out
    w = spec.planner.choose(wants, agents if agents is not None else len(limits))
    spec.widths[w] += 1
    w = max(w, fixed_w)
    for k, (_, n) in zip(adaptive, wants):
        if n > w:
            out[k] = out[k][:w]
    return out


def _old_record(spec: Speculator, key, emitted: list[int], drafted: int) -> None:
    """Speculator.record at f6fd9db (AdaptiveLength.update called for every drafting agent)."""
    st_ = spec._agents.get(key)
    if st_ is None:
        return
    st_.context.extend(map(int, emitted))
    if spec.tree is not None:
        spec.tree.extend_all(st_.handle, emitted)
    if drafted:
        acc = len(emitted) - 1
        st_.length.update(drafted, acc)
        spec.drafted += drafted
        spec.accepted += acc
        spec.tokens += len(emitted)
        spec.agent_steps += 1


@FAST
@given(st.data(), st.sampled_from(["prompt_lookup", "suffix_tree"]), st.integers(1, 5), st.integers(2, 10),
       st.sampled_from([None, 0.1, 0.6]), st.booleans())
def test_propose_all_and_record_equal_the_per_agent_calls(data, method, k, vocab, cost, adaptive):
    """propose_all with its drafters inlined (prompt lookup, the suffix tree and its fallback) and
    record with the planned agents' update inlined, against the per-agent calls they replaced: the
    same drafts, widths, acceptance floats, back-off state and stats over random steps (agents
    asking for their own length now and then, agents leaving, timed steps)."""
    doc = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=80))
    cfg = SpecConfig(method=method, num_draft_tokens=k, adaptive=adaptive, cost_per_draft=cost)
    new, old = (Speculator(NgramIndex(doc), SuffixTree(), times=StepTimes()) for _ in range(2))
    live = list(range(data.draw(st.integers(1, 6))))
    for i in live:
        prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
        new.add(i, prompt, cfg)
        old.add(i, prompt, cfg)
    for _ in range(data.draw(st.integers(1, 30))):
        limits = {i: data.draw(st.integers(0, 5)) for i in live}
        if data.draw(st.integers(0, 4)) == 0:  # the engine's way: each agent's own length
            a = {i: new.propose(i, limits[i]) for i in live}
            b = {i: old.propose(i, limits[i]) for i in live}
        else:
            a, b = new.propose_all(limits), _old_propose_all(old, limits)
        assert a == b
        for i in list(live):
            emitted = a[i][: data.draw(st.integers(0, len(a[i])))] + [data.draw(st.integers(0, vocab - 1))]
            new.record(i, emitted, len(a[i]))
            _old_record(old, i, emitted, len(a[i]))
            if data.draw(st.integers(0, 15)) == 0:
                new.remove(i)
                old.remove(i)
                live.remove(i)
        if not live:
            break
        w, s = max(map(len, a.values()), default=0), data.draw(st.floats(1e-4, 1e-2))
        new.observe_step(w, s, len(a))
        old.observe_step(w, s, len(a))
        for i in live:
            x, y = new._agents[i].length, old._agents[i].length
            assert (x.acc, x.rej, x.wait, x.probe, x.planned) == (y.acc, y.rej, y.wait, y.probe, y.planned)
            assert new._agents[i].context == old._agents[i].context
    got, want = new.stats(), old.stats()
    got.pop("full_accepts"), want.pop("full_accepts")  # counted by record only (the old one never)
    assert got == want
