"""Per-request token sampling: greedy, temperature, top-k, top-p, seeded generators, stop strings.

Every request owns a :class:`Sampler` (its parameters plus its own ``torch.Generator``), so two
requests never share random state: a seeded request gives the same tokens whatever else runs
beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequestError
from ..pool.sampling import sample_next

__all__ = ["SamplingParams", "Sampler", "StopChecker", "sample_token"]


@dataclass
class SamplingParams:
    """Decoding parameters of one request (OpenAI semantics).

    ``temperature == 0`` means greedy. ``top_k <= 0`` or ``None`` disables top-k; ``top_p >= 1``
    disables nucleus filtering. ``seed`` seeds the request's private generator (``None``: a seed is
    drawn from the global torch RNG so the request is still independent of others).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens must be a positive integer")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise InvalidRequestError("temperature must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from a ``[vocab]`` logits vector under ``params``.

    Greedy takes the argmax (ties: lowest id). Otherwise logits are divided by the temperature,
    filtered by top-k then top-p (the smallest set of most likely tokens whose probability reaches
    ``top_p``; the most likely token always stays), and one token is drawn with ``generator``.
    """
    if params.greedy:
        return int(torch.argmax(logits.detach().reshape(-1).float()))
    return sample_next(logits, params.temperature, params.top_p, params.top_k, generator)


class Sampler:
    """A request's sampling state: parameters and a private ``torch.Generator``."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)

    def __call__(self, logits: torch.Tensor) -> int:
        return sample_token(logits.to("cpu"), self.params, self.generator)


class StopChecker:
    """Incremental stop-string detection over streamed text.

    ``push(delta) -> (emit, stopped)``: the text that is safe to send now and whether a stop string
    was found. Text that could be the start of a stop string is held back until it can be decided;
    the stop string itself is never emitted. ``flush()`` returns whatever is still held back.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return text[:cut], True
        # hold back the longest suffix that is a proper prefix of some stop string
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out
