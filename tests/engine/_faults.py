"""Fault injection for engine and server tests: batches whose step fails when an agent's input holds
a poison token, after doing the real work (so a failed step leaves half-applied state behind, as a
real failure in the middle of a step does)."""

from __future__ import annotations

POISON = 49000  # a token id of SmolLM2's vocabulary that the tiny model's greedy answers here never hold


class InjectedFault(RuntimeError):
    pass


class FaultyBatch:
    """An agent batch (AgentBatch or DenseBatch) whose ``step()`` raises InjectedFault when the input
    of any agent pending this step contains ``poison``, or (``fail_steps``) on its first N steps."""

    def __init__(self, inner, poison: int = POISON, fail_steps: int = 0):
        self.inner = inner
        self.poison = poison
        self.fail_steps = fail_steps
        self.pending: dict[int, list[int]] = {}
        if hasattr(inner, "step_tokens"):  # the engine's device paths: the same faults apply
            self.step_tokens = lambda *a, **k: self._faulty(lambda: inner.step_tokens(*a, **k))
        if hasattr(inner, "step_tokens_ahead"):  # pipelined: fails after launching the step
            self.step_tokens_ahead = lambda *a, **k: self._faulty(lambda: inner.step_tokens_ahead(*a, **k))

    def add(self, ids) -> int:
        aid = self.inner.add(ids)
        self.pending[aid] = list(ids)
        return aid

    def feed(self, tokens: dict) -> None:
        self.inner.feed(tokens)
        for aid, t in tokens.items():
            self.pending.setdefault(aid, []).append(int(t))

    def remove(self, aid) -> None:
        self.inner.remove(aid)
        self.pending.pop(aid, None)

    def step(self):
        return self._faulty(self.inner.step)

    def _faulty(self, run):
        bad = [aid for aid, ids in self.pending.items() if self.poison in ids]
        out = run()  # the real work first: the failure comes after state changed
        if bad:
            raise InjectedFault(f"injected fault: input of agent(s) {bad} holds token {self.poison}")
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise InjectedFault("injected transient fault")
        self.pending = {aid: [] for aid in self.pending}
        return out

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class FaultyPool:
    """A pool whose batches are FaultyBatch; everything else goes to the wrapped pool."""

    def __init__(self, inner, poison: int = POISON, fail_steps: int = 0):
        self.__dict__.update(inner=inner, poison=poison, fail_steps=fail_steps, opened=[])

    def open_batch(self, doc, *args, **kwargs):
        b = FaultyBatch(self.inner.open_batch(doc, *args, **kwargs), self.poison, self.fail_steps)
        self.__dict__["fail_steps"] = 0  # a transient fault hits the first batch only
        self.opened.append(b)
        return b

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)
