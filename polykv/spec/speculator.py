"""Per-agent speculation state for a batch loop (`SharedKVPool.generate`, the engine).

    cfg = SpecConfig.parse({"method": "prompt_lookup", "num_draft_tokens": 4})
    spec = Speculator(index=doc_ngram_index, tree=doc_outputs_tree, device_type="cpu",
                      times=doc_step_times)   # StepTimes kept across calls (optional)
    spec.add(key, prompt_ids, cfg)            # an agent and its suffix prompt
    spec.record(key, emitted, drafted)        # after a step: acceptance, contexts, outputs tree
    spec.observe_step(width, seconds, agents) # a decode step's whole wall, drafting in (no prefill, no capture)
    spec.ahead()                              # overlap mode: while the device runs a step
    spec.plain_next({key: limit})             # the next step decided plain ahead: launch it pipelined
    drafts = spec.propose_all({key: limit})   # every agent's guesses for the next step, one width
    drafts = spec.propose(key, limit)         # one agent's guesses, its own AdaptiveLength
    spec.stats()                              # {steps, drafted, accepted, tokens, ...}

Methods: "prompt_lookup" (`PromptLookup` over the document's `NgramIndex` and the agent's own
tokens), "suffix_tree" (`SuffixTreeDrafter`: the document's outputs tree, then prompt lookup),
"draft_model" (`DraftModel`, given as `draft_model=`). How many drafts: `propose_all` drafts up to
num_draft_tokens for every agent, then the batch's `WidthPlanner` picks one width for the step from
the measured step times and every agent's acceptance and cuts every draft to it (a step costs its
widest agent); `propose` (the engine) lets each agent's `AdaptiveLength` decide alone. With
`adaptive` false: always num_draft_tokens.

Overlap (`overlap=True`, what `SharedKVPool.generate` uses): the loop calls `ahead()` between
launching a verify step and reading its ids, and `ahead` adds the outputs tree's logged tokens
(the outputs of every step read so far) — the largest host cost of a suffix-tree step, ~0.2 ms at
32 agents on the 2-core CPU — while the device computes. `propose_all` then reads the tree without
adding what was logged since (`SuffixTree.propose(flush=False)`: the context's tails from the
agent's handle, which lacks the last step's tokens, walked on through them): drafts for step t+1
see the outputs of steps <= t-1 (every agent's, its own included), the context itself up to step
t. Drafts only change what is proposed, never what is emitted:
greedy stays exact and sampling keeps its rule. Prompt lookup reads no tree: its drafts are the
same in both modes. Drafting itself cannot run ahead: every draft continues the token the step in
flight emits (docs/speculative.md, "Overlap").
"""

from __future__ import annotations

from dataclasses import dataclass

from collections import Counter

from .adaptive import AdaptiveLength, StepCost, StepTimes, WidthPlanner
from .drafters import DraftModel, NgramIndex, PromptLookup, SuffixTree, SuffixTreeDrafter

__all__ = ["METHODS", "SpecConfig", "Speculator", "DEFAULT_COST_PER_DRAFT"]

METHODS = ("prompt_lookup", "suffix_tree", "draft_model")

#: Extra cost of one draft column per agent, in decode steps (`AdaptiveLength`). CPU: measured on
#: the 2-core sandbox with SmolLM2-135M over the 1.8k-token demo document (docs/speculative.md);
#: CUDA: verify columns fill the tile a decode step pads (issue I), a few percent at most.
DEFAULT_COST_PER_DRAFT = {"cpu": 0.1, "cuda": 0.05}


@dataclass
class SpecConfig:
    method: str = "prompt_lookup"
    num_draft_tokens: int = 4
    adaptive: bool = True
    max_ngram: int = 6
    min_ngram: int = 2
    cost_per_draft: float | None = None  # None: DEFAULT_COST_PER_DRAFT of the device
    draft_model: object = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; methods: {', '.join(METHODS)}")
        if type(self.num_draft_tokens) is not int or not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be an integer in [1, 16], got {self.num_draft_tokens!r}")
        if not 1 <= int(self.min_ngram) <= int(self.max_ngram):
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError('method "draft_model" needs draft_model= (a DraftModel or a causal LM)')

    @classmethod
    def parse(cls, obj) -> "SpecConfig | None":
        """None / False / {} -> None (off); True -> defaults; "method[:k]"; a dict of the fields; a
        SpecConfig."""
        if obj is None or obj is False or obj == {} or obj == "":
            return None
        if isinstance(obj, cls):
            return obj
        if obj is True:
            return cls()
        if isinstance(obj, str):
            method, _, k = obj.partition(":")
            if k and not k.strip().isdigit():
                raise ValueError(f"the draft length after ':' must be an integer, got {obj!r} "
                                 f"(e.g. \"prompt_lookup:4\")")
            return cls(method=method or "prompt_lookup", **({"num_draft_tokens": int(k)} if k else {}))
        if isinstance(obj, dict):
            unknown = set(obj) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown speculative fields {sorted(unknown)}")
            return cls(**obj)
        raise TypeError(f"speculative must be a dict, a string or None, got {type(obj).__name__}")


