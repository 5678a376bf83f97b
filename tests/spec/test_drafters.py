"""Drafters, acceptance rules and the adaptive length, without a model."""

from __future__ import annotations

import random

import pytest
import torch

from polykv.spec import (AdaptiveLength, NgramIndex, PromptLookup, SpecConfig, SuffixTree, SuffixTreeDrafter,
                         accept_greedy, accept_sampled, suffix_array)
from polykv.spec.adaptive import expected_tokens


@pytest.mark.parametrize("n,vocab,seed", [(1, 3, 0), (17, 2, 1), (63, 5, 2), (200, 3, 3), (301, 40, 4)])
def test_suffix_array_matches_sorting(n, vocab, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(n)]
    want = sorted(range(n), key=lambda i: ids[i:])
    assert suffix_array(ids).tolist() == want


def test_ngram_index_finds_every_occurrence():
    rng = random.Random(5)
    ids = [rng.randrange(4) for _ in range(150)]
    idx = NgramIndex(ids)
    for n in (1, 2, 3, 5):
        for start in range(0, 140, 7):
            pat = ids[start:start + n]
            brute = [i for i in range(len(ids) - n + 1) if ids[i:i + n] == pat]
            assert idx.occurrences(pat, limit=10**6) == brute
    assert idx.occurrences([9, 9]) == []


def test_ngram_index_refuses_a_bad_saved_array():
    with pytest.raises(ValueError):
        NgramIndex([1, 2, 3], torch.tensor([0, 0, 1]))


def test_prompt_lookup_continues_the_document_and_the_agent():
    doc = [10, 11, 12, 13, 14, 15, 16, 10, 11, 99]
    pl = PromptLookup(NgramIndex(doc), max_ngram=4, min_ngram=2)
    assert pl.propose([5, 12, 13], 3) == [14, 15, 16]  # document continuation
    assert pl.propose([5, 11, 12, 13, 14], 2) == [15, 16]
    assert pl.propose([7, 8], 3) == []  # nowhere
    # the agent's own tokens: [1 2 3 4 ... 1 2] -> 3 4
    assert pl.propose([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]
    assert PromptLookup(None).propose([1, 2, 3, 4, 9, 1, 2], 5) == [3, 4, 9, 1, 2]
    # earliest document occurrence when several match
    assert pl.propose([3, 10, 11], 1) == [12]


def test_suffix_tree_follows_the_most_frequent_continuation():
    tree = SuffixTree(max_depth=8, min_share=0.3)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 7], [9, 2, 3, 4, 5]):
        tree.extend_all(tree.start(), seq)
    assert tree.propose([0, 1, 2], 3) == [3, 4]  # after "1 2": 3, then 4 (2 of 3 visits), then nothing
    assert tree.propose([0, 2], 3) == [3, 4, 5]  # after "2": 3, 4 (3 of 4), 5
    assert tree.propose([8, 8], 3) == []
    d = SuffixTreeDrafter(tree, PromptLookup(NgramIndex([8, 8, 6])))
    assert d.propose([8, 8], 1) == [6]  # fallback to prompt lookup


def test_suffix_tree_is_bounded():
    tree = SuffixTree(max_depth=4, max_nodes=50)
    h = tree.start()
    for t in range(200):
        tree.extend(h, t % 37)
    assert tree.nodes <= 50 + 4


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept_greedy([], [3]) == [3]


@pytest.mark.parametrize("point_mass", [True, False])
def test_accept_sampled_keeps_the_target_distribution(point_mass):
    """Chi-square of the emitted token against p over a 6-token vocabulary (draft from q)."""
    g = torch.Generator().manual_seed(0)
    V, n = 6, 20000
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1], dtype=torch.float64)
    q = torch.zeros(V, dtype=torch.float64)
    if point_mass:
        q[1] = 1.0
    else:
        q = torch.tensor([0.4, 0.1, 0.1, 0.1, 0.1, 0.2], dtype=torch.float64)
    counts = torch.zeros(V)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        _, t = accept_sampled(p, q, d, generator=g)
        counts[t] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001


def test_accept_sampled_is_not_the_draft_distribution():
    """The test above can fail: always accepting would emit q, far from p."""
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    q = torch.tensor([0.0, 1.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    emitted = [accept_sampled(p, q, 1, generator=g)[1] for _ in range(2000)]
    assert abs(emitted.count(1) / 2000 - 0.1) < 0.03


def test_gumbel_coupling_is_the_point_mass_rule():
    """What step_verify runs: accept d iff d == argmax(log p + G) (choose_tokens' draw). Over many
    seeds, P(accept) = p(d) and the rejected draws follow p without d, renormalised."""
    from polykv.generation import choose_tokens

    V, n, d = 8, 20000, 2
    logits = torch.tensor([0.5, 1.0, 1.5, -1.0, 0.0, 2.0, 0.3, -0.5])
    p = torch.softmax(logits, -1).double()
    rows = logits.expand(n, V)
    seeds = torch.arange(n, dtype=torch.int64)
    ids = choose_tokens(rows, torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.int64), seeds,
                        torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), filtered=False)
    acc = float((ids == d).double().mean())
    assert abs(acc - float(p[d])) < 4 * (float(p[d]) * (1 - float(p[d])) / n) ** 0.5
    rej = ids[ids != d]
    counts = torch.bincount(rej, minlength=V).double()
    r = p.clone()
    r[d] = 0
    r /= r.sum()
    expected = r * rej.numel()
    mask = expected > 0
    chi2 = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
    assert counts[d] == 0 and chi2 < 24.3  # 7 degrees of freedom: p = 0.001


