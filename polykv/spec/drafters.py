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
        """Start positions of `pattern` in the document (at most `limit`, ascending)."""
        lo, hi = self.find(pattern)
        return sorted(self._sa[lo: min(hi, lo + limit)])


def _own_match(ctx: list[int], n: int) -> int:
    """Index just after the latest earlier occurrence of ctx[-n:] inside ctx (-1: none)."""
    pat = ctx[-n:]
    for start in range(len(ctx) - n - 1, -1, -1):
        if ctx[start: start + n] == pat:
            return start + n
    return -1


class PromptLookup:
    """n-gram match against the document (`NgramIndex`) and the agent's own tokens (module doc)."""

    def __init__(self, index: NgramIndex | None, max_ngram: int = 6, min_ngram: int = 2, own: bool = True):
        self.index, self.max_ngram, self.min_ngram, self.own = index, int(max_ngram), int(min_ngram), own

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        ctx = list(context_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
            pat = ctx[-n:]
            if self.index is not None:
                for pos in self.index.occurrences(pat, limit=8):
                    draft = self.index.ids[pos + n: pos + n + k]
                    if draft:
                        return draft
            if self.own:
                j = _own_match(ctx, n)
                if j >= 0:
                    return ctx[j: j + k]
        return []


# --------------------------------------------------------------------------------------------
# suffix tree over the outputs of all agents of a document
# --------------------------------------------------------------------------------------------


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Depth-bounded suffix trie over token sequences that grow one token at a time.

        tree = SuffixTree(max_depth=24)
        h = tree.start()               # a new sequence (e.g. an agent's output)
        tree.extend(h, token)          # every suffix of the sequence (up to max_depth) gains a visit
        tree.propose(context, k)       # follow the longest matching tail, most frequent children

    Each `extend` costs O(max_depth): a sequence keeps the nodes of its last max_depth suffixes.
    More than `max_nodes` nodes: the tree is cleared (outputs of earlier requests are forgotten;
    live sequences start over)."""

    def __init__(self, max_depth: int = 24, max_match: int = 8, min_share: float = 0.25,
                 max_nodes: int = 500_000):
        self.max_depth, self.max_match, self.min_share, self.max_nodes = max_depth, max_match, min_share, max_nodes
        self.root = _Node()
        self.nodes = 1
        self.generation = 0

    def start(self) -> list:
        """A handle for a new sequence: [generation, [(node, depth), ...]]."""
        return [self.generation, []]

    def extend(self, handle: list, token: int) -> None:
        if self.nodes > self.max_nodes:
            self.root, self.nodes, self.generation = _Node(), 1, self.generation + 1
        if handle[0] != self.generation:
            handle[0], handle[1] = self.generation, []
        t = int(token)
        new = []
        for node, depth in handle[1] + [(self.root, 0)]:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node()
                self.nodes += 1
            child.count += 1
            if depth + 1 < self.max_depth:
                new.append((child, depth + 1))
        handle[1] = new

    def extend_all(self, handle: list, tokens) -> None:
        for t in tokens:
            self.extend(handle, t)

    def _walk(self, pattern: list[int]):
        node = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        ctx = list(context_ids)
        for m in range(min(self.max_match, len(ctx), self.max_depth - 1), 0, -1):
            node = self._walk(ctx[-m:])
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


class SuffixTreeDrafter:
    """Drafts from a document's outputs tree (`SuffixTree`), else from `fallback` (a PromptLookup)."""

    def __init__(self, tree: SuffixTree, fallback: Drafter | None = None):
        self.tree, self.fallback = tree, fallback

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        out = self.tree.propose(context_ids, k)
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
