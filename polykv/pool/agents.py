"""AgentBatch: the low-level interface of N agents over one shared document.

    batch = pool.open_batch(doc)          # holds a reference on the document until close()
    aid = batch.add(prompt_ids)           # queue the agent's suffix tokens (prefilled at next step)
    logits = batch.step()                 # {aid: float32 [vocab]} next-token logits, every live agent
    batch.set_sampling(aid, temperature=0.8, top_p=0.95, seed=7)  # the agent's own draws (optional)
    tokens = batch.step_tokens()          # {aid: next token id}, chosen on the device (greedy default)
    batch.feed({aid: token_id, ...})      # queue one more token per agent
    ahead = batch.step_tokens_ahead()     # pipelined: the chosen ids feed the next step on the device;
    tokens = ahead.result()               #   read them after launching that step (PendingTokens)
    batch.feed_drafts({aid: [d1, d2, ...]})  # speculative: guesses to verify after the fed token
    emitted = batch.step_verify()         # {aid: [accepted drafts..., next token]}, rejects rolled back
    pending = batch.launch_verify()       #   or in two halves: launched (the device runs the step),
    emitted = pending.result()            #   host work in between, then the ids read (PendingVerify)
    batch.remove(aid); len(batch); batch.close()

Semantics
* Every agent sees the whole document (the pool's shared compressed prefix, never copied) followed by
  its own tokens; positions continue after the prefix (position = doc_len + suffix index).
* `step()` runs the pending tokens of all agents in batched forwards: agents with exactly one pending
  token (decode) in one forward, agents with several (prompt prefill) in another, left-padded to the
  longest; different suffix lengths share one batch. Agents with nothing pending are not recomputed:
  their previous logits are returned again.
* Each agent's suffix K/V is private, compressed with the pool's codecs, in fixed-size pages
  (`polykv.cache.pages`): an agent holds the pages its length needs, growth takes a free page (no
  copy), a removed agent's pages are reused, and the last slot's page-table row moves into the hole
  (live agents always occupy slots 0..n-1; no K/V row is copied).
* Speculative verification (`polykv.spec`): drafts queued after an agent's pending token run in one
  more forward (left-padded, n_q = pending + drafts, logits of every draft column kept); each column's
  token is chosen exactly as a plain step would choose it (argmax, or the agent's own counter-based
  draw at that token index), the drafts that match are accepted, plus the token after them. The
  rows of rejected drafts are rolled back: the slot's length is cut back (`AgentCache.truncate`), so
  the next forward overwrites them and attention never reads them — the cache is then exactly what
  it would be had they never been fed.
* Pipelined decoding (`step_tokens_ahead`, what `SharedKVPool.generate` runs without speculation):
  the ids a step chooses are written into the batch's feedback row (`_fb`, one device int64 per
  slot) and each computed agent gets a pending token that says "mine is in the feedback row"
  (`_ON_DEVICE`); the next step copies that row into its token column on the device. Rows and
  positions of a step do not depend on its tokens, so the host builds and launches step t+1 while
  the device still computes step t, and reads step t's ids afterwards (a non-blocking copy into
  pinned memory with a CUDA event: `PendingTokens.result` waits for that step only). The host
  learns a token one step late: an agent that stops on it has already been fed into the next step,
  whose token for it is dropped when the agent is removed (its rows go with its slot, as any
  removed agent's). The token lists (`tokens`) hold `_ON_DEVICE` until the ids are read.
* On CUDA, a decode step of agents in slots 0..n-1 replays a captured CUDA graph
  (`decode_graph.py`; `graphs=False` or POLYKV_CUDA_GRAPHS=0 keeps it eager). A batch over a
  host-tier document streams its prefix (`attention.PrefixStreamer`): the captured step holds the
  chunk copies as memcpy nodes on a forked branch, overlapped with the cascade as when eager.
* Reuse: `close()` hands the suffix storage and the captured steps back to the pool, which parks
  them for the next batch of the same document (`SharedKVPool.open_batch`: same backend and graphs
  setting, enough slots); that batch starts from `AgentCache.reset` — no agent, every page free in a
  fresh table's order, the same pools, so the captured steps stay valid and its outputs equal a
  fresh batch's. Sampling rows are per batch (never reused). `graph_captures` counts this batch's
  own captures.
* Recent windows (`SharedKVPool(recent=R)` / a preset's R; `polykv.pool.ring`): each agent's last
  R suffix rows per layer are also held at q8_0 and every query reads its own window (p - R, p]
  from there. `expect_drafts(k)` (and `feed_drafts` beyond it) gives the windows k spare rows, so a
  rollback of rejected drafts keeps them exact; a removed agent's window rows are copied with the
  slot move. Such steps are captured on CUDA like any other (`decode_graph.graphs_supported`;
  tests/pool/test_ring_static.py).
* A batch is not thread-safe by itself; use one batch per thread (the pool is thread-safe).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch

from ..generation import SamplingRows, greedy_ids

_slot, _drafts = operator.attrgetter("slot"), operator.attrgetter("drafts")

_ON_DEVICE = -1
"""A pending token chosen by `step_tokens_ahead` and not read on the host yet: the step that takes it
reads it from the batch's feedback row (`AgentBatch._fb[slot]`). Token ids are never negative."""