def test_adaptive_length_backs_off_and_probes():
    al = AdaptiveLength(4, cost_per_draft=0.2, probe=3, max_probe=12)
    assert al.next() > 0
    for _ in range(20):  # nothing accepted
        al.update(al.next() or 2, 0)
    assert al.best_k() == 0
    ks = []
    for _ in range(40):  # probes keep failing: the waits between them grow
        ks.append(al.next())
        if ks[-1]:
            al.update(ks[-1], 0)
    assert 0 in ks and any(k > 0 for k in ks)  # mostly plain, with probes
    assert ks.count(0) >= 34 and 2 <= 40 - ks.count(0) <= 6
    for _ in range(10):  # everything accepted again
        al.update(4, 4)
    assert al.next() == 4


def test_adaptive_length_maximises_tokens_per_cost():
    al = AdaptiveLength(8, cost_per_draft=0.1)
    al.acc, al.rej = 8.0, 2.0  # a = 0.8
    k = al.best_k()
    scores = [expected_tokens(0.8, j) / (1 + 0.1 * j) for j in range(9)]
    assert k == max(range(9), key=lambda j: scores[j])
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_spec_config_parse():
    assert SpecConfig.parse(None) is None
    assert SpecConfig.parse("suffix_tree:3").num_draft_tokens == 3
    assert SpecConfig.parse({"method": "prompt_lookup", "num_draft_tokens": 2}).method == "prompt_lookup"
    for bad in ({"method": "nope"}, {"num_draft_tokens": 0}, {"bogus": 1}, "prompt_lookup:99"):
        with pytest.raises(ValueError):
            SpecConfig.parse(bad)


def test_step_cost_fits_the_measured_steps_and_drives_the_agents():
    from polykv.spec import Speculator
    from polykv.spec.adaptive import StepCost

    sc = StepCost(prior=0.1)
    assert sc.cost_per_draft == 0.1
    for w, t in [(0, 1.0), (4, 2.2), (2, 1.6), (4, 2.2), (1, 1.3), (3, 1.9)]:  # T(w) = 1 + 0.3 w
        sc.observe(w, t)
    assert sc.cost_per_draft == pytest.approx(0.3)
    sc.observe(2, 50.0)  # a graph capture: dropped as an outlier
    assert sc.cost_per_draft == pytest.approx(0.3)
    one = StepCost(prior=0.1)
    for _ in range(6):
        one.observe(4, 2.0)  # a single width: no slope to fit
    assert one.cost_per_draft == 0.1
    # a Speculator's agents with no cost of their own draft by the measured one: at acceptance 0.5
    # the measured c = 0.5 makes shorter drafts pay than the prior 0.1 did
    spec = Speculator(None, None, "cpu")
    spec.add("a", [1, 2, 3], SpecConfig("prompt_lookup", 4))
    spec.add("b", [1, 2, 3], SpecConfig("prompt_lookup", 4, cost_per_draft=0.1))
    for key in ("a", "b"):
        spec._agents[key].length.acc, spec._agents[key].length.rej = 5.0, 5.0
    before = spec._agents["a"].length.best_k()
    for w, t in [(0, 1.0), (4, 3.0), (2, 2.0), (4, 3.0), (1, 1.5)]:  # c = 0.5
        spec.observe_step(w, t)
    assert spec._agents["a"].length.cost == pytest.approx(0.5)
    assert spec._agents["b"].length.cost == 0.1  # a cost set in the config stays
    assert spec._agents["a"].length.best_k() < before


# the object-per-node tree this module replaced (polykv 373eb35): the reference for its drafts
class _RefNode:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children = {}