class _AgentSpec:
    __slots__ = ("context", "drafter", "length", "handle", "key", "logged", "found")

    def __init__(self, context, drafter, length, handle, key):
        self.context, self.drafter, self.length, self.handle, self.key = context, drafter, length, handle, key
        self.logged = 0  # tokens extended into the handle (added by the tree or still logged)
        self.found = True  # its last drafting found drafts (a static batch's forecast: `_most_drafts`)


class Speculator:
    """See module doc. index / tree: the document's n-gram index and outputs tree (either may be
    None: prompt lookup then matches the agent's own tokens only; no tree is updated)."""

    def __init__(self, index: NgramIndex | None = None, tree: SuffixTree | None = None, device_type: str = "cpu",
                 times: StepTimes | None = None, overlap: bool = False):
        self.index, self.tree, self.device_type = index, tree, device_type
        self.overlap = bool(overlap)  # the tree read one step late, its adds in `ahead` (module doc)
        self._agents: dict = {}
        self.prior = DEFAULT_COST_PER_DRAFT.get(device_type, DEFAULT_COST_PER_DRAFT["cpu"])
        self.step_cost = StepCost(self.prior)  # measured from `observe_step`; agents without a set cost use it
        self.times = times if times is not None else StepTimes()  # per (agents, width): `propose_all`
        self.planner: WidthPlanner | None = None  # created by the first adaptive agent
        self.widths: Counter = Counter()  # widths `propose_all` chose, per step
        self.steps = self.drafted = self.accepted = self.tokens = self.agent_steps = 0
        self.full_accepts = 0  # (agent, verify step) pairs whose every draft was accepted
        self.pipelined_steps = 0  # plain steps `plain_next` let the loop launch ahead
        self._tree_readers = 0  # agents drafting from the tree: `ahead` adds its log only for them

    def add(self, key, prompt_ids: list[int], config: SpecConfig) -> None:
        lookup = PromptLookup(self.index, config.max_ngram, config.min_ngram)
        if config.method == "prompt_lookup":
            drafter = lookup
        elif config.method == "suffix_tree":
            drafter = SuffixTreeDrafter(self.tree if self.tree is not None else SuffixTree(), lookup)
            self._tree_readers += 1
        else:
            dm = config.draft_model
            drafter = dm if isinstance(dm, DraftModel) else DraftModel(dm, list(self.index.ids) if self.index else [])
        cost = config.cost_per_draft
        # cost None: the StepCost itself, so the agent follows `observe_step` (read when needed)
        length = AdaptiveLength(config.num_draft_tokens, fixed=not config.adaptive,
                                cost_per_draft=self.step_cost if cost is None else cost)
        if config.adaptive:
            if self.planner is None:
                self.planner = WidthPlanner(config.num_draft_tokens, self.times, self.prior, cost)
            self.planner.k_max = max(self.planner.k_max, config.num_draft_tokens)
        if self.tree is not None:
            self.tree.fit(config.num_draft_tokens)  # builds only the depth drafts read
        handle = self.tree.start() if self.tree is not None else None
        self._agents[key] = _AgentSpec([int(t) for t in prompt_ids], drafter, length, handle, key)

    def __contains__(self, key) -> bool:
        return key in self._agents

    def propose(self, key, limit: int | None = None) -> list[int]:
        """Drafts to verify after the agent's context (prompt + every token `record`ed, the last of
        which is about to be fed); at most `limit` (e.g. the tokens it may still emit, minus the one
        every step emits anyway)."""
        st = self._agents[key]
        st.length.planned = False  # its own back-off decides again
        k = st.length.next()
        if limit is not None:
            k = min(k, int(limit))
        if k <= 0:
            return []
        return self._draft(st, k)

    def _draft(self, st: _AgentSpec, k: int) -> list[int]:
        if k <= 0:
            return []
        drafter = st.drafter
        kind = type(drafter)
        if kind is PromptLookup:
            return drafter.propose(st.context, k)  # never more than k
        if kind is SuffixTreeDrafter and drafter.tree is self.tree and self.tree is not None:
            return drafter.propose(st.context, k, st.handle)[:k]  # the handle holds the context's tail nodes
        if isinstance(drafter, DraftModel):
            return drafter.propose(st.context, k, key=st.key)[:k]
        return drafter.propose(st.context, k)[:k]

    def propose_all(self, limits: dict, agents: int | None = None, static: bool = False) -> dict:
        """Drafts for the next step of every agent in `limits` ({key: at most this many drafts}:
        the tokens it may still emit minus one): each drafts up to its num_draft_tokens, then
        the `WidthPlanner` picks the step's width w from the measured step times (`observe_step`)
        and the agents' acceptance and cuts the adaptive agents' drafts to w (0: plain decoding for
        all; agents of a fixed length keep theirs). agents: every agent of the step (default: the
        keys), those without drafts emit one token each. static: no prompt waits to join, so the
        planner aims at the batch's finish rather than its tokens per second (spec/adaptive.py,
        "Static batches"; limits must then be the tokens left minus one). Returns {key: drafts}
        (maybe empty).
        When the planner knows before any drafting that the step will be plain
        (`WidthPlanner.plain_ahead`: measuring T(0), or backed off), the adaptive agents draft
        nothing: a plain step of the speculative loop costs no drafting."""
        out = {}
        adaptive, wants, fixed_w = [], [], 0  # one pass over the agents: drafts, then what the planner needs
        get, draft, tree = self._agents.get, self._draft, self.tree if self.tree is not None else False
        lagged = self.overlap  # read the tree as `ahead` left it (the handle lacks the last step)
        planner = self.planner
        plain = planner is not None and planner.plain_ahead(
            lambda: self._most_drafts(limits, static), agents if agents is not None else len(limits))
        for key, limit in limits.items():
            st = get(key)
            if st is None:
                continue
            length = st.length
            k = length.k_max
            if limit < k:
                k = int(limit)
            if plain and not length.fixed:
                k = 0
            drafter = st.drafter
            kind = type(drafter)
            if k <= 0:
                d = out[key] = []
            elif kind is PromptLookup:  # `_draft`'s first two cases, without its call
                d = out[key] = drafter.propose(st.context, k)
            elif kind is SuffixTreeDrafter and drafter.tree is tree:  # SuffixTreeDrafter.propose, inlined
                d = tree.propose(st.context, k, st.handle, False, st.logged) if lagged else tree.propose(st.context, k, st.handle)
                if not d and drafter.fallback is not None:
                    d = drafter.fallback.propose(st.context, k)[:k]
                out[key] = d
            else:
                d = out[key] = draft(st, k)
            if length.fixed:
                fixed_w = max(fixed_w, len(d))
            else:
                length.planned = True  # acceptance only: the planner picks the width
                adaptive.append(key)
                acc = length.acc
                wants.append((acc / (acc + length.rej), len(d)))  # length.acceptance, inlined
                if k > 0:
                    st.found = bool(d)
        if planner is None or not adaptive:
            return out
        left, rest = self._left(limits, adaptive) if static else (None, 0)
        w = 0 if plain else planner.choose(wants, agents if agents is not None else len(limits), left, rest)
        self.widths[w] += 1
        w = max(w, fixed_w)  # free up to there
        for k, (_, n) in zip(adaptive, wants):
            if n > w:
                out[k] = out[k][:w]
        return out

    def plain_next(self, limits: dict, agents: int | None = None, static: bool = False) -> bool:
        """Whether the planner has decided the next step plain before any drafting
        (`WidthPlanner.plain_ahead`: backed off and waiting, or measuring T(0)) — a step the loop
        may launch before it reads the one in flight (pipelined, as plain decoding runs). True
        counts that step as `propose_all` would (one plain step of the planner); False changes
        nothing. False whenever an agent drafts at a fixed length (it always drafts) or none is
        adaptive, and when no agent may emit a token in that step (every limit below 0: the step
        would be wasted — the loop launches it beside the one it is about to run, so the planner's
        T(0) calibration, which approves any step, made a speculative call one step longer than
        plain decoding). limits, agents, static: as `propose_all`'s."""
        planner = self.planner
        if planner is None or all(int(n) < 0 for n in limits.values()):
            return False
        get, adaptive = self._agents.get, False
        for key in limits:
            st = get(key)
            if st is not None:
                if st.length.fixed:
                    return False
                adaptive = True
        if not adaptive or not planner.plain_ahead(lambda: self._most_drafts(limits, static),
                                                   agents if agents is not None else len(limits)):
            return False
        self.widths[0] += 1
        self.pipelined_steps += 1
        return True

    def _most_drafts(self, limits: dict, static: bool = False) -> tuple[list, list | None, int]:
        """(agents, left, rest) for `WidthPlanner.plain_ahead` before anything is drafted: agents =
        (acceptance, the most drafts it may have) of every adaptive agent in `limits`, a bound.
        static: the drafts are a forecast instead — none for an agent whose last drafting found
        none — and left / rest are `_left`'s (spec/adaptive.py, "Static batches")."""
        out, keys = [], []
        for key, limit in limits.items():
            st = self._agents.get(key)
            if st is not None and not st.length.fixed:
                length = st.length
                most = max(0, min(length.k_max, int(limit)))
                out.append((length.acceptance, most if st.found or not static else 0))
                keys.append(key)
        if not static:
            return out, None, 0
        return (out, *self._left(limits, keys))

    @staticmethod
    def _left(limits: dict, keys: list) -> tuple[list[int], int]:
        """(tokens left of each agent of `keys`, the most tokens left of any other agent in
        `limits`): a limit is the tokens left minus one."""
        inside = set(keys)
        rest = max((int(n) + 1 for key, n in limits.items() if key not in inside), default=0)
        return [int(limits[key]) + 1 for key in keys], rest

    def record(self, key, emitted: list[int], drafted: int) -> None:
        """After a step of agent `key`: the tokens it emitted (all of them, kept or not) and how many
        drafts it had verified."""
        st = self._agents.get(key)
        if st is None:
            return
        st.context.extend(map(int, emitted))
        if self.tree is not None:
            self.tree.extend_all(st.handle, emitted)  # logged; added when the tree is read
            st.logged += len(emitted)
        if drafted:
            acc = len(emitted) - 1
            length = st.length
            if length.planned:  # AdaptiveLength.update's planned case, without its call
                length.acc = length.decay * length.acc + acc
                length.rej = length.decay * length.rej + (1 if acc < drafted else 0)
            else:
                length.update(drafted, acc)
            self.drafted += drafted
            self.accepted += acc
            if acc == drafted:
                self.full_accepts += 1
            self.tokens += len(emitted)
            self.agent_steps += 1

    def observe_step(self, width: int, seconds: float, agents: int | None = None) -> None:
        """A timed batch decode step of `agents` agents (default: the agents added and not removed)
        whose widest agent verified `width` drafts (0: plain): into `times` (the planner's T(w))
        and `StepCost` (agents whose config left cost_per_draft unset draft by the cost measured so
        far). seconds: the step's whole wall, the host work that prepared it included (from the
        previous step's ids to its own: `record`, `propose_all`, the feed; adaptive.py's module
        doc). Leave out steps that prefilled prompts or captured a graph."""
        self.times.observe(agents if agents is not None else max(1, len(self._agents)), width, seconds)
        self.step_cost.observe(width, seconds)  # its agents read the fit when they next need it

    def ahead(self) -> None:
        """Host work that needs no token of the step in flight (overlap mode, module doc): the
        outputs tree adds every token logged so far. Called between `AgentBatch.launch_verify` and
        its `result()`. Harmless in the synchronous mode (the next read would add them anyway).
        Nothing when no agent of this speculator drafts from the tree (prompt lookup only logs its
        outputs, for later suffix-tree requests: `SuffixTree`'s laziness)."""
        if self._tree_readers and self.tree is not None:
            self.tree.flush()

    def step_done(self, verified: bool) -> None:
        """One batch step ran; `verified`: it had a verify forward."""
        if verified:
            self.steps += 1

    def remove(self, key) -> None:
        st = self._agents.pop(key, None)
        if st is not None and isinstance(st.drafter, DraftModel):
            st.drafter.forget(key)
        elif st is not None and type(st.drafter) is SuffixTreeDrafter:
            self._tree_readers -= 1

    def stats(self) -> dict:
        """steps: verify forwards; drafted / accepted: draft tokens verified / accepted; tokens:
        tokens emitted by agents in verify forwards; agent_steps: (agent, verify forward) pairs;
        tokens_per_step = tokens / agent_steps; acceptance = accepted / drafted; full_accepts: agent
        steps whose every draft was accepted (the most a draft made ahead, for the outcome "all
        accepted", could have served); cost_per_draft: the
        draft-column cost the adaptive length used last (`StepCost`), timed_widths: the widths of the
        timed steps it was fitted on; widths: {w: steps} the batch planner chose (`propose_all`;
        0 = plain); step_times_ms: {agent bucket: {width: ms}} the planner's measured T(w);
        pipelined_steps: plain steps launched ahead of the one in flight (`plain_next`)."""
        return dict(steps=self.steps, drafted=self.drafted, accepted=self.accepted, tokens=self.tokens,
                    agent_steps=self.agent_steps, full_accepts=self.full_accepts, cost_per_draft=self.step_cost.cost_per_draft,
                    timed_widths=sorted({w for w, _ in self.step_cost.obs}),
                    widths=dict(sorted(self.widths.items())), pipelined_steps=self.pipelined_steps,
                    step_times_ms={b: {w: t * 1e3 for w, t in ws.items()} for b, ws in self.times.table().items()},
                    tokens_per_step=self.tokens / self.agent_steps if self.agent_steps else 0.0,
                    acceptance=self.accepted / self.drafted if self.drafted else 0.0)
