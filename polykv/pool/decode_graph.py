"""CUDA-graph-captured decode steps of one AgentBatch (DESIGN §8).

A decode step of agents in slots 0..n-1 (one new token each) is the same sequence of kernels every
step: only the tokens, the write rows and the lengths change. It is captured once per batch bucket
(n rounded up to a power of two; padded rows write the scratch row and read an empty suffix) with
static device inputs, and replayed: per step the host fills one pinned int64 [3, bucket] tensor
(tokens, write rows, positions), makes one host-to-device copy and one replay. Logits and the greedy
choice are static outputs of the graph.

A replay does not wait for the device (unless it captures, or the page table changed — a new page
every 64 rows of an agent, a slot move — and `PageTable.device_table` refreshes it with a blocking
copy): the upload is non-blocking, from one of two pinned buffers used in turn (a CUDA event says
when a buffer's last copy has been read, before it is refilled), so the host can prepare step t+1
while step t runs. A token not known on the host (`feedback`: the
pipelined `AgentBatch.step_tokens_ahead` fed the previous step's chosen id on the device) is marked
negative in the host buffer and copied on the device from the feedback row into the token column
after the upload, before the replay (outside the graph: the row may be reallocated as slots grow).

Verification steps of speculative decoding (`run_columns`: each agent feeds its pending token and
its drafts, up to n_q columns, left-padded) are captured the same way per (bucket, n_q) with the
exact n_q = widest agent's columns: a step costs what its widest agent needs, no power-of-two
rounding (5 columns ran as 8 before). More widths mean more captures, paid once per pool and
document now that captured steps outlive a batch (below); the graph keeps the logits of every column
and their greedy ids ([B, n_q]: `step_verify` copies those and gathers nothing on the host). The host
buffer is filled with NumPy over [n, n_q] (write row = page_table[slot, p // P]·P + p mod P), not
per agent and column.

With speculation (`expect_columns`: up to k+1 columns) the batch's bucket captures every width
1..k+1 on its first step, so no later step of the run captures.

Prefill steps (`run_prefill`): a step where some agent feeds several tokens — the prompts of a new
batch, a prompt joining a running one (continuous batching), a multi-token feed — runs every agent
of slots 0..n-1 as left-padded columns of one captured step, n_q = the widest agent's tokens rounded
up to a power of two (8..PREFILL_MAX: a few captures per bucket), keeping only each agent's last
column's logits; an agent with nothing to feed gets padding columns only (scratch writes, its length
unchanged). Where few agents feed more than the kept columns (a prompt joining agents that decode
or verify), the step splits its attention (`_split`, `AgentCache.attend`): every agent attends at
its kept columns, up to SPLIT_WIDE joining agents (their slots uploaded per replay) at every
column — two cascade calls instead of every agent at the prompt's width, where about 31 + P of
32 x P query columns were real (BENCHMARKS §8.16, §8.17); captured per (bucket, n_q, split or
not). Eagerly such a step was one forward per layer op — ~100 launches per layer, host-bound on
a GPU: a join cost about as much as ten decode steps (BENCHMARKS §8.13). Longer feeds, and steps
whose padded columns would cost more FLOPs than the eager forward's host time (`prefill_budget`:
large models, wide buckets), stay eager. Mixed steps (`run_mixed`): where prompts join agents that
verify drafts, the same step keeps the last few columns of every agent (the batch's widest verify
width), so the prompts' prefill and the verification are one forward instead of a prefill step and
then a verify step (two weight reads, two prefix passes: a join step of the speculating side took
5.7–9.5 ms on average against 3.9–4.2 ms for plain decoding's on an H100, BENCHMARKS §8.14).

Which bucket runs n agents: bucket(n) when captured; while agents finish within a batch (n below the
batch's peak) a larger bucket already captured for that width is replayed instead of capturing a
smaller one for the last few steps; a batch that starts with n agents gets bucket(n) (captured once:
a reused set captured for 32 agents does not make every later 8-agent step pay for 32 rows).

A graph reads the page pools and the device page table it was captured with: a new page for an
agent only changes table entries (refreshed in place before the replay); when the AgentCache
reallocates a pool or the table (`storage_version` changes) every graph is dropped and recaptured.
Reuse: when a batch closes, the pool parks its AgentCache with these graphs (`SharedKVPool.open_batch`
hands them to the next batch of the same document); `AgentCache.reset` keeps the storage, so the
graphs stay valid, and `reset` here restarts the per-batch counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..generation import greedy_ids
from ..hf.graphs import capture_step
from .agent_cache import AgentCache, Group, dummy_mask


def graphs_supported(cache: AgentCache) -> bool:
    """Captured decode needs CUDA and the Triton kernels (not the forced reference); sliding-window
    layers and recent windows (`cache.rings`, polykv.pool.ring) are captured too (the kernels'
    windowed cascade; the windows' per-step work reads device tensors only — checked captured on
    the H200: tests/pool/test_ring_static.py, docs/pool.md "Recent windows").
    POLYKV_CUDA_GRAPHS=0 turns capture off (eager steps, for debugging)."""
    import os

    from ..kernels import dispatch

    return (os.environ.get("POLYKV_CUDA_GRAPHS", "1") != "0" and cache.device.type == "cuda"
            and cache.backend == "auto" and dispatch.use_triton(cache.store[0].k.codes))


_COLS: dict[int, np.ndarray] = {}


def _col_offsets(n_q: int) -> np.ndarray:
    """int64 [1, n_q]: -n_q .. -1, column j's suffix position relative to the agent's new length."""
    got = _COLS.get(n_q)
    if got is None:
        got = _COLS[n_q] = np.arange(-n_q, 0, dtype=np.int64)[None, :]
    return got


def bucket(n: int) -> int:
    """Static batch size of a step of n agents: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