class _RefTree:
    def __init__(self, max_depth=24, max_match=8, min_share=0.25, max_nodes=500_000):
        self.max_depth, self.max_match, self.min_share, self.max_nodes = max_depth, max_match, min_share, max_nodes
        self.root, self.nodes, self.generation = _RefNode(), 1, 0

    def start(self):
        return [self.generation, []]

    def extend(self, handle, t):
        if self.nodes > self.max_nodes:
            self.root, self.nodes, self.generation = _RefNode(), 1, self.generation + 1
        if handle[0] != self.generation:
            handle[0], handle[1] = self.generation, []
        new = []
        for node, depth in handle[1] + [(self.root, 0)]:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _RefNode()
                self.nodes += 1
            child.count += 1
            if depth + 1 < self.max_depth:
                new.append((child, depth + 1))
        handle[1] = new

    def propose(self, ctx, k):
        for m in range(min(self.max_match, len(ctx), self.max_depth - 1), 0, -1):
            node = self.root
            for t in ctx[-m:]:
                node = node.children.get(t) if node is not None else None
            if node is None or not node.children:
                continue
            out = []
            while node.children and len(out) < k:
                t, child = max(node.children.items(), key=lambda kv: kv[1].count)
                if child.count < self.min_share * sum(c.count for c in node.children.values()):
                    break
                out.append(t)
                node = child
            if out:
                return out
        return []


@pytest.mark.parametrize("depth,vocab,max_nodes", [(4, 5, 10_000), (24, 7, 500_000), (6, 3, 300), (2, 9, 1000)])
def test_suffix_tree_drafts_equal_the_object_tree(depth, vocab, max_nodes):
    """Interleaved growing sequences (ties, clears at max_nodes, depth limits): every proposal and
    the node count equal the reference tree's."""
    rng = random.Random(depth * 100 + vocab)
    a, b = SuffixTree(max_depth=depth, max_nodes=max_nodes), _RefTree(max_depth=depth, max_nodes=max_nodes)
    seqs = [([], a.start(), b.start()) for _ in range(5)]
    for step in range(1500):
        ctx, ha, hb = seqs[rng.randrange(len(seqs))]
        t = rng.randrange(vocab) if rng.random() < 0.6 else (ctx[-3] if len(ctx) > 3 else 0)
        ctx.append(t)
        a.extend(ha, t)
        b.extend(hb, t)
        assert a.nodes == b.nodes
        probe = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        for c in (ctx, probe):
            assert a.propose(c, 5) == b.propose(c, 5)


def _ref_lookup(index, ctx, k, max_ngram=6, min_ngram=2):
    """PromptLookup before the memo and the own-token index: a scan per n."""
    from polykv.spec.drafters import _own_match

    for n in range(min(max_ngram, len(ctx)), min_ngram - 1, -1):
        pat = ctx[-n:]
        if index is not None:
            for pos in sorted(index._sa[slice(*index.find(pat))][:8]):
                if index.ids[pos + n: pos + n + k]:
                    return index.ids[pos + n: pos + n + k]
        j = _own_match(ctx, n)
        if j >= 0:
            return ctx[j: j + k]
    return []


@pytest.mark.parametrize("vocab,min_ngram,max_ngram", [(3, 2, 6), (6, 1, 4), (12, 2, 3)])
def test_prompt_lookup_incremental_equals_a_scan(vocab, min_ngram, max_ngram):
    """A context grown by appending (the Speculator's), fresh lists and a rewritten context: the
    drafts equal a full scan's every time."""
    rng = random.Random(vocab)
    doc = [rng.randrange(vocab) for _ in range(80)]
    for index in (NgramIndex(doc), None):
        pl = PromptLookup(index, max_ngram, min_ngram)
        ctx = [rng.randrange(vocab)]
        for step in range(300):
            ctx.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
            if step % 97 == 96:
                ctx[-5:] = [rng.randrange(vocab) for _ in range(5)]  # not an append: re-indexed
            want = _ref_lookup(index, ctx, 4, max_ngram, min_ngram)
            assert pl.propose(ctx, 4) == want
            assert pl.propose(list(ctx), 4) == want  # another list: from scratch
            assert pl.propose(ctx, 4) == want


@pytest.mark.parametrize("k", [1, 3, 4])
def test_fitted_tree_drafts_equal_the_full_depth_tree(k):
    """A tree fitted to k builds only max_match + k levels; its drafts of up to k tokens equal the
    full-depth tree's, and it deepens (never shrinks) for a larger k once filled."""
    rng = random.Random(k)
    full, fitted = SuffixTree(max_depth=24, max_match=5), SuffixTree(max_depth=24, max_match=5)
    fitted.fit(k)
    assert fitted.depth == 5 + k
    hs = [(full.start(), fitted.start(), []) for _ in range(4)]
    for _ in range(800):
        hf, hp, ctx = hs[rng.randrange(4)]
        t = rng.randrange(4) if rng.random() < 0.7 else (ctx[-4] if len(ctx) > 4 else 0)
        ctx.append(t)
        full.extend(hf, t)
        fitted.extend(hp, t)
        for c in (ctx, [rng.randrange(4) for _ in range(rng.randrange(1, 9))]):
            for j in range(1, k + 1):
                assert fitted.propose(c, j) == full.propose(c, j)
    assert fitted.nodes < full.nodes
    fitted.fit(1)
    assert fitted.depth == 5 + k  # filled: never shallower
    fitted.fit(30)
    assert fitted.depth == 24
