"""Generation toolkit shared by the pool, the engine and the quality harness: which token ids end a
generation, how the next token is chosen, where a stop string cuts the text.

* `stop_token_ids(tok, model)`: the one EOS rule.
* `sample_rows` / `sample_next`: the one sampling rule (greedy, temperature, top-k, top-p), batched on
  the logits' device (`AgentBatch.step_tokens`) or one row at a time on the host (same draws: a row
  is a batch of one).
* `SamplingParams` / `Sampler`: a request's parameters and its private seeded generator (engine).
* `find_stop` / `StopChecker`: stop strings over finished or streamed text.

Pure torch (no transformers at import); tokenizers are duck-typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError

__all__ = ["END_OF_TURN_TOKENS", "Sampler", "SamplingParams", "StopChecker", "find_stop", "is_greedy",
           "sample_next", "sample_rows", "sample_token", "stop_token_ids"]

#: Chat end-of-turn markers (ChatML, Gemma, Llama-3). A chat model closes its answer with one of these
#: even where its configs name another EOS (Gemma-3's tokenizer says <eos>; an answer ends with
#: <end_of_turn>), and decoding skips them as special tokens, so generating past one produces text
#: the model means as a new turn.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")


# --------------------------------------------------------------------------------------------
# EOS
# --------------------------------------------------------------------------------------------


def stop_token_ids(tok, model=None) -> frozenset[int]:
    """The token ids that end a generation: the union of the tokenizer's `eos_token_id`, the model's
    `generation_config.eos_token_id` and (text) `config.eos_token_id` (each an int or a list), and
    every `END_OF_TURN_TOKENS` marker the tokenizer's vocabulary has."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    for src in (getattr(tok, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                getattr(cfg, "eos_token_id", None)):
        for x in (src if isinstance(src, (list, tuple)) else [src]):
            if isinstance(x, int) and not isinstance(x, bool):
                ids.add(int(x))
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    ids.update(int(vocab[t]) for t in END_OF_TURN_TOKENS if t in vocab)
    return frozenset(ids)


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def is_greedy(temperature: float | None, top_k: int | None = 0) -> bool:
    """Greedy (argmax, no random draw): temperature <= 0 (or None) or top_k == 1."""
    return temperature is None or temperature <= 0 or top_k == 1


def sample_rows(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int | None = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits float [G, vocab] -> int64 [G] token ids, on the logits' device, without host syncs.

    Greedy (`is_greedy`): argmax (ties: lowest id). Otherwise logits / temperature, filtered by top-k,
    then top-p (the smallest set of most likely tokens whose probability reaches top_p; the most
    likely token always stays), and one token per row drawn with `generator` (on the logits'
    device). A row whose filtered distribution is not finite (all -inf / nan logits) takes the argmax.
    """
    logits = logits.detach().float()
    best = torch.argmax(logits, dim=-1)
    if is_greedy(temperature, top_k):
        return best
    x = logits / float(temperature)
    if top_k and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sx, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sx, -1)
        drop = torch.cumsum(probs, -1) - probs >= top_p  # mass strictly before each token
        drop[:, 0] = False
        x = torch.full_like(x, float("-inf")).scatter(1, order, sx.masked_fill(drop, float("-inf")))
    p = torch.softmax(x, -1)
    ok = torch.isfinite(p).all(-1) & (p.sum(-1) > 0)
    p = torch.where(ok[:, None], p, torch.nn.functional.one_hot(best, p.shape[-1]).to(p.dtype))
    return torch.multinomial(p, 1, generator=generator)[:, 0]


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = 0,
                generator: torch.Generator | None = None) -> int:
    """logits float [vocab] -> token id: `sample_rows` on a batch of one row."""
    return int(sample_rows(logits.reshape(1, -1), temperature, top_p, top_k, generator)[0])


@dataclass
class SamplingParams:
    """Decoding parameters of one request (OpenAI semantics).

    ``temperature == 0`` means greedy. ``top_k <= 0`` or ``None`` disables top-k; ``top_p >= 1``
    disables nucleus filtering. ``seed`` seeds the request's private generator (``None``: a seed is
    drawn from the global torch RNG so the request is still independent of others).
    ``ignore_eos``: generate past `stop_token_ids`.
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
        return is_greedy(self.temperature, self.top_k)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from a ``[vocab]`` logits vector under ``params`` (`sample_next`)."""
    return sample_next(logits, params.temperature, params.top_p, params.top_k, generator)


class Sampler:
    """A request's sampling state: parameters and a private ``torch.Generator`` (CPU), so two
    requests never share random state: a seeded request gives the same tokens whatever else runs
    beside it."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)

    def __call__(self, logits: torch.Tensor) -> int:
        return sample_token(logits.to("cpu"), self.params, self.generator)


# --------------------------------------------------------------------------------------------
# stop strings
# --------------------------------------------------------------------------------------------


def find_stop(text: str, stops) -> int:
    """Index of the earliest occurrence of any stop string in `text`; -1 when there is none."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


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
        cut = find_stop(text, self.stops)
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