# the most columns a captured prefill step takes (its widest agent's tokens); a longer prompt is
# prefilled eagerly
PREFILL_MAX = 128
# A captured prefill step computes every agent of its bucket at its width: B x n_q token columns,
# most of them padding. It replaces an eager forward whose cost is host time, ~0.6 ms per layer on
# the H100 (BENCHMARKS 8.13: a join ~18 ms for SmolLM2's 30 layers). Padding is worth it while its
# FLOPs (2 x a layer's weights per column and layer) take less than that at a conservative 2e14
# FLOP/s: B x n_q <= PREFILL_FLOPS_PER_LAYER / (2 x weights per layer) — an estimate, not a
# measurement (SmolLM2-135M: ~17k columns, every step up to PREFILL_MAX; a Llama-3-8B layer: ~275).
PREFILL_FLOPS_PER_LAYER = 0.6e-3 * 2e14
# Agents a split prefill / mixed step computes at every column (`DecodeGraphs._split`): one key per
# (bucket, columns) serves one or two joining prompts (most joins: one agent leaves, one joins). Each
# count would be a capture of its own: with joiners rounded up to a power of two (1, 2, 4, 8) the
# H200's spec bench captured inside its timed rows (BENCHMARKS §8.17). A step with more joiners
# runs unsplit.
SPLIT_WIDE = 2


def _wide_plane(plane: np.ndarray, slots: np.ndarray, wide: int) -> None:
    """Fill a split step's input plane 3 (int64 [B, n_q], viewed flat): its `wide` agents — the
    slots that feed more than the kept columns, then other slots (computed at every column too:
    harmless) — and from index `wide` each of the B slots' place among them (-1: none), which the
    ring step writes their window segments by (`dispatch.ring_step(wide=)`)."""
    B = plane.shape[0]
    flat = plane.reshape(-1)
    idx, pos = flat[:wide], flat[wide: wide + B]
    idx[: len(slots)] = slots
    idx[len(slots):] = np.setdiff1d(np.arange(B), slots)[: wide - len(slots)]
    pos[:] = -1
    pos[idx] = np.arange(wide)


