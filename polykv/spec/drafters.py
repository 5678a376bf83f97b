"""Drafters: cheap guesses of an agent's next tokens, verified by the target model in one forward.

    drafter.propose(context_ids, k) -> list[int]    # up to k guessed tokens (possibly none)

`context_ids` is the agent's own token sequence after the shared document (its prompt, the tokens it
has emitted, and the token about to be fed). A drafter never sees logits; the verifier decides.

* `NgramIndex`: a suffix array over a document's token ids, built once per document (prefix doubling,
  O(n log² n) in torch) and persisted with the pool (`pool/persist.py`). Any n-gram's occurrences
  are one contiguous range of the array (binary search), so one index serves every n.
* `PromptLookup`: the longest tail of the context (n = max_ngram .. min_ngram) that occurs in the
  document or earlier in the context itself; the draft is what followed that occurrence. Ties in
  length go to the document (agents quote it); among document occurrences the earliest wins.
* `SuffixTree`: a depth-bounded suffix trie over the outputs of all agents of a document, updated
  as they emit (SuffixDecoding, Oliaro et al. 2024): the longest matching tail of the context picks
  a node, the draft follows the most frequent child while its share of the node's visits stays
  above `min_share`. `SuffixTreeDrafter` falls back to a `PromptLookup` when the tree has no match.
* `DraftModel`: a small model with the same tokenizer, greedy, with one dense cache per agent key
  cropped to the common prefix on every call (a minimal working implementation of the interface).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

import torch

__all__ = ["DraftModel", "Drafter", "NgramIndex", "PromptLookup", "SuffixTree", "SuffixTreeDrafter",
           "suffix_array"]


class Drafter(Protocol):
    def propose(self, context_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that may follow `context_ids` (an empty list: no guess)."""


# --------------------------------------------------------------------------------------------
# document n-gram index (suffix array)
# --------------------------------------------------------------------------------------------


def suffix_array(ids) -> torch.Tensor:
    """int64 [n]: start positions of the suffixes of `ids` in lexicographic order (a shorter suffix
    before any extension of it). Prefix doubling: rank pairs (rank[i], rank[i + h]) sorted stably,
    h = 1, 2, 4, ... until every rank is distinct."""
    x = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    n = x.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    rank = torch.unique(x, return_inverse=True)[1]  # dense ranks 0..
    h = 1
    while True:
        second = torch.full((n,), -1, dtype=torch.int64)
        if h < n:
            second[: n - h] = rank[h:]
        # sort by (rank, second): second key first, then a stable sort on the first
        order = torch.argsort(second, stable=True)
        order = order[torch.argsort(rank[order], stable=True)]
        r, s = rank[order], second[order]
        new = torch.zeros(n, dtype=torch.int64)
        if n > 1:
            new[1:] = torch.cumsum(((r[1:] != r[:-1]) | (s[1:] != s[:-1])).long(), 0)
        rank = torch.empty(n, dtype=torch.int64)
        rank[order] = new
        if int(new[-1]) == n - 1:
            return order
        h *= 2