@dataclass
class _Agent:
    aid: int
    slot: int
    pending: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # suffix tokens processed so far
    drafts: int = 0  # the last `drafts` pending tokens are speculative (verified, maybe rolled back)
    logits: torch.Tensor | None = None
    sampling: tuple[bool, bool] | None = None  # set_sampling: (draws at random, top-k/top-p filtered)


class AgentBatch:
    """See module doc. Created by `SharedKVPool.open_batch`; usable as a context manager."""

    def __init__(self, pool, doc, capacity: int | None = None, seq_capacity: int | None = None,
                 backend: str = "auto", graphs: bool = True, parked: "Parked | None" = None):
        from .agent_cache import AgentCache

        self.pool = pool
        self.doc = doc
        self.doc_id = doc.id
        self.backend, self.graphs = backend, bool(graphs)
        self._graphs = None  # captured decode steps (CUDA), see decode_graph.py
        if parked is not None:  # a closed batch's storage and captured steps (SharedKVPool.open_batch)
            self.cache, self._graphs = parked.cache, parked.graphs
            self.cache.reset()
            if seq_capacity:
                self.cache.reserve_rows([seq_capacity] * (capacity or 4))
            if self._graphs is not None:
                self._graphs.reset()
        else:
            self.cache = AgentCache(doc.layers, doc.prefix_start, doc.length, pool._windows,
                                    batch_capacity=capacity or 4, seq_capacity=seq_capacity or 0,
                                    backend=backend, device=pool.device, recent=getattr(pool, "recent", 0))
        if graphs and self._graphs is None:
            from .decode_graph import DecodeGraphs, graphs_supported

            if graphs_supported(self.cache):
                self._graphs = DecodeGraphs(pool.model, self.cache, pool._pad_id)
        self._own_graphs = self._graphs  # parked with the cache at close (a replaced one is not)
        self._agents: dict[int, _Agent] = {}
        self._slots: list[int] = []  # slot -> aid
        self._ids = itertools.count()
        self._closed = False
        self._failed = False  # a forward raised: close() frees the storage instead of parking it
        self.peak_bytes = self.cache.nbytes()
        self._rows = SamplingRows(self.cache.batch_capacity, pool.device)  # per-slot set_sampling
        # the feedback row: int64 [slots] on the device, the id step_tokens_ahead chose for each slot
        self._fb = torch.zeros(self.cache.batch_capacity, dtype=torch.long, device=pool.device)
        self._ahead: list[PendingTokens] = []  # step_tokens_ahead results not read yet
        self._verifying: PendingVerify | None = None  # launch_verify's step until its result()

    @property
    def graph_captures(self) -> int:
        """Decode / verify steps this batch captured (CUDA graphs; each costs warm-up forwards plus
        the capture, once per batch bucket and width). Steps captured by an earlier batch whose
        cache and graphs this one reuses do not count: 0 when every step it ran was already
        captured, and 0 without captured steps."""
        return self._graphs.captures if self._graphs is not None else 0

    @property
    def join_steps(self) -> tuple[int, int]:
        """(split, unsplit): the captured prefill / mixed steps of this batch where agents fed more
        than the kept columns (joining prompts), by whether their attention split
        (`DecodeGraphs._split`); (0, 0) without captured steps."""
        return tuple(self._graphs.join_steps) if self._graphs is not None else (0, 0)

    # --- agents ------------------------------------------------------------------------------
    def add(self, prompt_ids: list[int]) -> int:
        """Add an agent whose suffix is `prompt_ids` (token ids after the document; at least one).
        The suffix is prefilled at the next `step()` (batched with other new agents)."""
        self._check_open()
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("an agent needs at least one suffix token")
        aid = next(self._ids)
        slot = len(self._slots)
        if slot >= self.cache.batch_capacity:
            version = self.cache.storage_version
            self.cache.reserve(max(2 * self.cache.batch_capacity, slot + 1))
            self._grown(version)
        self.cache.clear_slot(slot)
        self._rows.reserve(slot + 1)
        if slot >= self._fb.numel():
            self._fb = torch.cat([self._fb, self._fb.new_zeros(max(slot + 1, 2 * self._fb.numel()) - self._fb.numel())])
        self._slots.append(aid)
        self._agents[aid] = _Agent(aid, slot, pending=ids)
        return aid

    def growth_bytes(self, rows: list[int]) -> int:
        """Bytes the suffix storage may grow by before agents of rows[i] suffix rows each — all of
        the batch's, running and joining — fit (`AgentCache.growth_bytes`): what they may cost beyond
        the bytes held now."""
        self._check_open()
        return self.cache.growth_bytes(rows)

    def reserve(self, rows: list[int]) -> None:
        """Allocate pages now for agents of rows[i] suffix rows each (prompt + new tokens), so
        that they grow without reallocating storage (which would also drop captured steps)."""
        self._check_open()
        version = self.cache.storage_version
        self.cache.reserve_rows(rows)
        self._grown(version)

    def _grown(self, version: int) -> None:
        """Storage may have grown since `version`: the pool drops parked batches over its budget."""
        if self.cache.storage_version != version:
            self.pool._grown()

    def set_sampling(self, aid: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = 0,
                     seed: int = 0, start: int = 0) -> None:
        """Give agent `aid` its own sampling parameters for `step_tokens` (`generation.choose_tokens`:
        its draws depend on (seed, token index, vocabulary id) only, not on the other agents);
        `start`: index of its next token (a re-added agent continues its stream). Written to the
        batch's device rows once, not per step."""
        from ..generation import is_greedy

        a = self._get(aid)
        self._rows.set(a.slot, temperature, top_p, top_k or 0, seed, start)
        a.sampling = (not is_greedy(temperature, top_k), bool(top_k and top_k > 0) or top_p < 1.0)

    def expect_drafts(self, k: int) -> None:
        """Agents of this batch will verify up to k drafts per step: a captured step (CUDA) builds
        every width 1..k+1 of its bucket on its first step (`DecodeGraphs.expect_columns`) instead
        of capturing a width when it is first used mid-run. No effect without captured steps."""
        self._check_open()
        if k > 0:  # recent windows keep k spare rows: a rollback of rejected drafts stays exact
            version = self.cache.storage_version
            self.cache.reserve_ring_spare(int(k))
            self._grown(version)
        if self._graphs is not None and k > 0:
            self._graphs.expect_columns(int(k) + 1)

    def feed(self, tokens: dict[int, int], drafts: dict[int, list[int]] | None = None) -> None:
        """Queue one token per agent ({aid: token_id}) for the next step; drafts: as `feed_drafts`
        after them (the speculative loop's one call per step)."""
        if self._verifying is not None:
            self._check_idle()
        agents = self._agents
        for aid, t in tokens.items():
            t = int(t)
            if t < 0:
                raise ValueError(f"agent {aid}: token ids are not negative (got {t})")
            a = agents.get(aid)
            if a is None:
                self._get(aid)  # raises
            a.pending.append(t)
        if drafts:
            self.feed_drafts(drafts)

    def feed_drafts(self, drafts: dict[int, list[int]]) -> None:
        """Queue draft tokens ({aid: [d1, ...]}) after each agent's pending token(s), to be verified
        by the next `step_verify` (an agent needs a pending token first: its last chosen one)."""
        if self._verifying is not None:
            self._check_idle()
        agents = self._agents
        for aid, ds in drafts.items():
            a = agents.get(aid)
            if a is None:
                self._get(aid)  # raises
            if ds:
                if not a.pending:
                    raise ValueError(f"agent {aid}: drafts need a pending token to follow")
                a.pending += map(int, ds)
                a.drafts += len(ds)
                if self.cache.rings is not None and a.drafts > self.cache.rings.spare:
                    version = self.cache.storage_version
                    self.cache.reserve_ring_spare(a.drafts)  # expect_drafts did not cover it
                    self._grown(version)

    def remove(self, aid: int) -> None:
        """Drop an agent and free its suffix slot."""
        if self._verifying is not None:
            self._check_idle()
        a = self._agents.pop(aid)
        last = len(self._slots) - 1
        if a.slot != last:
            moved = self._agents[self._slots[last]]
            self.cache.move_slot(last, a.slot)
            if moved.sampling is not None:
                self._rows.move(last, a.slot)
            if _ON_DEVICE in moved.pending:  # its fed token moves with it (after the step writing it)
                self._fb[a.slot].copy_(self._fb[last])
            moved.slot = a.slot
            self._slots[a.slot] = moved.aid
        else:
            self.cache.clear_slot(last)
        self._slots.pop()

    def __len__(self) -> int:
        return len(self._agents)

    def __contains__(self, aid: int) -> bool:
        return aid in self._agents

    def agents(self) -> list[int]:
        return list(self._agents)

    def tokens(self, aid: int) -> list[int]:
        """Suffix tokens of agent `aid` processed so far (prompt + fed tokens); reads the ids of
        every `step_tokens_ahead` not read yet (waits for them)."""
        a = self._get(aid)
        for p in list(self._ahead):
            p.result()
        return list(a.tokens)

    def suffix_length(self, aid: int) -> int:
        return int(self.cache.lens[self._get(aid).slot])

    def nbytes(self) -> int:
        """Measured bytes of this batch's private suffix storage."""
        return 0 if self._closed else self.cache.nbytes()

    # --- compute -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> dict[int, torch.Tensor]:
        """Run all pending tokens; return {aid: float32 [vocab] next-token logits (CPU)} for every
        live agent whose logits are known (see module doc). One device-to-host copy per forward."""
        for group, logits, _ in self._run_pending():
            cpu = logits.float().cpu()
            for g, a in enumerate(group):
                a.logits = cpu[g]
        return {aid: a.logits for aid, a in self._agents.items() if a.logits is not None}

    @torch.no_grad()
    def step_tokens(self) -> dict[int, int]:
        """Run all pending tokens and choose each computed agent's next token on the device; one
        device-to-host copy of the chosen ids per call. Agents given `set_sampling` choose with their
        own parameters and seeds (`SamplingRows.choose`: one vectorised draw per forward); the others
        greedily. Returns {aid: token id} for the agents that had pending tokens. Drafts
        (`feed_drafts`) need `step_verify`."""
        if self._verifying is not None:
            self._check_idle()
        if any(a.drafts for a in self._agents.values()):
            raise RuntimeError("agents have drafts pending: use step_verify()")
        return self._choose(self._run_pending())

    @torch.no_grad()
    def step_tokens_ahead(self) -> "PendingTokens":
        """`step_tokens` without waiting for the ids (pipelined decoding, module doc): run all
        pending tokens, choose each computed agent's next token on the device and feed it straight
        back — it becomes the agent's pending token, which the next step reads on the device, never
        through the host — and start one non-blocking copy of the ids to the host. Returns at once
        (on CUDA typically before the device has run the step); `PendingTokens.result()` waits for
        this step's ids only, so the host can launch the next step first. An agent that must not
        take its token (EOS, a stop string, enough tokens) has been fed anyway: `remove` it (the
        next step's token for it is wasted; its rows go with its slot). On CPU the same code runs
        (the copy is immediate): tokens equal `step_tokens` + `feed` of those tokens."""
        if self._verifying is not None:
            self._check_idle()
        if any(a.drafts for a in self._agents.values()):
            raise RuntimeError("agents have drafts pending: use step_verify()")
        chosen = self._chosen(self._run_pending())
        fed = []
        for group, ids in chosen:
            first = group[0].slot
            if group[-1].slot - first == len(group) - 1:  # sorted distinct slots: a range, a view
                self._fb[first: first + len(group)].copy_(ids)
            else:
                self._fb.index_copy_(0, torch.tensor([a.slot for a in group], device=ids.device), ids)
            for a in group:
                fed.append((a, len(a.tokens) + len(a.pending)))  # where the token lands in its stream
                a.pending.append(_ON_DEVICE)
        if not chosen:  # no agent had a pending token
            ids = self._fb[:0]
        else:
            ids = torch.cat([ids for _, ids in chosen]) if len(chosen) > 1 else chosen[0][1]
        event = None
        if ids.device.type == "cuda":
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = ids.clone()  # a captured step's outputs are rewritten by the next step
        pending = PendingTokens(self, fed, host, event)
        self._ahead.append(pending)
        return pending

    def _choose(self, groups) -> dict[int, int]:
        """The token choice of `step_tokens` over `_run_pending`'s groups: {aid: id}, one copy."""
        chosen = self._chosen(groups)
        out: dict[int, int] = {}
        if chosen:
            agents = [a for group, _ in chosen for a in group]
            for a, t in zip(agents, _to_host(torch.cat([ids for _, ids in chosen]))):
                out[a.aid] = t
        return out

    def _chosen(self, groups) -> list[tuple[list[_Agent], torch.Tensor]]:
        """Each group's chosen ids on the device: [(agents, int64 [G])]: the argmax (a captured
        step's own), or `SamplingRows.choose` for agents given `set_sampling` (one vectorised draw
        per forward). Clears the agents' cached logits."""
        out = []
        for group, logits, greedy in groups:
            ids = greedy if greedy is not None else torch.argmax(logits, dim=-1)
            own = [a.sampling for a in group]
            mine = [s for s in own if s is not None]
            if any(s[0] for s in mine):  # greedy own rows need no parameters: the argmax above
                if group[-1].slot == len(group) - 1:  # sorted distinct slots: 0..G-1, a view
                    rows = slice(0, len(group))
                else:
                    rows = torch.tensor([a.slot for a in group], dtype=torch.long, device=logits.device)
                drawn = self._rows.choose(logits, rows, filtered=any(s[1] for s in mine), greedy_ids=greedy)
                if len(mine) == len(own):  # every row its own parameters (no host-built mask to copy)
                    ids = drawn
                else:
                    has = torch.tensor([s is not None for s in own], device=ids.device)
                    ids = torch.where(has, drawn, ids)
            for a in group:
                a.logits = None
            out.append((group, ids))
        return out

    @torch.no_grad()
    def step_verify(self) -> dict[int, list[int]]:
        """Run all pending tokens, drafts included; return {aid: emitted token ids} for the agents
        that had pending tokens: [next token] for an agent without drafts (as `step_tokens`), the
        accepted drafts + the token after them for one with drafts (module doc); the rows of its
        rejected drafts are rolled back and its sampling counter advances by the emitted count. One
        device-to-host copy of the chosen ids per call. `launch_verify().result()`."""
        return self.launch_verify().result()

    @torch.no_grad()
    def launch_verify(self) -> "PendingVerify":
        """`step_verify` in two halves: launch the step (the forwards, the token choice on the
        device, one non-blocking copy of the chosen ids to pinned host memory and a CUDA event)
        and return at once; `PendingVerify.result()` waits for that copy and does the host half
        (acceptance, rollback, the agents' token lists). Between the two the host may work while
        the device runs the step — `SharedKVPool.generate` adds the outputs tree's logged tokens
        there — but must not touch the batch (feed, remove, another step: refused until
        `result()`). On CPU the step has run when this returns. A step where an agent samples
        (`set_sampling`) with drafts chooses its tokens here (`_verify_drawn`, one blocking copy)."""
        self._check_open()
        self._check_idle()
        # one forward for the drafting agents and the plain decoders (one pending token) beside
        # them: a second forward would cost the whole weight read and prefix pass again
        agents = self._agents.values()
        drafting = any(a.drafts for a in agents)
        verifiers, plain = [], []
        for a in agents:
            if a.pending:
                (verifiers if a.drafts or (drafting and len(a.pending) == 1) else plain).append(a)
        plain_agents, ids = [], []
        keep, rows, mixed = 0, None, None
        if verifiers:
            verifiers.sort(key=_slot)
            keep = max(map(_drafts, verifiers)) + 1
            if plain and self._graphs is not None:
                widest = max(len(a.pending) for a in plain)
                if self._graphs.prefills(len(self._slots), widest):  # prompts join: one forward for all
                    mixed = self._prefill(plain, verifiers, keep)
        if plain:  # prompt prefills (and every decoder when nobody drafts): ids on the device
            for group, gids in self._chosen([mixed[0]] if mixed is not None else self._run_pending(plain)):
                plain_agents += group
                ids.append(gids)
        if verifiers:
            # [G, keep, vocab], [G, keep] or None
            logits, greedy = mixed[1] if mixed is not None else self._forward(verifiers, keep=keep)
            drawn = [a.sampling is not None and a.sampling[0] for a in verifiers]
            if any(drawn):
                rows = self._verify_drawn(verifiers, drawn, logits, keep)
            else:  # greedy: every column's argmax (the step's own when captured), one copy
                ids.append(greedy if greedy is not None else greedy_ids(logits))
        pending = PendingVerify(self, plain_agents, verifiers, keep, rows, _copy_to_host(ids))
        self._verifying = pending
        return pending

    def _verify_drawn(self, verifiers: list[_Agent], drawn: list[bool], logits: torch.Tensor, keep: int) -> list[list[int]]:
        """step_verify's token choice when some agent samples: per agent its chosen ids of its own
        columns (pending token, drafts) — argmax, or its counter-based draw at that token index
        (`SamplingRows.draw`) — and its sampling counter advanced by what it will emit. Returns one
        list per verifier, right-aligned to `keep` as the greedy path's rows (only the agent's last
        drafts + 1 entries are read)."""
        dev = logits.device
        gi, ci = [], []  # one host list pair, one copy: the (agent, column) rows of `flat`
        for g, a in enumerate(verifiers):
            gi += [g] * (a.drafts + 1)
            ci += range(keep - a.drafts - 1, keep)
        idx = torch.tensor([gi, ci], dtype=torch.long).to(dev)
        flat = logits[idx[0], idx[1]]
        ids = torch.argmax(flat, dim=-1)
        cols = [(g, j) for g, a in enumerate(verifiers) for j in range(a.drafts + 1)]
        slots = torch.tensor([verifiers[c[0]].slot for c in cols], dtype=torch.long, device=dev)
        offset = torch.tensor([c[1] for c in cols], dtype=torch.long, device=dev)
        filtered = any(a.sampling[1] for a, d in zip(verifiers, drawn) if d)
        sampled = self._rows.draw(flat, slots, offset, filtered=filtered, greedy_ids=ids)
        mask = torch.tensor([drawn[c[0]] for c in cols], device=dev)
        flat_ids = _to_host(torch.where(mask, sampled, ids))
        rows, advance, pos = [], [], 0
        for a in verifiers:
            n = a.drafts + 1
            mine = flat_ids[pos: pos + n]
            pos += n
            drafts = a.pending[len(a.pending) - a.drafts:]
            m = 0
            while m < a.drafts and drafts[m] == mine[m]:
                m += 1
            advance.append(m + 1)
            rows.append([0] * (keep - n) + mine)
        slots = torch.tensor([a.slot for a in verifiers], dtype=torch.long, device=dev)
        self._rows.advance(slots, torch.tensor(advance, dtype=torch.long, device=dev))
        return rows

    def _run_pending(self, agents=None) -> list[tuple[list[_Agent], torch.Tensor, torch.Tensor | None]]:
        """Forward every agent (of `agents`, default all) with pending tokens: decoders (one token)
        together, prompt prefills together. Returns [(agents, logits [G, vocab] on the device, greedy
        ids [G] or None)]."""
        self._check_open()
        if self._verifying is not None:
            self._check_idle()
        todo = [a for a in (self._agents.values() if agents is None else agents) if a.pending]
        widest = max((len(a.pending) for a in todo), default=0)
        if self._graphs is not None and widest > 1 and self._graphs.prefills(len(self._slots), widest):
            return [self._prefill(todo)[0]]
        done = []
        for group in ([a for a in todo if len(a.pending) == 1], [a for a in todo if len(a.pending) > 1]):
            if group:
                group = sorted(group, key=lambda a: a.slot)
                logits, greedy = self._forward(group)
                for a in group:
                    a.tokens.extend(a.pending)
                    a.pending = []
                done.append((group, logits, greedy))
        self.peak_bytes = max(self.peak_bytes, self.cache.nbytes())
        return done

    def _prefill(self, todo: list[_Agent], verifiers: list[_Agent] = (), keep: int = 0):
        """`_run_pending`'s forward on the captured prefill step (`DecodeGraphs.run_prefill`): the
        agents of `todo` feed their pending tokens, every other agent of the batch waits (padding);
        one forward where the eager path runs two (decoders, then the several-token feeds).
        verifiers (sorted by slot; `launch_verify`, prompts joining them): agents that verify drafts
        in the same step (`DecodeGraphs.run_mixed`), one forward where a prefill step and a verify
        step would run. Returns ((todo by slot, their last column's logits [P, vocab], greedy ids
        [P]), the verifiers' (logits [G, keep, vocab], greedy ids [G, keep]) as `_forward(verifiers,
        keep)` gives them, or None)."""
        columns: list[list[int]] = [[] for _ in self._slots]
        for a in [*todo, *verifiers]:
            columns[a.slot] = a.pending
        try:
            if verifiers:
                logits, greedy = self._graphs.run_mixed(columns, keep, self._fb)
            else:
                logits, greedy = self._graphs.run_prefill(columns, self._fb)
        except BaseException:
            self._failed = True  # as `_forward`: storage and graphs of a failed forward are not handed on
            raise
        verified = None
        if verifiers:
            if verifiers[-1].slot == len(verifiers) - 1:  # slots 0..G-1: a view
                mine = slice(0, len(verifiers))
            else:
                mine = torch.tensor([a.slot for a in verifiers], dtype=torch.long, device=logits.device)
            verified = logits[mine], greedy[mine]
            logits, greedy = logits[:, -1], greedy[:, -1]  # the prompts' last column
        group = sorted(todo, key=_slot)
        if len(group) < len(columns):  # only the agents that fed: their rows
            rows = torch.tensor([a.slot for a in group], dtype=torch.long, device=logits.device)
            logits, greedy = logits[rows], greedy[rows]
        for a in group:
            a.tokens.extend(a.pending)
            a.pending = []
        self.peak_bytes = max(self.peak_bytes, self.cache.nbytes())
        return (group, logits, greedy), verified

    def _forward(self, group: list[_Agent], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of `group` (left-padded). keep = 0: logits [G, vocab] of each agent's last
        column (+ greedy ids from a captured step, else None); keep > 0: logits [G, keep, vocab] of
        the last `keep` columns (verification)."""
        try:
            return self._forward_once(group, keep)
        except BaseException:
            self._failed = True  # storage and graphs of a failed forward are not handed on (close)
            raise

    def _forward_once(self, group: list[_Agent], keep: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        pending = [a.pending for a in group]
        n_q = max(map(len, pending))
        # sorted distinct slots ending at len - 1: slots 0..G-1
        if self._graphs is not None and group[-1].slot == len(group) - 1:
            if not keep and n_q == 1:
                return self._graphs.run([p[0] for p in pending], self._fb)
            if keep:  # a verification step: captured per (bucket, exact width), greedy ids computed inside
                return self._graphs.run_columns(pending, keep, self._fb, greedy=True)
        model = self.pool.model
        counts = [len(a.pending) for a in group]
        ids = torch.full((len(group), n_q), self.pool._pad_id, dtype=torch.long)
        for g, a in enumerate(group):
            ids[g, n_q - len(a.pending):] = torch.tensor(a.pending, dtype=torch.long)
        cache = self.cache
        cache.begin([a.slot for a in group], counts, n_q)
        try:
            dev = self.pool.device
            ids = ids.to(dev)
            if any(_ON_DEVICE in a.pending for a in group):  # fed on the device by step_tokens_ahead
                fb = self._fb[cache._group.sel]
                ids = torch.where(ids < 0, fb[:, None], ids)
            out = model(input_ids=ids, position_ids=cache.positions().to(dev),
                        attention_mask=_mask(len(group), n_q, dev), past_key_values=cache,
                        use_cache=True, logits_to_keep=max(1, keep))
        except BaseException:
            cache.abort()
            raise
        cache.commit()
        if keep:
            return out.logits[:, -keep:], None
        return out.logits[:, -1], None

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the document reference and hand the suffix storage back to the pool (idempotent).
        The pool parks the storage and the captured steps for the next batch of the same document
        (`SharedKVPool.open_batch`; bounded, counted in memory_report(), dropped under budget
        pressure) or frees them."""
        if self._closed:
            return
        self._closed = True
        self._agents.clear()
        self._slots.clear()
        self._ahead.clear()
        self._verifying = None
        graphs = self._graphs if self._graphs is self._own_graphs else None
        parked = None if self._failed else Parked(self.cache, graphs, self.backend, self.graphs, self.doc_id)
        self.cache = None
        self._graphs = self._own_graphs = None
        self.pool._release(self, parked)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    def _get(self, aid: int) -> _Agent:
        self._check_open()
        try:
            return self._agents[aid]
        except KeyError:
            raise KeyError(f"no live agent {aid} in this batch") from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AgentBatch is closed")

    def _check_idle(self) -> None:
        if self._verifying is not None:
            raise RuntimeError("a launch_verify() step is in flight: read its result() first")


class PendingTokens:
    """The ids one `AgentBatch.step_tokens_ahead` chose, on their way to the host: a pinned buffer
    filled by a non-blocking copy, and the CUDA event recorded after it (None on CPU, where the copy
    is done at once). `result()` waits for that event only — not for steps launched after it."""

    def __init__(self, batch: AgentBatch, fed: list[tuple[_Agent, int]], host: torch.Tensor, event):
        self._batch = batch
        self._fed = fed  # (agent, index of its chosen token in tokens + pending)
        self._host, self._event = host, event
        self._out: dict[int, int] | None = None

    @property
    def agents(self) -> list[int]:
        """The agents the step computed, in the order of its ids."""
        return [a.aid for a, _ in self._fed]

    def ready(self) -> bool:
        """True when `result()` would not wait."""
        return self._out is not None or self._event is None or self._event.query()

    def result(self) -> dict[int, int]:
        """{aid: chosen id} of the step (waits for its copy, once). Agents still in the batch have
        the id written into their token lists in place of `_ON_DEVICE`."""
        if self._out is None:
            if self._event is not None:
                self._event.synchronize()
            ids = self._host.tolist()
            live = self._batch._agents
            out = {}
            for (a, k), t in zip(self._fed, ids):
                out[a.aid] = t
                if live.get(a.aid) is a:
                    j = k - len(a.tokens)
                    if j < 0:
                        a.tokens[k] = t
                    elif j < len(a.pending) and a.pending[j] == _ON_DEVICE:
                        a.pending[j] = t  # not taken by a step yet: an ordinary pending token now
            self._out = out
            if self in self._batch._ahead:
                self._batch._ahead.remove(self)
        return self._out


class PendingVerify:
    """One `AgentBatch.launch_verify` step on its way to the host: the chosen ids of its plain
    agents (one int64 [G] per forward) and of its verifiers' columns (int64 [G, keep]) in host
    buffers — pinned, filled by non-blocking copies, with one CUDA event after them (None on CPU,
    where they are filled at once) — or, when an agent samples, the verifiers' rows already on the
    host. `result()` waits for that event only and does the step's host half: each verifier's
    drafts compared with its own columns (the first mismatch ends the accepted run; the token
    chosen there is emitted after it), the rejected rows rolled back (all slots in one
    `AgentCache.rollback`), the agents' token lists."""

    def __init__(self, batch: AgentBatch, plain: list[_Agent], verifiers: list[_Agent], keep: int,
                 rows: list[list[int]] | None, copied: tuple[list[torch.Tensor], object]):
        self._batch, self._plain, self._verifiers, self._keep, self._rows = batch, plain, verifiers, keep, rows
        self._hosts, self._event = copied
        self._out: dict[int, list[int]] | None = None

    def ready(self) -> bool:
        """True when `result()` would not wait for the device."""
        return self._out is not None or self._event is None or self._event.query()

    def result(self) -> dict[int, list[int]]:
        """{aid: emitted ids} (`AgentBatch.step_verify`'s return), computed once."""
        if self._out is not None:
            return self._out
        batch = self._batch
        batch._check_open()
        if self._event is not None:
            self._event.synchronize()
        hosts, verifiers = self._hosts, self._verifiers
        out: dict[int, list[int]] = {}
        if self._plain:
            flat = []
            for h in (hosts[:-1] if verifiers and self._rows is None else hosts):
                flat += h.tolist()
            for a, t in zip(self._plain, flat):
                out[a.aid] = [t]
        if verifiers:
            keep = self._keep
            chosen = self._rows if self._rows is not None else hosts[-1].tolist()
            cut_slots, cuts = [], []
            for a, mine in zip(verifiers, chosen):
                d = a.drafts
                pending = a.pending
                if d:
                    # agent g's columns: keep - d - 1 .. keep - 1 (its pending token, its drafts)
                    mine = mine[keep - d - 1:]
                    base = len(pending) - d
                    m = 0
                    while m < d and pending[base + m] == mine[m]:
                        m += 1
                    out[a.aid] = pending[base: base + m] + [mine[m]]
                    if m < d:  # rejected drafts: their rows rolled back below
                        del pending[base + m:]
                        cut_slots.append(a.slot)
                        cuts.append(d - m)
                else:
                    out[a.aid] = [mine[-1]]
                a.tokens += pending
                a.pending, a.drafts, a.logits = [], 0, None
            if cuts:  # rejected rows rolled back, all agents at once
                batch.cache.rollback(cut_slots, cuts)
        batch.peak_bytes = max(batch.peak_bytes, batch.cache.nbytes())
        batch._verifying = None
        self._out = out
        return out


def _copy_to_host(ids: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """Host copies of device id tensors: on CUDA pinned buffers filled by non-blocking copies and
    one event recorded after them (read once it has passed); elsewhere plain copies made now (a
    static step's outputs are rewritten by the next step)."""
    if not ids or ids[0].device.type != "cuda":
        return [t.clone() for t in ids], None
    hosts = []
    for t in ids:
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t.contiguous(), non_blocking=True)  # a verify grid is a column slice of the step's output
        hosts.append(h)
    event = torch.cuda.Event()
    event.record()
    return hosts, event


@dataclass
class Parked:
    """A closed batch's suffix storage and captured steps, kept by the pool for the next batch of
    the same document: reused only with the same backend and graphs setting, over the same
    document layers (a tier move or re-prefill makes new layers: the pool drops parked sets then)."""

    cache: object  # AgentCache (its doc_layers: the layers the captured steps read)
    graphs: object | None  # DecodeGraphs or None
    backend: str
    graphs_on: bool  # open_batch(graphs=...) of the batch that built it
    doc_id: str = ""
    since: float = 0.0  # time.monotonic() when parked

    def nbytes(self) -> int:
        from ..cache.accounting import storage_bytes

        return storage_bytes(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Device tensors it holds: suffix page pools and prefix-stream buffers."""
        return self.cache.tensors() + self.cache.buffer_tensors()


def _to_host(ids: torch.Tensor) -> list[int]:
    """The one device-to-host copy of a `step_tokens` call."""
    return ids.tolist()


def _mask(batch, q_len, device):
    from .agent_cache import dummy_mask

    return dummy_mask(batch, q_len, device)
