"""CUDA-graph-captured decode steps of one AgentBatch (DESIGN §8).

A decode step of agents in slots 0..n-1 (one new token each) is the same sequence of kernels every
step: only the tokens, the write rows and the lengths change. It is captured once per batch bucket
(n rounded up to a power of two; padded rows write the scratch row and read an empty suffix) with
static device inputs, and replayed: per step the host fills one pinned int64 [3, bucket] tensor
(tokens, write rows, positions), makes one host-to-device copy and one replay. Logits and the greedy
choice are static outputs of the graph.

Verification steps of speculative decoding (`run_columns`: each agent feeds its pending token and
its drafts, up to n_q columns, left-padded) are captured the same way per (bucket, n_q), n_q rounded
up to a power of two; the graph keeps the logits of every column.

A graph reads the page pools and the device page table it was captured with: a new page for an
agent only changes table entries (refreshed in place before the replay); when the AgentCache
reallocates a pool or the table (`storage_version` changes) every graph is dropped and recaptured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hf.graphs import capture_graph
from .agent_cache import AgentCache, Group, dummy_mask


def graphs_supported(cache: AgentCache) -> bool:
    """Captured decode needs CUDA, the Triton kernels (not the forced reference) and full-attention
    layers (sliding-window layers take the torch cascade, which is not captured).
    POLYKV_CUDA_GRAPHS=0 turns capture off (eager steps, for debugging)."""
    import os

    from ..kernels import dispatch

    return (os.environ.get("POLYKV_CUDA_GRAPHS", "1") != "0" and cache.device.type == "cuda" and all(w is None for w in cache.windows)
            and cache.backend == "auto" and dispatch.use_triton(cache.store[0].k.codes))


def bucket(n: int) -> int:
    """Static batch size of a step of n agents: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: the static step runs eagerly (`capture=False`)
    fn: object  # the step itself
    host: torch.Tensor  # pinned int64 [3, B, n_q]: tokens, flat write rows, position ids
    inp: torch.Tensor  # device copy of `host`
    out: dict  # n_q = 1: "logits" float32 [B, vocab], "greedy" int64 [B]; n_q > 1: "logits"
    # float32 [B, n_q, vocab]. Written by each replay.


class DecodeGraphs:
    """Captured decode steps of one AgentCache (see module doc)."""

    def __init__(self, model, cache: AgentCache, pad_id: int, warmup: int = 2, capture: bool = True):
        self.model, self.cache, self.pad_id, self.warmup = model, cache, int(pad_id), warmup
        self.capture = capture  # False: run the static step eagerly (tests on CPU)
        self._graphs: dict[tuple[int, int], _Captured] = {}  # (bucket, n_q) -> step
        self._version = cache.storage_version
        self._mempool = None
        self.captures = 0  # steps built so far (captured graphs, or static eager steps)

    def run(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the agents in slots 0..len(tokens)-1, token tokens[g] for slot g.
        Returns (logits float32 [n, vocab], greedy int64 [n]) — device views valid until the next
        replay. Advances the cache's host lengths."""
        out = self._replay([[t] for t in tokens], 1)
        return out["logits"][: len(tokens)], out["greedy"][: len(tokens)]

    def run_columns(self, columns: list[list[int]], keep: int) -> torch.Tensor:
        """One forward of the agents in slots 0..len(columns)-1, agent g feeding columns[g] (1 or
        more tokens, its pending token and drafts), left-padded to n_q >= keep columns. Returns
        float32 [n, keep, vocab] logits of the last `keep` columns (a device view valid until the
        next replay). Advances the cache's host lengths by each agent's token count."""
        width = max(len(c) for c in columns)
        if keep > width:
            raise ValueError(f"keep={keep} exceeds the widest agent ({width} tokens)")
        n_q = bucket(max(2, width))
        out = self._replay(columns, n_q)
        return out["logits"][: len(columns), n_q - keep:]

    def _replay(self, columns: list[list[int]], n_q: int) -> dict:
        cache = self.cache
        n = len(columns)
        B = min((b for b, w in self._graphs if w == n_q and b >= n), default=bucket(n))
        if B > cache.batch_capacity:
            cache.reserve(B)
        # host bookkeeping in plain Python (a few microseconds for tens of agents)
        base = cache.lens[:n].tolist()
        counts = [len(c) for c in columns]
        pages = cache.pages
        for slot, (b, c) in enumerate(zip(base, counts)):
            pages.ensure(slot, b + c)
        cache.grow_storage()  # the pools follow the pages ensure added
        if cache.storage_version != self._version:
            self._graphs.clear()
            # the dropped graphs' private pool is released with them; capturing into its id again
            # trips the allocator (H200: "use_count > 0" assert): new captures take a new pool
            self._mempool = None
            self._version = cache.storage_version
        pages.device_table()  # refreshed in place before the replay reads it
        cap = self._graphs.get((B, n_q)) or self._capture(B, n_q)
        h = cap.host
        toks, rows, pos = [], [], []
        for slot, (b, col) in enumerate(zip(base, columns)):
            pad = n_q - len(col)
            new = b + len(col)
            toks.append([self.pad_id] * pad + list(col))
            rows.append([cache.scratch_row()] * pad + [pages.row(slot, b + j) for j in range(len(col))])
            # padded columns: the positions before the real ones (as AgentCache.begin), clamped
            pos.append([max(0, cache.doc_len + new - n_q + j) for j in range(n_q)])
        h[:, :n] = torch.tensor([toks, rows, pos], dtype=torch.long)
        self._fill_padding(h, n, cache.scratch_row())
        cap.inp.copy_(h)
        if cap.graph is not None:
            cap.graph.replay()
        else:
            cap.fn()
        cache.lens[:n] += torch.tensor(counts, dtype=cache.lens.dtype)
        return cap.out

    def _fill_padding(self, h: torch.Tensor, n: int, scratch: int) -> None:
        """Padded rows: pad token, write to the scratch row, position doc_len - 1 (an empty suffix)."""
        if n < h.shape[1]:
            h[:, n:] = torch.tensor([[self.pad_id], [scratch], [self.cache.doc_len - 1]])[:, :, None]

    def _capture(self, B: int, n_q: int) -> _Captured:
        cache, dev = self.cache, self.cache.device
        host = torch.empty(3, B, n_q, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._fill_padding(host, 0, cache.scratch_row())  # warm-up writes go to scratch
        inp = host.to(dev)
        mask = dummy_mask(B, n_q, dev)
        out: dict[str, torch.Tensor] = {}

        def step():
            ids, rows, pos = inp[0], inp[1], inp[2]
            lens = (pos[:, -1] - cache.doc_len + 1).to(torch.int32)  # the last column's position
            cache._group = Group(sel=slice(0, B), n_q=n_q, rows=rows, lens=lens,
                                 seq=cache.pages.table.shape[1] * cache.pages.page_size)
            try:
                res = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                                 past_key_values=cache, use_cache=True, logits_to_keep=n_q)
            finally:
                cache._group = None
            if n_q == 1:
                out["logits"] = res.logits[:, -1].float()
                out["greedy"] = torch.argmax(out["logits"], dim=-1)
            else:
                out["logits"] = res.logits.float()

        graph = None
        if self.capture:
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = capture_graph(step, self._mempool, self.warmup)
        else:
            step()  # allocates the outputs the later calls overwrite
        cap = _Captured(graph, step, host, inp, out)
        self._graphs[(B, n_q)] = cap
        self.captures += 1
        return cap