class NgramIndex:
    """Suffix array over one document's token ids (module doc). `sa`: a saved array (validated)."""

    def __init__(self, ids: list[int], sa: torch.Tensor | None = None):
        self.ids = [int(t) for t in ids]
        if sa is None:
            sa = suffix_array(self.ids)
        else:
            sa = torch.as_tensor(sa, dtype=torch.int64).reshape(-1)
            if sa.numel() != len(self.ids) or not torch.equal(torch.sort(sa).values, torch.arange(len(self.ids))):
                raise ValueError("suffix array is not a permutation of the document's positions")
        self.sa = sa
        self._sa = sa.tolist()
        self._memo: dict = {}  # (pattern tuple, limit) -> occurrences
        self._starts: dict = {}  # pattern tuple -> draft_start
        self._longest: dict = {}  # (tail tuple, min n) -> (n, draft_start) of `longest`

    def __len__(self) -> int:
        return len(self.ids)

    def _cmp(self, pos: int, pat: list[int]) -> int:
        """Sign of (suffix at pos, truncated to len(pat)) vs pat."""
        seg = self.ids[pos: pos + len(pat)]
        return (seg > pat) - (seg < pat)

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array range of the suffixes that start with `pattern`."""
        pat = list(pattern)
        lo, hi = 0, len(self._sa)
        while lo < hi:  # first suffix >= pat
            mid = (lo + hi) // 2
            if self._cmp(self._sa[mid], pat) < 0:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, len(self._sa)
        while lo < hi:  # first suffix > pat (as a prefix)
            mid = (lo + hi) // 2
            if self._cmp(self._sa[mid], pat) <= 0:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def occurrences(self, pattern: list[int], limit: int = 64) -> list[int]:
        """Start positions of `pattern` in the document (at most `limit`, ascending). Memoised per
        (pattern, limit): the document never changes, and agents of a document ask for the same
        n-grams again and again (two binary searches of list compares each: the largest host cost
        of a speculative step at 32 agents before, ~40% of it)."""
        key = (pattern if type(pattern) is tuple else tuple(pattern), limit)
        got = self._memo.get(key)
        if got is None:
            lo, hi = self.find(list(pattern))
            got = sorted(self._sa[lo: min(hi, lo + limit)])
            if len(self._memo) >= 1 << 18:  # bounded: forget everything rather than track use
                self._memo.clear()
            self._memo[key] = got
        return got

    def draft_start(self, pattern: tuple) -> int:
        """Where `PromptLookup`'s document draft after `pattern` (a tuple) starts: pos + n of the
        first of `occurrences(pattern, 8)` with a token after it, -1 when none. Memoised per
        pattern (one dict lookup per n per agent per step instead of the occurrence list's walk)."""
        got = self._starts.get(pattern)
        if got is None:
            n, end = len(pattern), len(self.ids)
            got = next((pos + n for pos in self.occurrences(pattern, limit=8) if pos + n < end), -1)
            if len(self._starts) >= 1 << 18:
                self._starts.clear()
            self._starts[pattern] = got
        return got


    def longest(self, tail: tuple, lo: int) -> tuple[int, int]:
        """(n, draft_start) of the longest tail[-n:], n from len(tail) down to lo, with a document
        draft (`draft_start` >= 0); (0, -1) when none. Memoised per (tail, lo): one dict lookup
        per agent per step instead of one per n (agents quoting a document repeat their tails)."""
        key = (tail, lo)
        got = self._longest.get(key)
        if got is None:
            got = (0, -1)
            for n in range(len(tail), lo - 1, -1):
                p = self.draft_start(tail[len(tail) - n:])
                if p >= 0:
                    got = (n, p)
                    break
            if len(self._longest) >= 1 << 18:
                self._longest.clear()
            self._longest[key] = got
        return got


def _own_match(ctx: list[int], n: int) -> int:
    """Index just after the latest earlier occurrence of ctx[-n:] inside ctx (-1: none)."""
    pat = ctx[-n:]
    for start in range(len(ctx) - n - 1, -1, -1):
        if ctx[start: start + n] == pat:
            return start + n
    return -1


class PromptLookup:
    """n-gram match against the document (`NgramIndex`) and the agent's own tokens (module doc).

    The own-token match keeps an index of the context's positions by the min_ngram tokens before
    them (those tokens -> the latest such end, each end linked to the previous one with the same
    tokens: ints only, no list per key) when `propose` is called again with the same list object
    grown by appending (what `Speculator` does): each call indexes only the new tokens (one key per
    token, not one per n), and only when the document has no draft at the n where the own tokens
    would be asked. A lookup walks the ends of the context's last min_ngram tokens, latest first,
    and extends each match backwards: the latest end matching n tokens is the one
    `_own_match(ctx, n)` returns (`_own_longest`). Any other context (or one whose indexed tail
    changed) is indexed from scratch; the result is `_own_match`'s either way.

    The document is asked once per call (`NgramIndex.longest`: its longest n, memoised per tail);
    the own tokens only when that n is below the longest tail, and they win only above it — the
    order of the scan n = max_ngram .. min_ngram, document before own tokens at each n."""

    def __init__(self, index: NgramIndex | None, max_ngram: int = 6, min_ngram: int = 2, own: bool = True):
        self.index, self.max_ngram, self.min_ngram, self.own = index, int(max_ngram), int(min_ngram), own
        self._src = None  # the context list indexed
        self._end = 0  # ends up to this index of it are in _ends
        self._ends: dict = {}  # tuple(ctx[e - min_ngram: e]) -> its latest end e
        self._prev: list[int] = []  # _prev[e]: the end before e with the same key (-1: none); ints, no list per key
        self._tail = None  # ctx[_end - 1] when indexed

    def _own_longest(self, ctx, top: int) -> tuple[int, int]:
        """(n, e): the longest tail ctx[-n:] (n <= top, >= min_ngram) occurring earlier in ctx and
        the end e of its latest such occurrence ((0, -1) when none) — what a scan of n from top
        down with `_own_match` finds first. First the index catches up: the ends e <= len(ctx) - 1
        of ctx's min_ngram-grams (every earlier occurrence `_own_match` may return ends at one of
        them), key -> latest end, earlier ones via _prev; a context other than the one indexed (or
        whose indexed tail changed) is indexed from scratch. Then one walk over the ends of the
        context's last min_ngram tokens, latest first, each match extended backwards (no list per
        n). min_ngram 2: keys built as (a, b) pairs, not tuple(slice) (the same keys, half the
        cost; the index update ran on ~80% of calls)."""
        lo, L = self.min_ngram, len(ctx)
        end = self._end
        if ctx is not self._src or end >= L or (end and ctx[end - 1] != self._tail):
            self._src, end, self._ends, self._prev = ctx, 0, {}, []
        ends, prev = self._ends, self._prev
        if end < L - 1:  # new ends first .. L - 1
            first = end + 1 if end >= lo else lo
            if len(prev) < first:
                prev.extend([-1] * (first - len(prev)))
            get = ends.get
            if lo == 2:
                for e in range(first, L):
                    key = (ctx[e - 2], ctx[e - 1])
                    prev.append(get(key, -1))  # prev[e]
                    ends[key] = e
            else:
                for e in range(first, L):
                    key = tuple(ctx[e - lo: e])
                    prev.append(get(key, -1))
                    ends[key] = e
            self._end = end = L - 1
            self._tail = ctx[end - 1] if end else None
        e = ends.get((ctx[L - 2], ctx[L - 1]) if lo == 2 else tuple(ctx[L - lo:]), -1)
        best_n, best_e = 0, -1
        while e >= 0:  # latest end first: the first end reaching a length is its latest
            j = lo  # ctx[e - lo: e] == ctx[-lo:] by the key; extend backwards up to top, not before 0
            while j < top and j < e and ctx[e - 1 - j] == ctx[L - 1 - j]:
                j += 1
            if j > best_n:
                best_n, best_e = j, e
                if j == top:
                    break
            e = prev[e]
        return best_n, best_e

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        ctx = context_ids
        if k <= 0:
            return []
        L, lo = len(ctx), self.min_ngram
        top = self.max_ngram if self.max_ngram < L else L
        if top < lo:
            return []
        index = self.index
        # longest tail first; at one n the document before the own tokens: the document's longest
        # n (one memoised lookup), then the own tokens only above it
        n_doc, p = index.longest(tuple(ctx[L - top:]), lo) if index is not None else (0, -1)
        if n_doc < top and self.own:
            n, j = self._own_longest(ctx, top)
            if n > n_doc:
                return ctx[j: j + k]
        return index.ids[p: p + k] if n_doc else []


# --------------------------------------------------------------------------------------------
# suffix tree over the outputs of all agents of a document
# --------------------------------------------------------------------------------------------


class SuffixTree:
    """Depth-bounded suffix trie over token sequences that grow one token at a time.

        tree = SuffixTree(max_depth=24)
        h = tree.start()               # a new sequence (e.g. an agent's output)
        tree.extend(h, token)          # every suffix of the sequence (up to max_depth) gains a visit
        tree.propose(context, k)       # follow the longest matching tail, most frequent children

    Each token costs O(max_depth): a sequence keeps the nodes of its last max_depth suffixes.
    More than `max_nodes` nodes: the tree is cleared (outputs of earlier requests are forgotten;
    live sequences start over).

    Layout: a node is an int id; `_child` maps token -> {parent id: child id} (one dict per token,
    keyed by small ints: a step's adds look the token's dict up once and then one parent per live
    suffix — 20-30% faster than one dict keyed by (id << 32 | token), whose two-digit int keys were
    built and hashed per node (a spec_host call's adds replayed: -22%; 10^6 random nodes: -30%),
    and a quarter smaller: 99 vs 135 bytes per node, tracemalloc), and
    per-node lists hold the visit count, the children's total count and the most visited child
    (ties: the child created first) kept up to date as counts grow, so `propose` reads the choice
    instead of scanning the children. No Python object per node: a tree of 10^5 nodes built of
    objects made the cyclic garbage collector walk it again and again (5x the extend time,
    measured: 96 sequences of 64 tokens 0.59 s -> 0.11 s with the collector off); dicts holding
    ints only are not tracked by the collector.

    Lazy: `extend` / `extend_all` only log (handle, tokens); the log is added in its order when
    anything reads the tree (`propose`, `nodes`, a deeper `fit`), so every read sees exactly the
    tree the eager adds would have built (node ids, ties and max_nodes clears included). A tree no
    one reads costs nothing per token — a prompt-lookup run records its agents' outputs for later
    suffix-tree requests, and adding them was ~40% of its speculative host work per step (32 agents,
    `polykv.bench.spec_host`). The log holds at most `max_pending` tokens: past that each extend
    adds the oldest entries first (the eager cost again, spread evenly, no one-off stall)."""

    def __init__(self, max_depth: int = 24, max_match: int = 8, min_share: float = 0.25,
                 max_nodes: int = 500_000, max_pending: int = 1 << 16):
        self.max_depth, self.max_match, self.min_share, self.max_nodes = max_depth, max_match, min_share, max_nodes
        self.max_pending = int(max_pending)
        self.depth = max_depth  # nodes built down to this depth (`fit`)
        self.generation = 0
        self._pending: deque = deque()  # (handle, tokens) logged, not yet added; in order
        self._pending_tokens = 0
        self._lock = threading.Lock()  # one flush at a time (the pool shares a document's tree)
        self._clear()

    def fit(self, k: int) -> None:
        """Drafts of at most k tokens will be asked. `propose(ctx, k)` reads nodes down to depth
        max_match + k only, so an empty tree builds no deeper (depth 12 instead of 24 for k = 4:
        half the work of every `extend`, the largest host cost of a speculative step) and a tree
        deepens when a larger k arrives (never shallower once filled). Drafts equal a tree of
        max_depth's for every k fitted before the sequences were added; only the max_nodes clear
        comes later (fewer nodes)."""
        want = min(self.max_depth, self.max_match + max(1, int(k)))
        if len(self._count) == 1 and not self._pending:
            self.depth = want
        elif want > self.depth:
            self.flush()  # the logged tokens were extended at the old depth
            self.depth = want

    def _clear(self) -> None:
        self._child: dict[int, dict[int, int]] = {}  # token -> {parent id: child id}
        self._count = [0]  # visits of node i (root 0)
        self._total = [0]  # sum of the visits of node i's children
        self._best = [-1]  # most visited child of node i (-1: none)
        self._tok = [-1]  # token on the edge into node i

    @property
    def nodes(self) -> int:
        self.flush()
        return len(self._count)

    def start(self) -> list:
        """A handle for a new sequence: [generation, [node of each live suffix, deepest first],
        tokens of the sequence added so far]. (Not flushed first: a handle whose generation a
        logged clear makes stale starts over empty, which is what a new handle is.)"""
        return [self.generation, [], 0]

    def extend(self, handle: list, token: int) -> None:
        self.extend_all(handle, (token,))

    def extend_all(self, handle: list, tokens) -> None:
        tokens = tuple(tokens)
        if not tokens:
            return
        self._pending.append((handle, tokens))
        self._pending_tokens += len(tokens)
        if self._pending_tokens > self.max_pending:
            self.flush(self._pending_tokens - self.max_pending)

    def flush(self, tokens: int | None = None) -> None:
        """Add the logged tokens (the oldest entries holding at least `tokens` of them; None: all).
        An entry that no max_nodes clear can interrupt (each token adds at most `depth` nodes) and
        whose handle is current is added in one `_run`; any other goes token by token, checking
        the clear and the handle's generation before each token as the eager adds did."""
        if not self._pending:
            return
        with self._lock:
            pending, run = self._pending, self._run
            left = float("inf") if tokens is None else tokens
            while pending and left > 0:
                handle, toks = pending.popleft()
                self._pending_tokens -= len(toks)
                left -= len(toks)
                if handle[0] == self.generation and len(self._count) + len(toks) * self.depth <= self.max_nodes:
                    run(handle, toks)
                    continue
                for t in toks:
                    if len(self._count) > self.max_nodes:
                        self.generation += 1
                        self._clear()
                    if handle[0] != self.generation:
                        handle[0], handle[1] = self.generation, []
                    run(handle, (t,))

    def _run(self, handle: list, tokens) -> None:
        """Extend now, no clear inside (`flush` checks). Per token: the token's child dict looked up
        once, then one get per live suffix (deepest first) and the root's (parent 0) last."""
        limit = self.depth - 1  # live suffixes kept: depth < self.depth
        by_token, count, total, best, tok = self._child, self._count, self._total, self._best, self._tok
        live = handle[1]
        for t in tokens:
            t = int(t)
            kids = by_token.get(t)
            if kids is None:
                kids = by_token[t] = {}
            get = kids.get
            new = []
            add = new.append
            for node in live:
                c = get(node)
                if c is None:  # a new child: the most visited only if it is the node's first
                    c = kids[node] = len(count)
                    count.append(1)
                    total.append(0)
                    best.append(-1)
                    tok.append(t)
                    if best[node] < 0:
                        best[node] = c
                else:
                    n = count[c] = count[c] + 1
                    b = best[node]
                    if c != b and (n > count[b] or (n == count[b] and c < b)):  # ties: the child created first
                        best[node] = c
                total[node] += 1
                add(c)
            c = get(0)  # the root's child, outside the loop (no list of live + [0] per token)
            if c is None:
                c = kids[0] = len(count)
                count.append(1)
                total.append(0)
                best.append(-1)
                tok.append(t)
                if best[0] < 0:
                    best[0] = c
            else:
                n = count[c] = count[c] + 1
                b = best[0]
                if c != b and (n > count[b] or (n == count[b] and c < b)):
                    best[0] = c
            total[0] += 1
            add(c)
            live = new[1:] if len(live) >= limit else new  # the deepest suffix reached the depth
        handle[1] = live
        handle[2] += len(tokens)

    def _walk(self, pattern: list[int], node: int = 0):
        by_token = self._child
        for t in pattern:
            kids = by_token.get(int(t))
            node = kids.get(node) if kids is not None else None
            if node is None:
                return None
        return node

    def propose(self, context_ids: list[int], k: int, handle: list | None = None, flush: bool = True,
                logged: int | None = None) -> list[int]:
        """handle: the sequence `context_ids` ends with (its `start` handle, every token of it
        extended, as `Speculator` keeps them): its live suffixes ARE the nodes of the context's
        tails up to their length, so those tails are not walked from the root again (the drafts
        are the same; the walks were ~1/4 of a suffix-tree proposal).

        flush=False: read the tree as it is, the logged tokens not added (a lagged read:
        `Speculator.ahead` adds them while the device runs a step). The handle then has added
        only handle[2] of the `logged` tokens extended into it (required with a handle): the
        context's last e = logged - handle[2] tokens are not in its live suffixes, so the tail
        of length m is live[-(m - e)] followed by those e tokens (a walk of e steps, not m),
        else walked from the root."""
        if flush:
            self.flush()
        ctx = context_ids
        total, best, tok, count = self._total, self._best, self._tok, self._count
        live = handle[1] if handle is not None and handle[0] == self.generation else ()
        n_live = len(live)
        e = 0 if flush or handle is None else logged - handle[2]  # the context's tokens the handle lacks
        rest = ctx[len(ctx) - e:] if e else ()
        for m in range(min(self.max_match, len(ctx), self.max_depth - 1), 0, -1):
            j = m - e
            if 0 < j <= n_live:
                node = live[-j] if not e else self._walk(rest, live[-j])
            else:
                node = self._walk(ctx[-m:])
            if node is None or not total[node]:
                continue
            out = []
            while total[node] and len(out) < k:
                c = best[node]
                if count[c] < self.min_share * total[node]:
                    break
                out.append(tok[c])
                node = c
            if out:
                return out
        return []


class SuffixTreeDrafter:
    """Drafts from a document's outputs tree (`SuffixTree`), else from `fallback` (a PromptLookup).
    handle: the tree handle of the sequence the context ends with (`SuffixTree.propose`)."""

    def __init__(self, tree: SuffixTree, fallback: Drafter | None = None):
        self.tree, self.fallback = tree, fallback

    def propose(self, context_ids: list[int], k: int, handle: list | None = None) -> list[int]:
        if k <= 0:
            return []
        out = self.tree.propose(context_ids, k, handle)
        if not out and self.fallback is not None:
            out = self.fallback.propose(context_ids, k)
        return out


# --------------------------------------------------------------------------------------------
# a small draft model with the same tokenizer
# --------------------------------------------------------------------------------------------


class DraftModel:
    """Greedy drafts from a small causal LM sharing the target's tokenizer.

    prefix_ids: the document's token ids (every context is prefix_ids + context_ids). One dense
    transformers cache per `key` (an agent): each call crops it to the longest common prefix of
    what it holds and the new context, feeds the rest, then decodes k tokens greedily. Minimal:
    one forward per drafted token, agents one at a time."""

    def __init__(self, model, prefix_ids: list[int] | None = None):
        self.model = model
        self.prefix = [int(t) for t in (prefix_ids or [])]
        self._state: dict = {}  # key -> (tokens in the cache, DynamicCache)

    @torch.no_grad()
    def propose(self, context_ids: list[int], k: int, key=None) -> list[int]:
        from transformers import DynamicCache

        if k <= 0:
            return []
        full = self.prefix + [int(t) for t in context_ids]
        held, cache = self._state.get(key, ([], None))
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        common = 0
        for a, b in zip(held, full):
            if a != b:
                break
            common += 1
        common = min(common, len(full) - 1)  # at least the last token is fed (its logits)
        if common < len(held):
            cache.crop(common)
        dev = next(self.model.parameters()).device
        feed, pos, out, tokens = full[common:], common, [], full[:common]
        for _ in range(k):
            ids = torch.tensor([feed], device=dev)
            logits = self.model(input_ids=ids, position_ids=torch.arange(pos, pos + len(feed), device=dev)[None],
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            tokens += feed
            pos += len(feed)
            t = int(torch.argmax(logits))
            out.append(t)
            feed = [t]
        self._state[key] = (tokens, cache)  # the last draft is not in the cache
        return out

    def forget(self, key=None) -> None:
        self._state.pop(key, None)