def layer_weights(model) -> int:
    """Weights of one decoder layer (all weights but the embeddings and the output head, over the
    layer count): what one token column costs to push through a layer, x2 FLOPs."""
    seen, total = set(), 0
    skip = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
            if m is not None and getattr(m, "weight", None) is not None}
    for w in model.parameters():
        if id(w) not in seen and id(w) not in skip:
            seen.add(id(w))
            total += w.numel()
    return max(1, total // max(1, int(model.config.get_text_config().num_hidden_layers)))


def prefill_columns(width: int) -> int:
    """Columns of the captured prefill step for a widest agent of `width` tokens: the next power of
    two, at least 8 (a few captures per bucket cover every prompt length up to PREFILL_MAX)."""
    return max(8, bucket(width))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: the static step runs eagerly (`capture=False`)
    fn: object  # the step itself
    hosts: list[torch.Tensor]  # two pinned int64 [3, B, n_q], used in turn: tokens, flat write
    # rows, position ids; a split step's [4, B, n_q], plane 3 its wide agents' slots, then each
    # slot's place among them (-1: none)
    inp: torch.Tensor  # int64 [3 or 4, B, n_q] on the device: the last uploaded host buffer
    out: dict  # n_q = 1 or a prefill step: "logits" float32 [B, vocab], "greedy" int64 [B] (the
    # last column); n_q > 1: "logits" float32 [B, n_q, vocab], "greedy" int64 [B, n_q]. Written by
    # each replay.
    wide: int  # agents attending at every column (`DecodeGraphs._split`); B: all (no split)
    uploaded: list = field(default_factory=lambda: [None, None])  # CUDA event after each buffer's copy
    turn: int = 0

    def staging(self) -> torch.Tensor:
        """The host buffer to fill next, once the device has read what it held last (a step ago,
        so normally at once): filling it earlier would change a copy still queued."""
        self.turn ^= 1
        ev = self.uploaded[self.turn]
        if ev is not None:
            ev.synchronize()
        return self.hosts[self.turn]

    def upload(self, h: torch.Tensor) -> None:
        """Non-blocking copy of host buffer `h` (from `staging`) into `inp`."""
        self.inp.copy_(h, non_blocking=True)
        if self.inp.device.type == "cuda":
            ev = self.uploaded[self.turn] or torch.cuda.Event()
            ev.record()
            self.uploaded[self.turn] = ev


class DecodeGraphs:
    """Captured decode steps of one AgentCache (see module doc)."""

    def __init__(self, model, cache: AgentCache, pad_id: int, warmup: int = 2, capture: bool = True):
        self.model, self.cache, self.pad_id, self.warmup = model, cache, int(pad_id), warmup
        self.capture = capture  # False: run the static step eagerly (tests on CPU)
        self._graphs: dict[tuple[int, int], _Captured] = {}  # (bucket, n_q) -> step
        self._prefills: dict[tuple[int, int], _Captured] = {}  # (bucket, n_q) -> step keeping the last column
        # (bucket, n_q) -> prefill step keeping the last few columns too (`run_mixed`)
        self._mixed: dict[tuple[int, int], _Captured] = {}
        self._version = cache.storage_version
        self._mempool = None
        self.captures = 0  # steps built since the last `reset` (captured graphs, or static eager steps)
        self.total_captures = 0  # steps built over this object's life (across reuses)
        # prefill / mixed steps with joining agents since the last `reset`: [split, unsplit] (`_split`)
        self.join_steps = [0, 0]
        self._peak = 0  # most agents in one step since the last `reset`
        self.columns = 1  # widest step this batch may run (`expect_columns`): its bucket's widths
        # token columns (bucket x n_q) a captured prefill step may compute (PREFILL_FLOPS_PER_LAYER)
        self.prefill_budget = int(PREFILL_FLOPS_PER_LAYER / (2 * layer_weights(model)))

    def prefills(self, n: int, width: int) -> bool:
        """Whether a forward of n agents whose widest feeds `width` tokens runs as the captured
        prefill step (`run_prefill`) rather than eagerly: at most PREFILL_MAX tokens, and the
        step's token columns within `prefill_budget`."""
        return 1 < width <= PREFILL_MAX and bucket(n) * prefill_columns(width) <= self.prefill_budget

    def reset(self) -> None:
        """A new batch takes over these steps (the pool reuses a closed batch's cache and graphs):
        restart the per-batch counters; the captured steps stay (valid while the cache's
        `storage_version` is unchanged, checked at every replay)."""
        self.captures = 0
        self.join_steps = [0, 0]
        self._peak = 0
        self.columns = 1

    def expect_columns(self, n_q: int) -> None:
        """Steps of up to n_q columns will run (speculation: num_draft_tokens + 1): the first step
        of each bucket captures every width 1..n_q of that bucket at once, so that a width the
        planner first picks in the middle of a run replays instead of capturing there (the H200
        bench paid one 1.4 s capture inside a timed run that way). Paid once per pool and document
        (the captured steps are parked and reused)."""
        self.columns = max(self.columns, int(n_q))

    def widths(self) -> list[tuple[int, int]]:
        """(bucket, n_q) of every captured decode / verify step, sorted."""
        return sorted(self._graphs)

    def prefill_widths(self) -> list[tuple[int, int, int]]:
        """(bucket, n_q, wide) of every captured prefill step (`run_prefill`), sorted; wide: how
        many agents attend at every column (`_split`; the bucket: a step that does not split)."""
        return sorted(self._prefills)

    def run(self, tokens: list[int], feedback: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the agents in slots 0..len(tokens)-1, token tokens[g] for slot g
        (negative: feedback[g], int64 on the device — an id the host has not read). Returns
        (logits float32 [n, vocab], greedy int64 [n]) — device views valid until the next replay.
        Advances the cache's host lengths."""
        out = self._replay([[t] for t in tokens], 1, feedback)
        return out["logits"][: len(tokens)], out["greedy"][: len(tokens)]

    def run_columns(self, columns: list[list[int]], keep: int, feedback: torch.Tensor | None = None,
                    greedy: bool = False):
        """One forward of the agents in slots 0..len(columns)-1, agent g feeding columns[g] (1 or
        more tokens, its pending token and drafts; a negative token: feedback[g], as in `run`),
        left-padded to n_q >= keep columns. Returns
        float32 [n, keep, vocab] logits of the last `keep` columns (a device view valid until the
        next replay); greedy=True: (those logits, int64 [n, keep] their argmax — computed inside
        the step, as a plain step's greedy ids). Advances the cache's host lengths by each agent's
        token count."""
        width = max(map(len, columns))
        if keep > width:
            raise ValueError(f"keep={keep} exceeds the widest agent ({width} tokens)")
        n_q = max(2, width)  # exact: a step costs its widest agent's columns, nothing rounded up
        out = self._replay(columns, n_q, feedback)
        logits = out["logits"][: len(columns), n_q - keep:]
        return (logits, out["greedy"][: len(columns), n_q - keep:]) if greedy else logits

    def run_prefill(self, columns: list[list[int]], feedback: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the agents in slots 0..len(columns)-1 where some feed several tokens (a
        prompt joining the batch, a multi-token feed): agent g feeds columns[g] (none: it only
        waits; negative tokens: feedback[g], as in `run`), left-padded to `prefill_columns` of the
        widest (at most PREFILL_MAX). Returns (logits float32 [n, vocab], greedy int64 [n]) of each
        agent's last column — device views valid until the next replay; an agent without columns
        gets a row of padding. Advances the cache's host lengths by each agent's token count."""
        n_q = prefill_columns(max(map(len, columns)))
        out = self._replay(columns, n_q, feedback, keep=1)
        return out["logits"][: len(columns)], out["greedy"][: len(columns)]

    def run_mixed(self, columns: list[list[int]], keep: int, feedback: torch.Tensor | None = None):
        """`run_prefill` for a step where prompts join agents that verify drafts: one forward where
        two would run (the prefill step, then the verify step). Agent g feeds columns[g] (its
        pending token and drafts, or a prompt; none: it waits), left-padded to `prefill_columns` of
        the widest. Returns (float32 [n, keep, vocab] logits, int64 [n, keep] their argmax) of each
        agent's last `keep` columns — device views valid until the next replay. The step keeps the
        batch's widest verify width (`expect_columns`) or `keep`, whichever is more, so one capture
        per (bucket, n_q) serves every draft count. Advances the cache's host lengths."""
        n_q = prefill_columns(max(map(len, columns)))
        out = self._replay(columns, n_q, feedback, keep=max(int(keep), self.columns, 2))
        kept = out["logits"].shape[1]
        return out["logits"][: len(columns), kept - keep:], out["greedy"][: len(columns), kept - keep:]

    def _replay(self, columns: list[list[int]], n_q: int, feedback: torch.Tensor | None = None,
                keep: int = 0) -> dict:
        """Replay (capturing first) the step of bucket(len(columns)) x n_q columns; keep: 0 a
        decode / verify step (every column's logits), 1 a prefill step (the last column's), more: a
        mixed step (the last `keep` columns'; a captured one keeping fewer is rebuilt)."""
        cache = self.cache
        n = len(columns)
        self._peak = max(self._peak, n)
        B = bucket(n)
        graphs = self._family(keep)
        counts = np.fromiter(map(len, columns), dtype=np.int64, count=n)
        # prefill / mixed steps: the agents that feed more than the kept columns (joining prompts)
        wide = np.flatnonzero(counts > keep) if keep else None

        def key(b: int) -> tuple:
            return (b, n_q) if not keep else (b, n_q, self._split(b, n_q, keep, len(wide)))

        if key(B) not in graphs and B < bucket(self._peak):
            # agents finished within this batch: a larger bucket captured for this width serves the
            # last steps (one capture saved); a batch that starts this small captures its own
            B = min((k[0] for k in graphs if k[1] == n_q and B < k[0] <= bucket(self._peak)
                     and k == key(k[0])), default=B)
        if B > cache.batch_capacity:
            cache.reserve(B)
        # host bookkeeping: NumPy over [n, n_q] (views of the host lengths and page table), no
        # Python per column (a verify step's columns were a list each per agent)
        lens = cache.lens.numpy()
        base = lens[:n].copy()
        new = base + counts
        pages = cache.pages
        P = pages.page_size
        owned = pages.owned
        for slot in np.flatnonzero(-(-new // P) > np.fromiter(map(len, owned[:n]), dtype=np.int64, count=n)).tolist():
            pages.ensure(slot, int(new[slot]))  # a new page (every P rows of an agent)
        cache.grow_storage()  # the pools follow the pages ensure added
        if cache.storage_version != self._version:
            self._graphs.clear()
            self._prefills.clear()
            self._mixed.clear()
            # the dropped graphs' private pool is released with them; capturing into its id again
            # trips the allocator (H200: "use_count > 0" assert): new captures take a new pool
            self._mempool = None
            self._version = cache.storage_version
        pages.device_table()  # refreshed in place before the replay reads it
        if self.columns > 1 and B == bucket(self._peak) and not keep:
            # speculation: every width of the batch's bucket before its first replay (a smaller
            # bucket replays what it has, else this one: no capture while agents finish)
            for w in range(1, self.columns + 1):
                if (B, w) not in self._graphs:
                    self._capture(B, w)
        cap = graphs.get(key(B))
        if cap is None or (keep > 1 and cap.out["logits"].shape[1] < keep):
            cap = self._capture(B, n_q, keep, key(B)[2] if keep else B)
        if keep and len(wide):
            self.join_steps[cap.wide == B] += 1
        h = cap.staging()
        hn = h.numpy()  # pinned host memory on CUDA, viewed
        pad = self.pad_id
        toks = hn[0, :n]
        if n_q == 1:
            toks[:, 0] = [c[0] for c in columns]
        else:  # one flat list, left-padded per agent (a list per agent cost 1.6x)
            flat = []
            for c in columns:
                if len(c) < n_q:
                    flat += [pad] * (n_q - len(c))
                flat += c
            toks.reshape(-1)[:] = flat
        # column j of agent g: suffix position new[g] - n_q + j; before base[g]: padding (scratch)
        p = new[:, None] + _col_offsets(n_q)
        real = p >= base[:, None]
        pc = np.maximum(p, 0)
        rows = pages.table.numpy()[np.arange(n)[:, None], pc // P].astype(np.int64) * P + pc % P
        hn[1, :n] = np.where(real, rows, cache.scratch_row())
        # padded columns: the positions before the real ones (as AgentCache.begin), clamped
        hn[2, :n] = np.maximum(p + cache.doc_len, 0)
        self._fill_padding(h, n, cache.scratch_row())
        if cap.wide < B:
            _wide_plane(hn[3], wide, cap.wide)
        cap.upload(h)
        fed = int((toks < 0).sum())  # ids only the device knows (feedback)
        if fed:
            if feedback is None:
                raise ValueError("negative tokens need the feedback row")
            ids = cap.inp[0, :n]
            if fed == n and n_q == 1:  # every agent's token: one device copy
                ids[:, 0].copy_(feedback[:n])
            else:
                ids.copy_(torch.where(ids < 0, feedback[:n, None], ids))
        if cap.graph is not None:
            cap.graph.replay()
        else:
            cap.fn()
        lens[:n] = new
        return cap.out

    def _split(self, B: int, n_q: int, keep: int, wide: int) -> int:
        """How many agents a prefill / mixed step of B agents x n_q columns computes at every
        column when `wide` of them feed more than the kept columns (joining prompts; the rest
        attend at their last `keep` columns only, `AgentCache.attend`): SPLIT_WIDE where at most
        that many join, else B — no split; and B unless the split step attends at most half the
        query columns (B x keep + SPLIT_WIDE x n_q <= B x n_q / 2: two cascade calls and the copies
        joining them cost launches of their own). Host-tier documents do not split (each cascade
        call streams the prefix)."""
        if self.cache.streamed or wide > SPLIT_WIDE:
            return B
        return SPLIT_WIDE if 2 * (B * keep + SPLIT_WIDE * n_q) <= B * n_q else B

    def _family(self, keep: int) -> dict:
        """The captured steps of a kind by `keep` (`_replay`): decode / verify, prefill, mixed."""
        return self._graphs if not keep else self._prefills if keep == 1 else self._mixed

    def _fill_padding(self, h: torch.Tensor, n: int, scratch: int) -> None:
        """Padded rows: pad token, write to the scratch row, position doc_len - 1 (an empty suffix)."""
        if n < h.shape[1]:  # NumPy views: no tensor built per step while agents finish
            hn = h.numpy()
            hn[0, n:] = self.pad_id
            hn[1, n:] = scratch
            hn[2, n:] = self.cache.doc_len - 1

    def _capture(self, B: int, n_q: int, keep: int = 0, wide: int | None = None) -> _Captured:
        """Build the step of B agents x n_q columns (captured, or eager with capture=False); keep:
        the logits of the last `keep` columns (1: `run_prefill`; more: `run_mixed`), 0: every
        column's (n_q > 1); wide < B (keep > 0): a split step, every agent attending at its last
        `keep` columns and `wide` agents (plane 3 of the input) at every column."""
        cache, dev = self.cache, self.cache.device
        wide = B if wide is None else int(wide)
        planes = 3 if wide == B else 4
        hosts = [torch.zeros(planes, B, n_q, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(2)]
        for host in hosts:
            self._fill_padding(host, 0, cache.scratch_row())  # warm-up writes go to scratch
            if planes == 4:  # wide agents 0..wide-1 until a replay says which
                _wide_plane(host[3].numpy(), np.zeros(0, dtype=np.int64), wide)
        inp = hosts[0].to(dev, copy=True)  # never the host buffer itself (CPU)
        mask = dummy_mask(B, n_q, dev)
        out: dict[str, torch.Tensor] = {}

        def step():
            ids, rows, pos = inp[0], inp[1], inp[2]
            lens = (pos[:, -1] - cache.doc_len + 1).to(torch.int32)  # the last column's position
            cache._group = Group(sel=slice(0, B), n_q=n_q, rows=rows, lens=lens,
                                 seq=cache.pages.table.shape[1] * cache.pages.page_size,
                                 wide=inp[3].reshape(-1)[:wide] if wide < B else None,
                                 wide_pos=inp[3].reshape(-1)[wide: wide + B] if wide < B else None,
                                 narrow=keep)
            try:
                # no autograd on the eager path either (capture_step runs it under no_grad): a
                # codec table cached under inference_mode elsewhere cannot enter a tracked graph
                with torch.no_grad():
                    res = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                                     past_key_values=cache, use_cache=True, logits_to_keep=keep or n_q)
            finally:
                cache._group = None
            # greedy ids of every column inside the step (a verify step's too: no gather of the
            # kept columns and no index upload per step)
            out["logits"] = res.logits[:, -1].float() if n_q == 1 or keep == 1 else res.logits.float()
            out["greedy"] = greedy_ids(out["logits"])

        graph = None
        if self.capture:
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = capture_step(step, self.model, self._mempool, self.warmup)
        else:
            step()  # allocates the outputs the later calls overwrite
        cap = _Captured(graph, step, hosts, inp, out, wide)
        self._family(keep)[(B, n_q) if not keep else (B, n_q, wide)] = cap
        self.captures += 1
        self.total_captures += 1
        return cap
